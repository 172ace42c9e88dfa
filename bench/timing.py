"""GPU timing shared by the benchmarks in bench/: the device check, fla as an optional comparison,
do_bench medians of a forward and a forward+backward, profiler traces, and the grouping of a
trace's kernel times by kind.

Every function imports torch, triton and fla when called, so that `--help` of a tool works on a
machine without a GPU (and without fla).
"""

from __future__ import annotations

import sys
from typing import Callable

FLA_MISSING = ("fla is not installed: flame only (for the comparison install fla 0.6.0: "
               "pip install flash-linear-attention==0.6.0)")

# kinds of GPU kernel in a training step's trace, in the order the tables print them
KINDS = ("matmul", "attention", "loss", "optimizer", "other")
_MATMUL_MARKS = ("gemm", "cutlass", "cublas", "nvjet", "xmma", "wgmma", "matmul", "_mm_")
_OPTIMIZER_MARKS = ("adam", "multi_tensor", "foreach", "fused_sgd")


# ---- device and libraries ----------------------------------------------------------------------

def require_cuda(tool: str, hint: str = "") -> None:
    """Exit (status 1) with a one-line message when no CUDA GPU is visible; `hint`: what runs
    without one."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(f"{tool} measures on a CUDA GPU and none is visible" + (f"; {hint}" if hint else ""))


def fla_available() -> bool:
    """Whether fla (flash-linear-attention) imports in this process."""
    try:
        import fla  # noqa: F401
    except Exception:  # an fla built for another torch fails with more than ImportError
        return False
    return True


def fla_function(module: str, name: str) -> Callable | None:
    """fla's function `name` from `module`, or None when fla is not installed."""
    try:
        mod = __import__(module, fromlist=[name])
    except ImportError:
        return None
    return getattr(mod, name)


def versions() -> str:
    """"torch X, triton Y" of this process."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return f"torch {torch.__version__}, triton {triton_version}"


# ---- timing one op -----------------------------------------------------------------------------

def grad_leaves(inputs: dict) -> list:
    return [x for x in inputs.values() if getattr(x, "requires_grad", False)]


def warm_forward_backward(fn: Callable[[dict], object], inputs: dict) -> None:
    """One forward+backward of fn on inputs: compiles (and autotunes) its kernels."""
    import torch

    out = fn(inputs)
    torch.autograd.backward(out, torch.ones_like(out))
    torch.cuda.synchronize()


def forward_and_backward_ms(fn: Callable[[dict], object], inputs: dict) -> tuple[float, float]:
    """Median ms of `triton.testing.do_bench` (its own warm-up included) of the forward under
    no_grad, and of forward + backward of <o, do> with a fixed random do (leaf grads reset)."""
    import torch
    from triton.testing import do_bench

    with torch.no_grad():
        do = torch.randn_like(fn(inputs))

    def fwd():
        with torch.no_grad():
            fn(inputs)

    def fwd_bwd():
        torch.autograd.backward(fn(inputs), do)

    return do_bench(fwd), do_bench(fwd_bwd, grad_to_none=grad_leaves(inputs))


def profile_forward_backward(fn: Callable[[dict], object], inputs: dict, n: int = 5, warmup: int = 3):
    """The CUDA profile of n forward+backward passes of fn, after `warmup` untraced passes; the
    leaves' gradients are reset before each pass, so that no accumulation kernel is traced."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        do = torch.randn_like(fn(inputs))
    leaves = grad_leaves(inputs)

    def forward_backward():
        for leaf in leaves:
            leaf.grad = None
        torch.autograd.backward(fn(inputs), do)

    for _ in range(warmup):
        forward_backward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            forward_backward()
        torch.cuda.synchronize()
    return prof


# ---- grouping a trace's kernel time by kind ----------------------------------------------------

def triton_kernel_names(prefixes: tuple[str, ...]) -> set[str]:
    """Names of the Triton kernels defined in the loaded modules under `prefixes`."""
    names = set()
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(prefixes):
            continue
        for value in vars(module).values():
            fn = value
            while type(fn).__name__ != "JITFunction" and hasattr(fn, "fn"):  # Autotuner, Heuristics
                fn = fn.fn
            if type(fn).__name__ == "JITFunction":
                names.add(fn.fn.__name__)
    return names


def kernel_base_name(name: str) -> str:
    """A kernel's name without its arguments, template parameters, namespaces and return type
    ("void (anonymous namespace)::forward_kernel<64>(int, ...)" -> "forward_kernel")."""
    base = name.replace("(anonymous namespace)::", "").split("(")[0].split("<")[0].strip()
    return base.split(" ")[-1].split("::")[-1]


def kernel_kind(name: str, attention: set[str], loss: set[str]) -> str:
    """One of KINDS for a kernel name: the loss and attention kernels by name, cuBLAS/CUTLASS
    matmuls and the optimizer's multi-tensor kernels by marks in their names, else "other"."""
    base = kernel_base_name(name)
    if base in loss:
        return "loss"
    if base in attention:
        return "attention"
    low = name.lower()
    if any(mark in low for mark in _MATMUL_MARKS):
        return "matmul"
    if any(mark in low for mark in _OPTIMIZER_MARKS):
        return "optimizer"
    return "other"


def is_annotation(event) -> bool:
    """A user or library range on the GPU timeline (FSDP's, the optimizer's), not a kernel."""
    if getattr(event, "is_user_annotation", False):
        return True
    return event.name.startswith(("FSDP::", "Optimizer.", "ProfilerStep", "## "))


def busy_ms(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals, in the intervals' unit."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def kernel_times(prof, steps: int, attention: set[str], loss: set[str], floor_ms: float = 0.05) -> dict:
    """A torch.profiler trace of `steps` training steps as GPU ms per step: by kind (KINDS), the
    time the GPU was busy (the union of kernel intervals), and every kernel of at least `floor_ms`
    by name (its first 120 characters), largest first."""
    import torch

    by_kind = dict.fromkeys(KINDS, 0.0)
    by_kernel: dict[str, float] = {}
    intervals = []
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA or is_annotation(event):
            continue
        ms = (event.time_range.end - event.time_range.start) / 1e3 / steps
        by_kind[kernel_kind(event.name, attention, loss)] += ms
        by_kernel[event.name[:120]] = by_kernel.get(event.name[:120], 0.0) + ms
        intervals.append((event.time_range.start, event.time_range.end))
    top = [kv for kv in sorted(by_kernel.items(), key=lambda kv: -kv[1]) if kv[1] >= floor_ms]
    return {"gpu_ms_per_step": by_kind, "gpu_busy_ms_per_step": busy_ms(intervals) / 1e3 / steps,
            "top_kernels_ms_per_step": top}
