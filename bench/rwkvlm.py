"""RWKV-LM's own RWKV7 (x070) and RWKV6 (x060) trainer step, run beside flame's on the same weights
and the same batches.

    python -m bench.rwkvlm build --config configs/rwkv7_rwkvlm_demo.toml
    python -m bench.rwkvlm init  --config configs/rwkv7_rwkvlm_demo.toml --seed 0 --out init.pth
    python -m bench.rwkvlm train --config configs/rwkv7_rwkvlm_demo.toml --init init.pth --out DIR
    python -m bench.rwkvlm parity --config configs/rwkv6_rwkvlm_demo.toml
    python -m bench.rwkvlm report RUN [RUN ...] --out curves.png

The config's `model.family` picks RWKV-LM's trainer (`GENERATIONS`): rwkv7 runs its
`RWKV-v7/train_temp` with `--my_testing x070`, rwkv6 its `RWKV-v5` with `--my_testing x060`.
RWKV-LM (BlinkDL/RWKV-LM at commit RWKVLM_COMMIT) is never part of flame: put a checkout in
`.rwkvlm/RWKV-LM` (ignored by git) or name one with FLAME_RWKVLM_DIR. What runs is RWKV-LM's code,
not a re-implementation of it:
- its model class `src.model.RWKV` with its CUDA kernels (compiled on first use by its own
  `torch.utils.cpp_extension.load` calls: for x070 the chunked attention is its
  `rwkv7_clampw_v3` "@rwkv3" H100 kernel, for x060 its `wkv6` kernel), its `training_step`
  (cross-entropy with L2Wrap), `generate_init_weight` (the initial weights) and
  `configure_optimizers` (its parameter groups: decay on every `.weight` matrix, the embedding
  and head included; `att.w0` or `att.time_decay` at 2x LR);
- its LR schedule, `train_callback.on_train_batch_start` (warmup from 1%, cosine to lr_final
  over `my_exit_tokens`), called before every step as PyTorch Lightning calls it.
Two pieces of its trainer are stood in for, because its DeepSpeed / Lightning stack is not
installed where the comparison runs: DeepSpeed's bf16 ZeRO stage 2 on one GPU, which keeps the
model in bf16 and fp32 master weights in the optimizer, becomes `MasterWeightAdamW` (the same
arithmetic: bf16 gradients copied to fp32, clipped by global norm, AdamW on the fp32 masters with
RWKV-LM's groups, masters rounded back into the bf16 model); and Lightning's loop becomes
`RwkvLmTrainer.step`. The batches come from flame's own data loader for the same config, so
both trainers read the same tokens in the same order (docs/rwkv-lm.md).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

RWKVLM_COMMIT = "524481d"
"""The RWKV-LM commit the comparison was made with (`git -C RWKV-LM checkout 524481d`)."""
REPO = Path(__file__).resolve().parents[1]
DEFAULT_DIR = REPO / ".rwkvlm" / "RWKV-LM"
DEFAULT_CONFIG = "configs/rwkv7_rwkvlm_demo.toml"


class RwkvLmMissing(RuntimeError):
    """RWKV-LM's trainer cannot run: no checkout, no GPU, or none for the model family."""


@dataclass(frozen=True)
class Generation:
    """One of RWKV-LM's trainers: where its train.py is, the environment it sets before it imports
    its model, and the arguments its model, `configure_optimizers` and `train_callback` read beyond
    the ones every generation shares (`rwkvlm_args`), at the values of its demo run."""

    my_testing: str
    """Its `--my_testing`, which picks the model classes."""
    folder: Path
    """Its train.py's folder inside the checkout."""
    head_size_variable: str
    """The environment variable of the head size (its kernels' `_N_`)."""
    head_size_arg: str
    """The same in `args`."""
    environment: dict[str, str] = field(default_factory=dict)
    """Further variables its train.py sets, as its demo flags set them."""
    args: dict = field(default_factory=dict)
    """Further arguments: the demo's flags, and its train.py's defaults where the demo names none."""
    kernel_variable: bool = False
    """Whether `RWKV_KERNEL` (its `--kernel`) picks the attention kernel."""
    kernel_per_ctx_len: bool = False
    """Whether its kernel is compiled for one ctx_len (`-D_T_`), under one extension name."""


GENERATIONS = {
    # RWKV-v7/train_temp/train.py; demo-training-run.sh passes --kernel @rwkv3.
    "rwkv7": Generation(
        my_testing="x070", folder=Path("RWKV-v7") / "train_temp",
        head_size_variable="RWKV_HEAD_SIZE", head_size_arg="head_size",
        environment={"RWKV_HEAD_L2WRAP_CE_CHUNK": "0"}, args={"head_chunk": 0, "train_stage": 3},
        kernel_variable=True),
    # RWKV-v5/train.py with --my_testing x060 (demo-training-run.sh: "x060 => rwkv-6.0"): one
    # kernel, cuda/wkv6_cuda.cu, built for the head size and ctx_len (`_N_`, `_T_`).
    "rwkv6": Generation(
        my_testing="x060", folder=Path("RWKV-v5"),
        head_size_variable="RWKV_HEAD_SIZE_A", head_size_arg="head_size_a",
        environment={"RWKV_TRAIN_TYPE": ""},
        args={"head_size_divisor": 8, "train_type": "", "layerwise_lr": 1, "my_pile_stage": 3,
              "my_pile_edecay": 0, "weight_decay_final": -1.0, "pre_ffn": 0, "head_qk": 0,
              "tiny_att_dim": 0, "tiny_att_layer": -999, "my_pos_emb": 0, "dropout": 0.0,
              "my_qa_mask": 0, "my_random_steps": 0, "my_exit": 99999999},
        kernel_per_ctx_len=True),
}
"""RWKV-LM's trainer for each flame `model.family`."""


