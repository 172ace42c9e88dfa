"""A model's blocks through torch.compile for inference: the forwards of `flame.eval` and of a
prompt's prefill (flame.inference.decoder.prefill) at the speed of the training step's forward.

The trainer compiles each block (flame.train.parallelize): Inductor fuses the projections, norms and
token-shift lerps around the chunk ops, which are custom ops and stay one opaque node each (a
fixed-length block is one graph). `compiled_blocks(model)` runs the same blocks compiled, for the
duration of a `with` block only: inside it each block of `model.layers` calls its compiled form,
outside it the model runs as before (eagerly, or as the trainer compiled it). The compiled forms
are built on first use, one per block (`torch.compile(dynamic=False)`: one graph per input shape,
shared by the blocks since they share their code) and kept with the model.

dynamic=False compiles a new graph for every new input shape, up to Dynamo's recompile limit per
block code (config.recompile_limit), past which new shapes run eagerly. The callers therefore
compile fixed shapes only: flame.eval its full batches of full windows, prefill segments of a fixed
number of tokens; the rest of their work runs eagerly.

Inductor needs CUDA and Triton here; elsewhere (CPU) the blocks run eagerly, with no error. A block
whose compilation fails warns once and runs eagerly from then on. Dynamo may have run the part of a
block before a graph break when a later part fails to compile, so a caller whose blocks carry state
from call to call asks `compilation_failed` afterwards and starts its work again eagerly.
"""

from __future__ import annotations

import warnings
import weakref
from contextlib import contextmanager

import torch
from torch import nn

INDUCTOR = "inductor"
"""The default backend. Others (Dynamo's "eager", "aot_eager", a counting backend) trace the
blocks the same way without generating code, which is how the CPU tests check the tracing."""


def compile_supported(device: torch.device, backend=INDUCTOR) -> bool:
    """Whether `compiled_blocks` compiles a model on `device` with `backend`: Inductor on CUDA with
    Triton available; any other backend anywhere Dynamo runs."""
    if not torch._dynamo.is_dynamo_supported():
        return False
    if backend != INDUCTOR:
        return True
    from torch.utils._triton import has_triton

    return device.type == "cuda" and has_triton()


class _CompiledBlocks:
    """One model's compiled block calls for one backend, and whether compiling failed."""

    def __init__(self, blocks: list[nn.Module], backend):
        self.blocks = blocks
        self.failed = False
        self.calls = [self._call(block, torch.compile(block._call_impl, dynamic=False, backend=backend))
                      for block in blocks]

    def _call(self, block: nn.Module, compiled):
        eager = block._call_impl

        def call(*args, **kwargs):
            if self.failed:
                return eager(*args, **kwargs)
            try:
                return compiled(*args, **kwargs)
            except torch._dynamo.exc.TorchDynamoException as err:
                # the same call eagerly gives the result (or the real error of bad input) when the
                # block has no state; callers with state check compilation_failed (module docstring)
                self.failed = True
                first = str(err).strip().splitlines()[0] if str(err).strip() else ""
                warnings.warn(f"flame inference: torch.compile of the model's blocks failed, they run eagerly "
                              f"({type(err).__name__}: {first})", RuntimeWarning, stacklevel=2)
                return eager(*args, **kwargs)

        return call


_COMPILED: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def _compiled_for(model: nn.Module, backend) -> _CompiledBlocks:
    """The model's cached compiled blocks for `backend` (rebuilt if its layers were replaced)."""
    blocks = list(model.layers)
    cache = _COMPILED.setdefault(model, {})
    entry = cache.get(backend)
    if entry is None or len(entry.blocks) != len(blocks) or any(a is not b for a, b in zip(entry.blocks, blocks)):
        entry = cache[backend] = _CompiledBlocks(blocks, backend)
    return entry


def compilation_failed(model: nn.Module, compile=True) -> bool:
    """Whether compiling `model`'s blocks for `compile` (as `compiled_blocks` takes it) has failed."""
    backend = INDUCTOR if compile is True else compile
    entry = _COMPILED.get(model, {}).get(backend)
    return entry is not None and entry.failed


@contextmanager
def compiled_blocks(model: nn.Module, compile=True):
    """Inside: each block of `model.layers` runs its torch.compile'd form (module docstring).

    compile: True (Inductor, where `compile_supported`), False (eager), or a torch.compile backend
    (a name or a callable). Yields whether the blocks run compiled: False when compile is False,
    when the device does not support it, or when an earlier compilation of this model failed.
    Blocks that already run compiled (the trainer's `block.compile()`) are left as they are."""
    backend = INDUCTOR if compile is True else compile
    if compile is False or not compile_supported(model.embeddings.weight.device, backend):
        yield False
        return
    entry = _compiled_for(model, backend)
    if entry.failed:
        yield False
        return
    previous = [block._compiled_call_impl for block in entry.blocks]
    for block, call, before in zip(entry.blocks, entry.calls, previous):
        if before is None:
            block._compiled_call_impl = call
    try:
        yield True
    finally:
        for block, before in zip(entry.blocks, previous):
            block._compiled_call_impl = before

