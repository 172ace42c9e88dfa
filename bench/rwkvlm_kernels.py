"""RWKV-LM's RWKV7 attention kernels as callables, for bench/ops.py's rows beside flame's
chunk_rwkv7 and for the GPU test that checks them against the fp64 recurrence.

RWKV-LM's x070 trainer (docs/rwkv-lm.md; its checkout at `bench.rwkvlm.RWKVLM_COMMIT`) runs the
attention through one of two CUDA extensions in its `RWKV-v7/train_temp/cuda/` folder:

  rwkvlm       `rwkv7_clampw`: its default kernel;
  rwkvlm_h100  `rwkv7_clampw_v3` (`rwkv7_clampw_v3_for_h100.cu`): the kernel its demo picks with
               `--kernel @rwkv3`.

Both take r, w, k, v, a, b as contiguous bf16 [B, T, H, 64] with T a multiple of 16 and w the
decay's logit: inside, the decay is exp(-exp(-0.5) * sigmoid(w)), which is flame's RWKV7 layer's
log-decay `RWKV7_LOG_DECAY_BOUND * sigmoid(w)` (flame.models.rwkv7). Each extension registers
`torch.ops.<name>.forward(r, w, k, v, a, b, y, s, sa)` (y the output, s the fp32 state at every
16th step, sa the fp32 `state @ a` of every step) and `.backward(r, w, k, v, a, b, dy, s, sa, dr,
dw, dk, dv, da, db)`. `attention(lib)` builds the extension on first use with the flags RWKV-LM's
model passes (`FLAGS`) and returns a differentiable function of the six tensors; the autograd
wrapper is flame's, the kernels are RWKV-LM's. Building needs nvcc (the GPU machines have it) and
takes about a minute per extension; torch caches the build (TORCH_EXTENSIONS_DIR).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from bench.rwkvlm import RwkvLmMissing, rwkvlm_dir

HEAD_SIZE = 64
"""The head size RWKV-LM's x070 trainer compiles its kernels for (`-D_N_`)."""
CHUNK_LEN = 16
"""Its kernels keep the state at every CHUNK_LEN-th step for the backward (`-D_CHUNK_LEN_`)."""
FLAGS = ["-res-usage", f"-D_N_={HEAD_SIZE}", f"-D_CHUNK_LEN_={CHUNK_LEN}", "--use_fast_math", "-O3",
         "-Xptxas -O3", "--extra-device-vectorization"]
"""The nvcc flags of RWKV-LM's model for these extensions."""
KERNELS = {
    "rwkvlm": ("rwkv7_clampw", ("rwkv7_clampw.cu", "rwkv7_clampw.cpp")),
    "rwkvlm_h100": ("rwkv7_clampw_v3", ("rwkv7_clampw_v3_for_h100.cu", "rwkv7_clampw_v3.cpp")),
}
"""bench/ops.py's library name -> (the extension's name, its sources in RWKV-LM's cuda/ folder)."""


@functools.cache
def kernel_ops(lib: str):
    """The `torch.ops` namespace of `lib`'s extension, built (or loaded from torch's build cache)."""
    if lib not in KERNELS:
        raise ValueError(f"no RWKV-LM kernel {lib!r}; known: {', '.join(KERNELS)}")
    name, sources = KERNELS[lib]
    folder = rwkvlm_dir("rwkv7") / "cuda"
    missing = [s for s in sources if not (folder / s).is_file()]
    if missing:
        raise RwkvLmMissing(f"RWKV-LM's checkout has no {', '.join(missing)} in {folder}")
    from torch.utils.cpp_extension import load

    load(name=name, sources=[str(folder / s) for s in sources], is_python_module=False, verbose=False,
         extra_cuda_cflags=FLAGS)
    return getattr(torch.ops, name)


class _ClampW(torch.autograd.Function):
    """One of RWKV-LM's kernels as an autograd function: its forward keeps the kernel's state
    checkpoints (s, sa) for its backward."""

    @staticmethod
    def forward(ctx, ops, r, w, k, v, a, b):
        B, T, H, N = r.shape
        y = torch.empty_like(v)
        states = torch.empty(B, H, T // CHUNK_LEN, N, N, dtype=torch.float32, device=r.device)
        state_a = torch.empty(B, T, H, N, dtype=torch.float32, device=r.device)
        ops.forward(r, w, k, v, a, b, y, states, state_a)
        ctx.ops = ops
        ctx.save_for_backward(r, w, k, v, a, b, states, state_a)
        return y

    @staticmethod
    def backward(ctx, dy):
        r, w, k, v, a, b, states, state_a = ctx.saved_tensors
        grads = [torch.empty_like(x) for x in (r, w, k, v, a, b)]
        ctx.ops.backward(r, w, k, v, a, b, dy.contiguous(), states, state_a, *grads)
        return (None, *grads)


def check_inputs(r, w, k, v, a, b) -> None:
    """The kernels' contract: same-shape contiguous bf16 CUDA tensors [B, T, H, 64], T % 16 == 0."""
    tensors = {"r": r, "w": w, "k": k, "v": v, "a": a, "b": b}
    for name, x in tensors.items():
        if x.dtype != torch.bfloat16 or not x.is_cuda or not x.is_contiguous() or x.shape != r.shape:
            raise ValueError(f"RWKV-LM's kernels take contiguous bf16 CUDA tensors of r's shape "
                             f"{tuple(r.shape)}; {name} is {x.dtype} {tuple(x.shape)} on {x.device}"
                             f"{'' if x.is_contiguous() else ', not contiguous'}")
    if r.dim() != 4 or r.shape[-1] != HEAD_SIZE or r.shape[1] % CHUNK_LEN:
        raise ValueError(f"RWKV-LM's kernels take [B, T, H, {HEAD_SIZE}] with T a multiple of {CHUNK_LEN}, "
                         f"got {tuple(r.shape)}")


def attention(lib: str) -> Callable[..., torch.Tensor]:
    """(r, w_logit, k, v, a, b) -> o through RWKV-LM's kernel `lib` (module docstring)."""
    ops = kernel_ops(lib)

    def run(r, w, k, v, a, b):
        check_inputs(r, w, k, v, a, b)
        return _ClampW.apply(ops, r, w, k, v, a, b)

    return run