def generation(family: str) -> Generation:
    """RWKV-LM's trainer of flame's `model.family`."""
    if family not in GENERATIONS:
        raise RwkvLmMissing(f"RWKV-LM has no trainer for model.family = {family!r} (bench.rwkvlm runs "
                            f"{' and '.join(GENERATIONS)})")
    return GENERATIONS[family]


def rwkvlm_dir(family: str = "rwkv7") -> Path:
    """The folder of `family`'s train.py in the RWKV-LM checkout (FLAME_RWKVLM_DIR or .rwkvlm/RWKV-LM)."""
    root = Path(os.environ.get("FLAME_RWKVLM_DIR", DEFAULT_DIR)).resolve()
    subfolder = generation(family).folder
    folder = root / subfolder
    if not (folder / "src" / "model.py").is_file():
        raise RwkvLmMissing(
            f"no RWKV-LM checkout at {root} (looked for {subfolder}/src/model.py): clone "
            f"https://github.com/BlinkDL/RWKV-LM, check out {RWKVLM_COMMIT}, and put it there or "
            "set FLAME_RWKVLM_DIR")
    return folder


def rwkvlm_args(model_cfg, training_cfg, optimizer_cfg, scheduler_cfg, steps: int) -> SimpleNamespace:
    """The argument namespace RWKV-LM's train.py builds for flame's config sections, for the
    trainer of `model_cfg.family`, with its demo flags: bf16, one GPU, deepspeed stage 2, no
    gradient checkpointing."""
    gen = generation(model_cfg.family)
    real_bsz = training_cfg.batch_size * training_cfg.gradient_accumulation_steps
    return SimpleNamespace(
        my_testing=gen.my_testing, n_layer=model_cfg.num_layers, n_embd=model_cfg.hidden_size,
        dim_att=model_cfg.hidden_size, dim_ffn=int((model_cfg.hidden_size * 3.5) // 32 * 32),
        vocab_size=model_cfg.vocab_size, ctx_len=training_cfg.seq_len,
        micro_bsz=training_cfg.batch_size, real_bsz=real_bsz, grad_cp=0,
        lr_init=optimizer_cfg.lr, lr_final=scheduler_cfg.lr_min,
        warmup_steps=scheduler_cfg.warmup_steps - 1 if scheduler_cfg.warmup_start > 0 else scheduler_cfg.warmup_steps,
        betas=tuple(optimizer_cfg.betas), adam_eps=optimizer_cfg.eps,
        weight_decay=optimizer_cfg.weight_decay, grad_clip=training_cfg.max_norm,
        # the cosine ends after `steps` updates: RWKV-LM's exit point in tokens
        my_exit_tokens=steps * training_cfg.seq_len * real_bsz, magic_prime=0,
        # its train.py: epoch_count = magic_prime // 40320
        epoch_count=0, epoch_begin=0, epoch_steps=1, epoch_save=0, proj_dir="",
        strategy="deepspeed_stage_2", accelerator="GPU", precision="bf16", load_model="", wandb="",
        my_timestamp="", data_type="binidx",
        **{gen.head_size_arg: model_cfg.head_dim}, **gen.args,
    )


def rwkvlm_environment(family: str, head_size: int, ctx_len: int, kernel: str, jit: bool) -> dict[str, str]:
    """The environment variables RWKV-LM's train.py of `family` sets before it imports its model."""
    gen = generation(family)
    env = {"RWKV_MY_TESTING": gen.my_testing, "RWKV_CTXLEN": str(ctx_len), gen.head_size_variable: str(head_size),
           "RWKV_FLOAT_MODE": "bf16", "RWKV_JIT_ON": "1" if jit else "0", **gen.environment}
    if gen.kernel_variable:
        env["RWKV_KERNEL"] = kernel
    return env


@contextlib.contextmanager
def _in_folder(folder: Path):
    """The working directory set to RWKV-LM's train.py folder, as its train.py runs (its load()
    calls name the CUDA sources relative to it), restored after."""
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(cwd)


def _import_src(family: str, package: str):
    """`family`'s `src/model.py` and `src/trainer.py` imported as `{package}.model` and
    `{package}.trainer`: each generation's folder has its own `src` package, so each import gets a
    name of its own (TorchScript, which compiles its modules, reads their source through
    sys.modules)."""
    folder = rwkvlm_dir(family)
    spec = importlib.util.spec_from_file_location(package, folder / "src" / "__init__.py",
                                                  submodule_search_locations=[str(folder / "src")])
    sys.modules[package] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules[package])
    with _in_folder(folder):
        return importlib.import_module(f"{package}.model"), importlib.import_module(f"{package}.trainer")


