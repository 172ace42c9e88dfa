"""Resolve the `backend=` argument of the public ops to "triton" or "torch"."""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "triton", "torch")


def triton_interpreter_enabled() -> bool:
    """True when Triton kernels run under the interpreter (TRITON_INTERPRET=1), i.e. on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@torch.compiler.disable
def run_eager(kernel_fn, *args):
    """Run a Triton-backed op outside torch.compile's tracing.

    Per-block torch.compile would otherwise trace into the op's autograd Function and hand the
    Triton kernels to Inductor, which retypes Python float arguments as fp64 (failed to compile on
    the H100: "Both operands must be same dtype. Got fp64 and fp32") and, under the interpreter,
    fake-traces numpy pointer arithmetic. The compiled graph breaks around the op instead; the
    projections, norms and feed-forward around it still compile.
    """
    return kernel_fn(*args)


def resolve_backend(backend: str, device: torch.device, op: str) -> str:
    """The backend that runs `op` on tensors of `device`.

    "auto": "triton" for CUDA tensors, "torch" otherwise. "triton": CUDA tensors, or CPU tensors
    under the Triton interpreter (TRITON_INTERPRET=1, set before triton is imported); anything else
    is an error. "torch": always the PyTorch implementation.
    """
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"{op}: backend must be one of {', '.join(repr(b) for b in BACKENDS)}, got {backend!r}")
    if backend == "torch":
        return "torch"
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if device.type == "cuda":
        return "triton"
    if device.type == "cpu":
        if triton_interpreter_enabled():
            return "triton"
        raise RuntimeError(
            f"{op}: backend='triton' got CPU tensors, which need the Triton interpreter: set "
            "TRITON_INTERPRET=1 in the environment before triton is imported, or use backend='torch' "
            "(or 'auto')"
        )
    raise RuntimeError(f"{op}: backend='triton' needs CUDA tensors (or CPU under TRITON_INTERPRET=1), got {device}")
