"""Compile the Triton kernels that a host function launches for an H100 (sm_90), on a machine without GPU.

The interpreter runs kernels as Python, so code that the GPU compiler rejects can pass every CPU test
(session 6: a load from a pointer that is None in the exact regime failed to compile on the H100 only).
This runs a host function on CPU tensors with every @triton.jit kernel of the given modules replaced
by a recorder (no launch; the outputs are uninitialized), then compiles each distinct recorded
specialization to a cubin with Triton's own compiler and ptxas for sm_90.

Run as a script, in a process without TRITON_INTERPRET (which turns @triton.jit into Python):
    python -m tests.ops.sm90_compile CASE      (CASE: a name of CASES)
It prints one line per compiled kernel and exits non-zero when any of them fails.
"""

import os
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

H100 = GPUTarget("cuda", 90, 32)
POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int64: "*i64",
                 torch.int32: "*i32", torch.int8: "*i8"}
LAUNCH_OPTIONS = ("num_warps", "num_stages", "maxnreg")


def record_launches(modules):
    """Replace the `run` of every JITFunction in `modules` by a recorder; returns the list it fills with
    (kernel, {param: value}, {launch option: value})."""
    launches = []
    for module in modules:
        for kernel in vars(module).values():
            if isinstance(kernel, JITFunction):
                def run(*args, grid, warmup, _kernel=kernel, **kwargs):
                    values = dict(zip([p.name for p in _kernel.params], args))
                    options = {k: kwargs.pop(k) for k in LAUNCH_OPTIONS if kwargs.get(k) is not None}
                    values.update(kwargs)
                    launches.append((_kernel, values, options))
                kernel.run = run
    return launches


def specialization(kernel, values):
    """Triton's signature and constexprs for one launch: tensors by dtype, None as a constexpr."""
    signature, constexprs = {}, {}
    for p in kernel.params:
        v = values[p.name]
        if p.is_constexpr or v is None:
            signature[p.name] = "constexpr"
            constexprs[p.name] = v
        elif isinstance(v, torch.Tensor):
            signature[p.name] = POINTER_TYPES[v.dtype]
        elif isinstance(v, bool):
            signature[p.name] = "i1"
        elif isinstance(v, int):
            signature[p.name] = "i32" if -2**31 <= v < 2**31 else "i64"
        elif isinstance(v, float):
            signature[p.name] = "fp32"
        else:
            raise TypeError(f"{kernel.__name__}: argument {p.name} of type {type(v).__name__}")
    return signature, constexprs


def compile_all(launches):
    """Compile each distinct launch for sm_90; returns the number of failures (printed)."""
    seen, failures = set(), 0
    for kernel, values, options in launches:
        signature, constexprs = specialization(kernel, values)
        key = (kernel.__name__, tuple(sorted(signature.items())), repr(sorted(constexprs.items())),
               tuple(sorted(options.items())))
        if key in seen:
            continue
        seen.add(key)
        label = f"{kernel.__name__} {constexprs} {options}"
        try:
            triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=H100,
                           options=options)
            print(f"ok   {label}")
        except Exception as e:  # the compiler's message names the kernel line
            failures += 1
            print(f"FAIL {label}: {type(e).__name__}: {e}")
    return failures


def _rwkv7(dtype, gate_lower_bound, with_states):
    """The chunked RWKV7 kernels of one dtype and regime, forward and backward (cache off and on)."""
    from flame.ops.rwkv7 import chunk_triton, wy_inverse_triton

    launches = record_launches([chunk_triton, wy_inverse_triton])
    B, T, H, K, V = 1, 64, 2, 64, 64
    for cache in (False, True):
        x = [torch.zeros(B, T, H, D, dtype=dtype, requires_grad=True) for D in (K, K, K, V, K, K)]
        h0 = torch.zeros(B, H, K, V, requires_grad=True) if with_states else None
        o, ht = chunk_triton.chunk_rwkv7_triton(*x, scale=1.0, initial_state=h0, output_final_state=with_states,
                                                gate_lower_bound=gate_lower_bound, cache_intermediates=cache)
        grads = [torch.zeros_like(o)] + ([torch.zeros_like(ht)] if with_states else [])
        torch.autograd.backward([o] + ([ht] if with_states else []), grads)
    return launches


CASES = {
    "rwkv7_bf16_centred": lambda: _rwkv7(torch.bfloat16, -0.6065306597126334, False),
    "rwkv7_bf16_exact": lambda: _rwkv7(torch.bfloat16, None, True),
    "rwkv7_fp32_exact": lambda: _rwkv7(torch.float32, None, True),
    "rwkv7_fp16_centred": lambda: _rwkv7(torch.float16, -0.6065306597126334, True),
}


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") != "1", "the sm_90 compile check needs TRITON_INTERPRET unset"
    sys.exit(1 if compile_all(CASES[sys.argv[1]]()) else 0)