@contextlib.contextmanager
def _extensions_folder(family: str, ctx_len: int):
    """TORCH_EXTENSIONS_DIR, for a generation whose kernel is compiled for one ctx_len, set to a
    subfolder per ctx_len while its model imports: torch names an extension's build folder after
    the extension alone, so processes of two ctx_lens would rebuild each other's build there."""
    import torch.utils.cpp_extension as cpp_extension

    if not generation(family).kernel_per_ctx_len:
        yield
        return
    before = os.environ.get("TORCH_EXTENSIONS_DIR")
    root = before or cpp_extension.get_default_build_root()
    os.environ["TORCH_EXTENSIONS_DIR"] = os.path.join(root, f"rwkvlm-ctx{ctx_len}")
    try:
        yield
    finally:
        if before is None:
            del os.environ["TORCH_EXTENSIONS_DIR"]
        else:
            os.environ["TORCH_EXTENSIONS_DIR"] = before


class _Built(Exception):
    """Raised by the stand-in of `cpp_extension.load` once its extension is built, to end the import there."""


@contextlib.contextmanager
def _extensions_skipped(build: int | None = None):
    """`torch.utils.cpp_extension.load` skipped during an import of RWKV-LM's model, but for call
    number `build`, which builds its extension and raises _Built. Yields the list of the names
    the calls asked for."""
    import torch.utils.cpp_extension as cpp_extension

    calls = []
    real_load = cpp_extension.load

    def load(*args, **kwargs):
        calls.append(kwargs.get("name"))
        if build is not None and len(calls) - 1 == build:
            real_load(*args, **kwargs)
            raise _Built
        return SimpleNamespace()

    cpp_extension.load = load
    try:
        yield calls
    finally:
        cpp_extension.load = real_load


def _build_one(family: str, head_size: int, ctx_len: int, index: int | None, kernel: str) -> int:
    """Import RWKV-LM's model with every `cpp_extension.load` call but number `index` (and the
    registrations that need the built ops) skipped; build that one, then stop. With index None,
    build nothing and return the number of load calls. Run in a process of its own."""
    os.environ.update(rwkvlm_environment(family, head_size, ctx_len, kernel, jit=True))
    torch.library.register_autograd = lambda *a, **k: None
    torch.jit.script = lambda fn, *a, **k: fn
    with _extensions_skipped(index) as calls, _extensions_folder(family, ctx_len):
        try:
            _import_src(family, "rwkvlm_build")
        except _Built:
            pass
    return len(calls)


def build_kernels(cfg, kernel: str = "@rwkv3", log=print) -> None:
    """Build RWKV-LM's CUDA extensions for the config's family, head size and ctx_len (in
    TORCH_EXTENSIONS_DIR) in parallel processes, one per `load` call of its model module, so that
    importing the model afterwards finds them built (its own import builds them one after the other)."""
    import subprocess

    family, head_size, ctx_len = cfg.model.family, cfg.model.head_dim, cfg.training.seq_len

    def child(index) -> subprocess.Popen:
        code = f"import bench.rwkvlm as r; print(r._build_one({family!r}, {head_size}, {ctx_len}, {index}, {kernel!r}))"
        return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, cwd=REPO)

    counter = child(None)
    output, _ = counter.communicate()
    if counter.returncode != 0:
        raise RuntimeError(f"importing RWKV-LM's {family} model failed:\n{output[-3000:]}")
    count = int(output.strip().splitlines()[-1])
    start = time.time()
    children = [child(i) for i in range(count)]
    for i, proc in enumerate(children):
        output, _ = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"building RWKV-LM's extension {i} failed:\n{output[-3000:]}")
    log(f"built RWKV-LM's {count} CUDA extension(s) for {family} in {time.time() - start:.0f} s")


_IMPORTED: dict[tuple, tuple] = {}


def import_rwkvlm(family: str, head_size: int, ctx_len: int, *, kernel: str = "@rwkv3", jit: bool = True,
                  extensions: bool = True):
    """RWKV-LM's `src.model` and `src.trainer` modules of `family`'s trainer, imported as its
    train.py imports them (its environment variables set first; its CUDA extensions built from
    its `cuda/` folder), once per process and set of arguments.

    With `extensions=False` its `cpp_extension.load` calls are skipped and no GPU is needed: the
    model's Python code runs until it calls a kernel, which the caller replaces (tests/bench)."""
    key = (family, head_size, ctx_len, kernel, jit, extensions)
    if key in _IMPORTED:
        return _IMPORTED[key]
    if extensions and not torch.cuda.is_available():
        raise RwkvLmMissing("RWKV-LM's trainer needs a CUDA GPU")
    os.environ.update(rwkvlm_environment(family, head_size, ctx_len, kernel, jit))
    with contextlib.nullcontext() if extensions else _extensions_skipped(), _extensions_folder(family, ctx_len):
        model_module, trainer_module = _import_src(family, f"rwkvlm_{generation(family).my_testing}_{len(_IMPORTED)}")
    if extensions:
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    _IMPORTED[key] = model_module, trainer_module
    return model_module, trainer_module


