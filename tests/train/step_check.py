"""Two runs of the trainer's step compared step by step, on data that the model learns in a few
steps: each step's loss, its gradient (the step's summed gradient as the optimizer receives it,
before clipping), the parameters' update and, over the run, how far the loss fell.

Losses on random tokens hardly tell a broken step from a working one: in a few steps a model
learns little more than the tokens' frequencies, and a step without any update ends near the same
loss. Here the loss falls by nats within a few steps, a step whose optimizer does nothing has
updates of zero; one that updates from zero gradients, or replays an
earlier step's gradients, has gradients far from the reference's and learns less. `SABOTAGES`
breaks a trainer in each of those ways, and tests/train/test_step_check.py (CPU) and
tests/train/test_compile.py (GPU, bf16 against fp32) show that `assert_same_steps` rejects each
at the tolerances the tests use for working steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tests.train.helpers import TINY_VOCAB, split_rows

ALPHABET = 64
"""Tokens that the learnable data cycles through: a next-token map the head and embeddings learn
in a few steps (the loss falls from ln(vocab) towards ln(ALPHABET) and below)."""

CPU_TOLERANCES = {"loss": 1e-5, "grad_norm": 1e-5, "gradient": 1e-4, "update": 1e-3, "loss_fall": 1e-4}
"""fp32 against fp32 on CPU (compiled blocks against eager ones): only the order of the roundings
differs (measured: about 1e-7 in the losses and norms, 5e-7 in the gradients, 4e-6 in the
updates)."""

GPU_TOLERANCES = {"loss": 2e-2, "grad_norm": 5e-2, "gradient": 0.2, "update": 0.6, "loss_fall": 0.1}
"""bf16 (compiled, CUDA graphs) against fp32 (eager) on the GPU. The gradient and the update are
loose: AdamW divides each gradient by its own running size, so a component whose gradient is
within bf16's rounding of zero moves by a whole step either way. A broken step misses them by far
more: its losses differ by over 0.1 and its updates by over 0.9 (relative) within 4 steps on the
CPU (tests/train/test_step_check.py), and it fails them on the GPU
(tests/train/test_compile.py::test_the_gpu_step_comparison_rejects_a_broken_step)."""

MIN_FALL = 1.0
"""Nats the reference loss must fall over a compared run (from ln(8192) = 9.0, the tiny CPU model
falls by about 2 in its first two updates at the tiny configs' learning rate)."""


def learnable_steps(steps: int, rows: int, seq_len: int, micro_batch: int, seed: int = 0, rank: int = 0,
                    world: int = 1) -> list[list[dict]]:
    """`steps` steps of `rows` rows; data-parallel rank `rank` of `world` takes the rank-th of
    `world` equal blocks of each step's rows, cut into micro-batches of `micro_batch` rows. Every
    row walks one fixed cycle through ALPHABET random tokens of the vocabulary, from a random
    start: the next token is a function of the current one. Each step starts its rows at other
    places."""
    generator = torch.Generator().manual_seed(seed)
    alphabet = torch.randperm(TINY_VOCAB, generator=generator)[:ALPHABET]
    mine = slice(rank * rows // world, (rank + 1) * rows // world)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, ALPHABET, (rows, 1), generator=generator)
        tokens = alphabet[(starts + torch.arange(seq_len + 1)) % ALPHABET][mine]
        out.append(split_rows(tokens[:, :-1].clone(), tokens[:, 1:].clone(), micro_batch))
    return out


def flat_parameters(model) -> torch.Tensor:
    """Every parameter, fp32, in one vector on its device (sharded ones gathered)."""
    return torch.cat([full(p.detach()).float().reshape(-1) for p in model.parameters()])


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) tensor gathered whole; any other tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


@dataclass
class StepTrace:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    gradients: list[torch.Tensor] = field(default_factory=list)
    """Each step's gradient of every trainable parameter, as the optimizer step receives it."""
    updates: list[torch.Tensor] = field(default_factory=list)
    """Each step's change of every parameter."""


def trace_steps(trainer, steps: list[list[dict]], broken=None) -> StepTrace:
    """Run `steps` through trainer.train_step and record each step; the gradients are read where
    the pipeline launches the optimizer step. `broken` (one of SABOTAGES) breaks the trainer's step
    first, between the backward and what is recorded. The trainer keeps the recording: one trace
    per trainer."""
    trace = StepTrace()
    launch = trainer.pipeline.launch

    def recording_launch(gradients):
        grads = [full(p.grad).float().reshape(-1) if p.grad is not None else torch.zeros(p.numel(), device=p.device)
                 for p in trainer.model.parameters() if p.requires_grad]
        trace.gradients.append(torch.cat(grads))
        return launch(gradients)

    trainer.pipeline.launch = recording_launch
    if broken is not None:
        broken(trainer)
    before = flat_parameters(trainer.model)
    for micro_batches in steps:
        result = trainer.train_step(micro_batches)
        assert not result.skipped, f"step {len(trace.losses) + 1} was skipped"
        after = flat_parameters(trainer.model)
        trace.losses.append(result.loss)
        trace.grad_norms.append(result.grad_norm)
        trace.updates.append(after - before)
        before = after
    return trace


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(value - reference) / torch.linalg.vector_norm(reference))