class MasterWeightAdamW:
    """DeepSpeed's bf16 ZeRO-2 optimizer on one GPU, as RWKV-LM's trainer runs it: the model's
    parameters are bf16; the optimizer keeps fp32 masters of them, takes the bf16 gradients as
    fp32, clips them by their global norm, runs AdamW (bias-corrected, decoupled weight decay, as
    DeepSpeed's FusedAdam in adam_w_mode) on the masters, and rounds the masters into the model.

    Its constructor takes FusedAdam's arguments, so RWKV-LM's `configure_optimizers` builds it."""

    def __init__(self, optim_groups, lr, betas, eps, bias_correction=True, adam_w_mode=True,
                 amsgrad=False, weight_decay=0.0):
        if not bias_correction or amsgrad:
            raise ValueError("MasterWeightAdamW: RWKV-LM's groups use bias correction, no amsgrad")
        self.model_params = [list(g["params"]) for g in optim_groups]
        groups = []
        for group in optim_groups:
            masters = [p.detach().float().clone() for p in group["params"]]
            groups.append({**group, "params": masters,
                           "weight_decay": group.get("weight_decay", weight_decay) if adam_w_mode else 0.0})
        self.optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)
        self.param_groups = self.optimizer.param_groups
        self.grad_clip = 0.0

    def masters(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def step(self) -> torch.Tensor:
        """One update from the model's gradients; returns the global gradient norm (before clipping)."""
        for model_params, group in zip(self.model_params, self.optimizer.param_groups):
            for p, master in zip(model_params, group["params"]):
                master.grad = p.grad.float() if p.grad is not None else torch.zeros_like(master)
        masters = self.masters()
        if self.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(masters, self.grad_clip, foreach=True)
        else:
            norm = torch.nn.utils.get_total_norm([m.grad for m in masters], foreach=True)
        self.optimizer.step()
        with torch.no_grad():
            for model_params, group in zip(self.model_params, self.optimizer.param_groups):
                if model_params:  # a group may be empty (x060's lr_3x)
                    torch._foreach_copy_(model_params, group["params"])
        for params in self.model_params:
            for p in params:
                p.grad = None
        for m in masters:
            m.grad = None
        return norm


def lightning_stand_in() -> SimpleNamespace:
    """The attributes of Lightning's Trainer that RWKV-LM's model and LR callback read, on one GPU
    (not rank zero, so that neither logs nor saves)."""
    return SimpleNamespace(is_global_zero=False, strategy=None, global_step=0, optimizers=[], my_lr=0.0, my_wd=0.0)


def rwkvlm_optimizer(model_module, model, lightning: SimpleNamespace) -> MasterWeightAdamW:
    """RWKV-LM's `configure_optimizers` for `model` (its groups), constructing `MasterWeightAdamW`
    where it constructs DeepSpeed's FusedAdam, with its `grad_clip`; set as Lightning's optimizer."""
    model_module.FusedAdam = MasterWeightAdamW
    model._trainer = lightning
    with contextlib.redirect_stdout(sys.stderr):  # it prints its groups
        optimizer = model.configure_optimizers()
    optimizer.grad_clip = model.args.grad_clip
    lightning.optimizers = [optimizer]
    return optimizer


def callback_lr(callback, lightning: SimpleNamespace, step: int) -> float:
    """RWKV-LM's LR for update `step` (0-based): its callback's `on_train_batch_start`, which sets
    it on every group of Lightning's optimizer."""
    lightning.global_step = step
    callback.on_train_batch_start(lightning, None, None, step)
    return lightning.my_lr


class RwkvLmTrainer:
    """RWKV-LM's model, optimizer groups, schedule and training step for flame's config sections."""

    def __init__(self, cfg, init_path: str | Path, steps: int, *, kernel: str = "@rwkv3", jit: bool = True):
        self.args = rwkvlm_args(cfg.model, cfg.training, cfg.optimizer, cfg.lr_scheduler, steps)
        self.model_module, self.trainer_module = import_rwkvlm(cfg.model.family, cfg.model.head_dim,
                                                               cfg.training.seq_len, kernel=kernel, jit=jit)
        model = self.model_module.RWKV(self.args)
        state = torch.load(init_path, map_location="cpu", weights_only=True)
        model.load_state_dict(state)
        self.model = model.cuda().bfloat16()  # DeepSpeed bf16: the module itself is bf16
        self.model.train()
        self.lightning = lightning_stand_in()
        self.optimizer = rwkvlm_optimizer(self.model_module, self.model, self.lightning)
        self.callback = self.trainer_module.train_callback(self.args)

    def set_lr(self, step: int) -> float:
        """RWKV-LM's LR for update `step` (0-based), set on every group as its callback does."""
        return callback_lr(self.callback, self.lightning, step)

    def forward_backward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Its training_step's loss (mean CE with L2Wrap's gradient) and its backward."""
        # contiguous, as its DataLoader hands them (x060's step views them flat)
        loss = self.model.training_step((input_ids.cuda().contiguous(), labels.cuda().contiguous()), 0)
        loss.backward()
        return loss.detach()

    def step(self, step: int, input_ids: torch.Tensor, labels: torch.Tensor) -> dict:
        lr = self.set_lr(step)
        loss = self.forward_backward(input_ids, labels)
        norm = self.optimizer.step()
        return {"loss": loss, "grad_norm": norm, "lr": lr}

    def master_state(self) -> dict[str, torch.Tensor]:
        """The fp32 master weights by RWKV-LM name."""
        ids = {id(p): n for n, p in self.model.named_parameters()}
        out = {}
        for params, group in zip(self.optimizer.model_params, self.optimizer.param_groups):
            for p, master in zip(params, group["params"]):
                out[ids[id(p)]] = master
        return out


def write_init(cfg, seed: int, out: str | Path) -> None:
    """RWKV-LM's initial weights for the config's model shape: `generate_init_weight` after
    seeding torch with `seed` (train.py's --random_seed), saved as its train.py saves them (bf16)."""
    args = rwkvlm_args(cfg.model, cfg.training, cfg.optimizer, cfg.lr_scheduler, cfg.training.steps)
    start = time.time()
    model_module, _ = import_rwkvlm(cfg.model.family, cfg.model.head_dim, cfg.training.seq_len)
    imported = time.time()
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)
    # On the GPU, so that the orthogonal init of the head (a QR of a vocab x width matrix, done on
    # whatever device the parameter is on) is not a many-threaded CPU QR.
    model = model_module.RWKV(args).cuda()
    built = time.time()
    with contextlib.redirect_stdout(sys.stderr):
        weights = model.generate_init_weight()
    generated = time.time()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    torch.save(weights, out)
    print(f"RWKV-LM init (seed {seed}): import and kernels {imported - start:.1f} s, model "
          f"{built - imported:.1f} s, generate_init_weight {generated - built:.1f} s, save "
          f"{time.time() - generated:.1f} s", file=sys.stderr)


def relative_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp64 (0 when both are 0)."""
    a, b = a.double(), b.double()
    denominator = b.norm().item()
    difference = (a - b).norm().item()
    return difference / denominator if denominator > 0 else difference


def one_step_parity(cfg, init: str | Path, input_ids: torch.Tensor, labels: torch.Tensor) -> dict:
    """flame's and RWKV-LM's training step from the same weights on the same batch.

    flame's side is its one-GPU step: fp32 weights under bf16 autocast, the fused head with
    L2Wrap, `build_optimizer` and `build_lr_scheduler` of the config, `clip_grad_norm`. Returns
    the losses (RWKV-LM's in fp32: where its step returns a bf16 loss, the cross-entropy of its
    logits in fp32; "rwkvlm_returned" as its step returns it), per-tensor relative RMS of the gradients, of the parameters after one update
    from each trainer's own gradients ("step"), and after one update of flame's optimizer from
    RWKV-LM's gradients ("optimizer": the hyperparameters, groups, LR and clipping alone), each
    keyed by RWKV-LM name; and for the tensors that start at zero, the fraction of elements whose
    first update has opposite signs in the two trainers ("zero_start_sign_flips": AdamW's first
    update is lr x sign(gradient) per element, so there the relative RMS of the parameters
    measures sign disagreements of near-zero gradients, not the size of the update)."""
    from flame.train.gradients import clip_grad_norm
    from flame.ops.linear_cross_entropy import IGNORE_INDEX
    from flame.train.lr_schedule import build_lr_scheduler
    from flame.train.optimizer import build_optimizer
    from flame.weights.foreign import read_exported
    from flame.weights.load import build_with_weights
    from flame.weights.rwkv_names import from_rwkv, to_rwkv

    reference = RwkvLmTrainer(cfg, init, cfg.training.steps)
    lr = reference.set_lr(0)
    logits = []
    hook = reference.model.head.register_forward_hook(lambda module, inputs, output: logits.append(output))
    loss_returned = reference.forward_backward(input_ids, labels)
    hook.remove()
    loss_reference = loss_returned.float().item()
    if loss_returned.dtype != torch.float32 and logits:
        # x060's step returns F.cross_entropy of its bf16 logits in bf16, rounded by up to 2^-8
        # (more than the bound): compare with the cross-entropy of those logits in fp32.
        with torch.no_grad():
            loss_reference = torch.nn.functional.cross_entropy(
                logits[0].float().flatten(0, 1), labels.cuda().flatten()).item()
    del logits
    reference_grads = {n: p.grad.float().clone() for n, p in reference.model.named_parameters()
                       if p.grad is not None}
    reference.optimizer.step()
    reference_masters = {n: m.detach().clone() for n, m in reference.master_state().items()}
    del reference

    model_args, state, _ = read_exported(init)
    model = build_with_weights(model_args, {k: v.float() for k, v in state.items()}, torch.float32,
                               "cuda").train()
    family, tied = model_args.family, model_args.tie_word_embeddings

    def rwkv_named(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return to_rwkv(tensors, family, tied)

    def flame_step(grads_from: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        optimizer = build_optimizer(model, cfg.optimizer)
        scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, cfg.training.steps, cfg.optimizer.lr)
        if grads_from is not None:
            for name, p in model.named_parameters():
                p.grad = grads_from[name].to(p.dtype).reshape(p.shape).clone()
        clip_grad_norm(model.named_parameters(), cfg.training.max_norm)
        optimizer.step()
        scheduler.step()
        return rwkv_named({n: p.detach().clone() for n, p in model.named_parameters()})

    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    n_tokens = int((labels != IGNORE_INDEX).sum())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids.cuda(), labels=labels.cuda(), loss_scale=1.0 / n_tokens)
    loss.backward()
    flame_grads = rwkv_named({n: p.grad.float().clone() for n, p in model.named_parameters()})
    after_own = flame_step(None)

    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(start[name])
    _, reference_in_flame_names = from_rwkv(reference_grads, family)
    for name, p in model.named_parameters():
        reference_in_flame_names.setdefault(name, torch.zeros_like(p))
    after_reference_grads = flame_step(reference_in_flame_names)

    compared = [n for n in reference_grads if n in flame_grads]
    initial = rwkv_named(start)  # RWKV-LM's names and shapes, like every dict compared below
    zero_start = [n for n in compared if not initial[n].any()]

    def sign_flips(name: str) -> float:
        """Fraction of elements whose update has the other sign in the other trainer."""
        ours = torch.sign(after_own[name] - initial[name])
        theirs = torch.sign(reference_masters[name] - initial[name])
        return (ours != theirs).float().mean().item()

    return {
        "lr": lr,
        "loss": {"flame": float(loss.item()), "rwkvlm": loss_reference, "rwkvlm_returned": loss_returned.float().item(),
                 "relative": abs(float(loss.item()) - loss_reference) / loss_reference},
        "grad": {n: relative_rms(flame_grads[n], reference_grads[n]) for n in compared},
        "step": {n: relative_rms(after_own[n], reference_masters[n]) for n in compared},
        "optimizer": {n: relative_rms(after_reference_grads[n], reference_masters[n]) for n in compared},
        "zero_start_sign_flips": {n: sign_flips(n) for n in zero_start},
        "not_compared": sorted(set(reference_masters) - set(compared)),
    }


def job_config(config: str, overrides: list[str]):
    from flame.config import load_config

    return load_config(["--config", config, *overrides])


def first_batch(cfg) -> dict[str, torch.Tensor]:
    """The first training batch of flame's loader for `cfg`."""
    from flame.data import build_job_dataloader, load_tokenizer

    tokenizer = load_tokenizer(cfg.data.tokenizer)
    loader = build_job_dataloader(cfg.data, cfg.training, tokenizer=tokenizer, split="train",
                                  job_seed=cfg.job.seed)
    return next(iter(loader))