def step_differences(run: StepTrace, reference: StepTrace) -> dict[str, float]:
    """The largest relative difference over the steps of the losses, the gradient norms, the
    gradients and the updates (each a vector over every parameter), and the relative difference
    of the loss's fall from the first step to the last."""
    assert len(run.losses) == len(reference.losses) >= 2
    fall = reference.losses[0] - reference.losses[-1]
    return {
        "loss": max(abs(a - b) / abs(b) for a, b in zip(run.losses, reference.losses)),
        "grad_norm": max(abs(a - b) / b for a, b in zip(run.grad_norms, reference.grad_norms)),
        "gradient": max(relative_error(a, b) for a, b in zip(run.gradients, reference.gradients)),
        "update": max(relative_error(a, b) for a, b in zip(run.updates, reference.updates)),
        "loss_fall": abs((run.losses[0] - run.losses[-1]) - fall) / fall,
    }


def assert_same_steps(run: StepTrace, reference: StepTrace, tolerances: dict[str, float],
                      min_fall: float) -> None:
    """Every difference of `step_differences` within its tolerance, and the reference's loss fell
    by at least `min_fall` nats (so that the data was learned and the comparison of the falls means
    something)."""
    fall = reference.losses[0] - reference.losses[-1]
    assert fall >= min_fall, f"the reference run learned too little: its loss fell {fall:.3f} nats, {reference.losses}"
    differences = step_differences(run, reference)
    over = {k: v for k, v in differences.items() if v > tolerances[k]}
    assert not over, (f"steps differ beyond tolerance in {sorted(over)}: {differences} (tolerances {tolerances}); "
                      f"losses {run.losses} against {reference.losses}")


# ---- broken steps ------------------------------------------------------------------------------

def no_op_optimizer(trainer) -> None:
    """The optimizer's step does nothing."""
    trainer.optimizer.step = lambda *args, **kwargs: None


def zeroed_gradients(trainer) -> None:
    """The optimizer step sees zero gradients (as from a backward whose gradients never arrive)."""
    launch = trainer.pipeline.launch

    def zeroing_launch(gradients):
        for p in trainer.model.parameters():
            if p.grad is not None:
                p.grad.zero_()
        return launch(gradients)

    trainer.pipeline.launch = zeroing_launch


def stale_gradients(trainer) -> None:
    """Every optimizer step sees the first step's gradients (as from a replayed backward that
    reads an old input)."""
    launch = trainer.pipeline.launch
    first: list[torch.Tensor | None] = []

    def stale_launch(gradients):
        params = list(trainer.model.parameters())
        if not first:
            first.extend(p.grad.detach().clone() if p.grad is not None else None for p in params)
        for p, old in zip(params, first):
            if p.grad is not None and old is not None:
                p.grad.copy_(old)
        return launch(gradients)

    trainer.pipeline.launch = stale_launch


SABOTAGES = {"no-op optimizer": no_op_optimizer, "zeroed gradients": zeroed_gradients,
             "stale gradients": stale_gradients}