def parity_table(result: dict) -> str:
    """The one-step comparison as text: losses, then the worst tensors of each measure."""
    loss = result["loss"]
    lines = [f"lr of update 1: {result['lr']:.3e}",
             f"loss: flame {loss['flame']:.6f}  RWKV-LM {loss['rwkvlm']:.6f} (its step returns "
             f"{loss['rwkvlm_returned']:.6f})  relative {loss['relative']:.2e}"]
    for key, title in (("grad", "gradients"), ("step", "parameters after one update, own gradients"),
                       ("optimizer", "parameters after one update from RWKV-LM's gradients"),
                       ("zero_start_sign_flips", "zero-start tensors, fraction of opposite first updates")):
        worst = sorted(result[key].items(), key=lambda kv: -kv[1])
        lines.append(f"{title}: relative RMS, worst of {len(worst)}: "
                     + ", ".join(f"{n} {v:.2e}" for n, v in worst[:4]))
    return "\n".join(lines)


# RWKV-LM's own CUDA kernels by kind (the __global__ functions of its cuda/ folders): the
# attention (x070's wkv kernels, x060's wkv6) and the loss; its fused glue and everything else
# count as "other"
RWKVLM_ATTENTION_KERNELS = {"forward_kernel", "forward_kernel_preload", "backward_kernel",
                            "backward_kernel_preload", "backward_kernel_preload_split64", "kernel_forward",
                            *(f"kernel_backward_{n}" for n in (101, 102, 103, 111, 201, 222))}
RWKVLM_LOSS_KERNELS = {"l2wrap_ce_forward_v2_kernel", "l2wrap_ce_backward_v2_kernel", "row_chunk_loss_and_grad_kernel",
                       "reduce_loss_kernel"}


def train(cfg, init: str, out: Path, steps: int, *, kernel: str, jit: bool, profile_steps: int = 0,
          log=print) -> list[dict]:
    """RWKV-LM's trainer for `steps` updates on the batches of flame's loader for `cfg`; writes
    `out/metrics.jsonl` with flame's keys (step, loss, lr, grad_norm, tokens, tokens_per_s). With
    `profile_steps`, the last that many updates run under torch.profiler and `out/kernels.json`
    gets their GPU ms per step by kind and by kernel (bench.timing.kernel_times), as
    bench.train_step reports flame's."""
    from torch.profiler import ProfilerActivity, profile

    from bench.timing import kernel_times
    from flame.data import build_job_dataloader, load_tokenizer

    if not 0 <= profile_steps < steps:
        raise SystemExit(f"bench.rwkvlm train: --profile-steps {profile_steps} must be below --steps {steps}")
    if cfg.training.gradient_accumulation_steps != 1:
        raise SystemExit("bench.rwkvlm train: gradient accumulation is not part of RWKV-LM's demo step")
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    loader = build_job_dataloader(cfg.data, cfg.training, tokenizer=tokenizer, split="train",
                                  job_seed=cfg.job.seed)
    trainer = RwkvLmTrainer(cfg, init, steps, kernel=kernel, jit=jit)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    tokens_per_step = cfg.training.batch_size * cfg.training.seq_len
    batches = iter(loader)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) if profile_steps else None
    with (out / "metrics.jsonl").open("w") as f:
        for step in range(steps):
            if profile_steps and step == steps - profile_steps:
                profiler.start()
            batch = next(batches)
            start.record()
            result = trainer.step(step, batch["input_ids"], batch["labels"])
            end.record()
            loss = float(result["loss"])  # RWKV-LM's logger reads the loss every step too
            seconds = start.elapsed_time(end) / 1e3
            row = {"step": step + 1, "loss": loss, "lr": result["lr"],
                   "grad_norm": float(result["grad_norm"]), "tokens": (step + 1) * tokens_per_step,
                   "tokens_per_s": tokens_per_step / seconds,
                   "tokens_per_s_per_device": tokens_per_step / seconds,
                   "memory_gib": torch.cuda.max_memory_allocated() / 2**30}
            rows.append(row)
            f.write(json.dumps(row) + "\n")
            if (step + 1) % 100 == 0 or step == 0:
                f.flush()
                log(f"rwkvlm step {step + 1}: loss {loss:.4f} lr {result['lr']:.2e} "
                    f"gnorm {row['grad_norm']:.3f} tok/s {row['tokens_per_s']:,.0f}")
    if profile_steps:
        torch.cuda.synchronize()
        profiler.stop()
        kernels = kernel_times(profiler, profile_steps, RWKVLM_ATTENTION_KERNELS, RWKVLM_LOSS_KERNELS)
        (out / "kernels.json").write_text(json.dumps({"profile_steps": profile_steps, **kernels}, indent=1))
    return rows


def tail_mean(rows: list[dict], fraction: float = 0.1) -> float:
    """Mean loss over the last `fraction` of the logged steps (`rows` in step order)."""
    last = rows[-max(1, math.ceil(len(rows) * fraction)):]
    return sum(r["loss"] for r in last) / len(last)


def median_speed(rows: list[dict], skip: int = 10) -> float:
    """Median tokens/s per device of the steps after the first `skip` (NaN when there are none)."""
    speeds = [r["tokens_per_s_per_device"] for r in rows[skip:] if "tokens_per_s_per_device" in r]
    return statistics.median(speeds) if speeds else float("nan")


def report(runs: list[Path], out: Path | None, smooth: int = 20, max_step: int = 0) -> str:
    """A Markdown table of each run's steps, tokens, tail-mean loss and median tokens/s, and
    (with `out`) a PNG of the smoothed loss curves; with `max_step`, of the steps up to it."""
    from bench.metrics import read_metrics

    lines = ["| run | steps | tokens | mean loss, last 10% | median tokens/s | peak GiB |",
             "|---|---|---|---|---|---|"]
    curves = {}
    for run in runs:
        path = run / "metrics.jsonl" if run.is_dir() else run
        rows = [r for r in read_metrics(path) if max_step <= 0 or r["step"] <= max_step]
        name = path.parent.name
        curves[name] = rows
        memory = max(r.get("memory_gib") or 0.0 for r in rows)
        lines.append(f"| {name} | {rows[-1]['step']} | {rows[-1].get('tokens', 0):,} | "
                     f"{tail_mean(rows):.4f} | {median_speed(rows):,.0f} | {memory:.1f} |")
    if out is not None:
        plot_curves(curves, out, smooth)
    return "\n".join(lines)


def plot_curves(curves: dict[str, list[dict]], out: Path, smooth: int) -> None:
    """Two panels: each run's loss (mean of the last `smooth` steps), and its difference from the
    mean of the RWKV-LM runs (names starting "rwkvlm") at the same step, where there are some."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    def smoothed(rows):
        """The steps, and the mean loss of each step's last `smooth` steps (fewer at the start)."""
        losses = np.array([r["loss"] for r in rows], dtype=np.float64)
        sums = np.concatenate([[0.0], np.cumsum(losses)])
        end = np.arange(1, len(losses) + 1)
        start = np.maximum(0, end - smooth)
        return np.array([r["step"] for r in rows]), (sums[end] - sums[start]) / (end - start)

    series = {name: smoothed(rows) for name, rows in curves.items()}
    references = [loss for name, (_, loss) in series.items() if name.startswith("rwkvlm")]
    fig, axes = plt.subplots(2 if references else 1, 1, figsize=(9, 8 if references else 5.5), squeeze=False,
                             sharex=True, gridspec_kw={"height_ratios": [3, 2]} if references else None)
    ax = axes[0][0]
    for name, (steps, loss) in series.items():
        ax.plot(steps, loss, label=name, linewidth=1.2)
    ax.set_ylabel(f"training loss (mean of the last {smooth} steps)")
    ax.set_ylim(top=min(8.0, ax.get_ylim()[1]))
    ax.grid(alpha=0.3)
    ax.legend()
    if references:
        length = min(len(loss) for loss in references)
        reference = np.mean([loss[:length] for loss in references], axis=0)
        diff = axes[1][0]
        for name, (steps, loss) in series.items():
            n = min(length, len(loss))
            diff.plot(steps[:n], loss[:n] - reference[:n], label=name, linewidth=1.0)
        diff.axhline(0.0, color="black", linewidth=0.6)
        diff.set_ylim(-0.1, 0.1)
        diff.set_ylabel("minus the RWKV-LM runs' mean")
        diff.grid(alpha=0.3)
    axes[-1][0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + " init, train and parity "
                                     "need a CUDA GPU and an RWKV-LM checkout; report runs on any machine.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_init = sub.add_parser("init", help="write RWKV-LM's initial weights (.pth)")
    p_train = sub.add_parser("train", help="train with RWKV-LM's step on flame's batches")
    for p in (p_init, p_train):
        p.add_argument("--config", required=True, help="flame config; other --section.key VALUE "
                       "arguments override it, e.g. --model.num_layers 24")
    p_init.add_argument("--seed", type=int, default=0)
    p_init.add_argument("--out", required=True)
    p_train.add_argument("--init", required=True, help="the .pth to start from")
    p_train.add_argument("--out", required=True, help="folder for metrics.jsonl")
    p_train.add_argument("--steps", type=int, default=0, help="updates (default: training.steps)")
    p_train.add_argument("--kernel", default="@rwkv3", help='RWKV-LM\'s --kernel ("" = rwkv7_clampw)')
    p_train.add_argument("--no-jit", action="store_true", help="RWKV_JIT_ON=0")
    p_train.add_argument("--profile-steps", type=int, default=0,
                         help="profile the last N updates: GPU ms per kernel in OUT/kernels.json")
    p_parity = sub.add_parser("parity", help="one step of both trainers from the same weights and batch")
    p_parity.add_argument("--config", required=True)
    p_parity.add_argument("--seed", type=int, default=0, help="RWKV-LM init seed")
    p_parity.add_argument("--json", type=Path, default=None, help="write every number here too")
    p_build = sub.add_parser("build", help="build RWKV-LM's CUDA extensions in parallel")
    p_build.add_argument("--config", default=DEFAULT_CONFIG, help="flame config: its model.family, head_dim and "
                         f"training.seq_len pick the extensions (default {DEFAULT_CONFIG})")
    p_build.add_argument("--kernel", default="@rwkv3")
    p_report = sub.add_parser("report", help="table and PNG of runs' curves")
    p_report.add_argument("runs", nargs="+", type=Path)
    p_report.add_argument("--out", type=Path, default=None)
    p_report.add_argument("--max-step", type=int, default=0, help="compare the steps up to this one")
    args, overrides = parser.parse_known_args(argv)
    if overrides and args.command == "report":
        parser.error(f"unrecognized arguments: {' '.join(overrides)}")
    args.set = overrides
    try:
        if args.command == "init":
            write_init(job_config(args.config, args.set), args.seed, args.out)
            print(f"wrote RWKV-LM's initial weights (seed {args.seed}) to {args.out}")
        elif args.command == "train":
            cfg = job_config(args.config, args.set)
            t0 = time.time()
            rows = train(cfg, args.init, Path(args.out), args.steps or cfg.training.steps,
                         kernel=args.kernel, jit=not args.no_jit, profile_steps=args.profile_steps)
            print(f"RWKV-LM: {len(rows)} steps in {time.time() - t0:.0f} s, mean loss of the last "
                  f"10% {tail_mean(rows):.4f}, median {median_speed(rows):,.0f} tokens/s")
        elif args.command == "build":
            build_kernels(job_config(args.config, args.set), args.kernel)
        elif args.command == "parity":
            import tempfile

            cfg = job_config(args.config, args.set)
            batch = first_batch(cfg)
            with tempfile.TemporaryDirectory() as folder:
                init = Path(folder) / "init.pth"
                write_init(cfg, args.seed, init)
                result = one_step_parity(cfg, init, batch["input_ids"], batch["labels"])
            if args.json is not None:
                args.json.write_text(json.dumps(result, indent=1))
            print(parity_table(result))
        else:
            print(report(args.runs, args.out, max_step=args.max_step))
    except RwkvLmMissing as err:
        raise SystemExit(f"bench.rwkvlm: {err}") from None


if __name__ == "__main__":
    main()
