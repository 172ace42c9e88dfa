"""Compile the Triton kernels that a host function launches, for an H100 (sm_90), on a machine without GPU.

The interpreter runs kernels as Python, so code that the GPU compiler rejects can pass every CPU test
(a load from a pointer that is None in the exact regime failed to compile on the H100 only).
This runs a host function on CPU tensors with every @triton.jit kernel of the given modules replaced
by a recorder (no launch; the outputs are uninitialized), then compiles each distinct recorded
specialization to a cubin with Triton's own compiler and ptxas for sm_90.

Run as a script, in a process without TRITON_INTERPRET (which turns @triton.jit into Python):
    python -m tests.ops.sm90_compile CASE      (CASE: a name of CASES)
It prints one line per compiled kernel, with its registers per thread, spills and shared memory as
ptxas reports them for sm_90 (a way to see a kernel change's register cost without a GPU), and exits
non-zero when any of them fails. Like Triton's launcher, it marks the pointers and the integer
arguments that are multiples of 16 as such (`tt.divisibility`): without that hint the loads come out
scalar and the register counts overstated.
"""

import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction, mangle_type
from triton.tools.tensor_descriptor import TensorDescriptor

H100 = GPUTarget("cuda", 90, 32)
POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int64: "*i64",
                 torch.int32: "*i32", torch.int8: "*i8"}
LAUNCH_OPTIONS = ("num_warps", "num_stages", "maxnreg")


def record_launches():
    """Replace the `run` of every JITFunction in the loaded flame.ops modules by a recorder; returns the
    list it fills with (kernel, {param: value}, {launch option: value})."""
    launches = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("flame.ops"):
            continue
        for kernel in vars(module).values():
            if isinstance(kernel, JITFunction) and not getattr(kernel, "_sm90_recorded", False):
                def run(*args, grid, warmup, _kernel=kernel, **kwargs):
                    values = dict(zip([p.name for p in _kernel.params], args))
                    options = {k: kwargs.pop(k) for k in LAUNCH_OPTIONS if kwargs.get(k) is not None}
                    values.update(kwargs)
                    launches.append((_kernel, values, options))
                kernel.run = run
                kernel._sm90_recorded = True
    return launches


def specialization(kernel, values):
    """Triton's signature, constexprs and divisibility attributes for one launch: tensors by dtype, None
    as a constexpr, 16-byte aligned pointers and integers that are multiples of 16 marked divisible."""
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        v = values[p.name]
        if p.is_constexpr or v is None:
            signature[p.name] = "constexpr"
            constexprs[p.name] = v
        elif isinstance(v, torch.Tensor):
            signature[p.name] = POINTER_TYPES[v.dtype]
            if v.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, TensorDescriptor):  # host-built tensor-memory-access descriptors
            signature[p.name] = mangle_type(v)
        elif isinstance(v, bool):
            signature[p.name] = "i1"
        elif isinstance(v, int):
            signature[p.name] = "i32" if -2**31 <= v < 2**31 else "i64"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            signature[p.name] = "fp32"
        else:
            raise TypeError(f"{kernel.__name__}: argument {p.name} of type {type(v).__name__}")
    return signature, constexprs, attrs


def resources(compiled):
    """'R registers, S B spilled, M B shared' of a compiled kernel, from cuobjdump on its cubin."""
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        try:
            out = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", f.name], capture_output=True,
                                 text=True).stdout
        except OSError as e:  # a Triton build without NVIDIA's tools: the compile itself still counts
            return f"resources unknown ({e})"
    found = re.search(r"REG:(\d+).*?STACK:(\d+)", out)
    regs, stack = found.groups() if found else ("?", "?")
    return f"{regs} registers, {stack} B spilled, {compiled.metadata.shared} B shared"


def compile_all(launches):
    """Compile each distinct launch for sm_90; returns the number of failures (printed)."""
    seen, failures = set(), 0
    for kernel, values, options in launches:
        signature, constexprs, attrs = specialization(kernel, values)
        key = (kernel.__name__, tuple(sorted(signature.items())), repr(sorted(constexprs.items())),
               tuple(sorted(attrs)), tuple(sorted(options.items())))
        if key in seen:
            continue
        seen.add(key)
        label = f"{kernel.__name__} {constexprs} {options}"
        try:
            compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                                      target=H100, options=options)
            print(f"ok   {label}: {resources(compiled)}")
        except Exception as e:  # the compiler's message names the kernel line
            failures += 1
            print(f"FAIL {label}: {type(e).__name__}: {e}")
    return failures


BOUND = -0.6065306597126334  # the RWKV7 layer's gate bound: the centred regime


def _launches(op, family, dtype, calls=({},), **shape):
    """The launches of op (a *_triton host function) on zero-cost CPU inputs of `family`, forward and
    backward, once per keyword set in `calls`, with the GLA core's state passes split (what these small
    shapes take) and walked (what a training batch takes, flame.ops.common.chunk_triton.state.walks)."""
    from flame.ops.common.chunk_triton import state
    from tests.ops.inputs import forward_backward, make_inputs

    launches = record_launches()
    dims = dict(B=1, T=64, H=2, K=64, V=64, M=16) | shape
    default = state.WALK_MIN_PROGRAMS
    try:
        for min_programs in (default, 0):
            state.WALK_MIN_PROGRAMS = min_programs
            for kwargs in calls:
                inputs = make_inputs(family, **dims, dtype=dtype, requires_grad=True, initial_state=True)
                forward_backward(op, inputs, **kwargs)
    finally:
        state.WALK_MIN_PROGRAMS = default
    return launches


def _token_shift_mix_launches():
    """The launches of token_shift_mix in the layers' configurations (RWKV6's five dynamic lerps, RWKV7's
    six static ones, the channel mixes' one and two, packed documents), forward and backward."""
    from flame.ops.token_shift import mix_triton
    from flame.ops.token_shift.shift import sequence_starts

    launches = record_launches()
    B, T, C = 1, 64, 192
    x = torch.zeros(B, T, C, dtype=torch.bfloat16, requires_grad=True)
    for n, n_m, cu_seqlens in ((6, 5, None), (6, 0, None), (2, 0, None), (1, 0, torch.tensor([0, 10, T]))):
        mu = torch.zeros(n, C, requires_grad=True)
        m = torch.zeros(n_m, B, T, C, dtype=torch.bfloat16, requires_grad=True) if n_m else None
        starts = sequence_starts(cu_seqlens, T) if cu_seqlens is not None else None
        outs = mix_triton.token_shift_mix_triton(x, mu, m, starts)
        torch.autograd.grad(sum(o.float().sum() for o in outs), [x, mu] + ([m] if m is not None else []))
    return launches


def _squared_relu_mlp_launches():
    from flame.ops.squared_relu import squared_relu_mlp_triton

    launches = record_launches()
    x = torch.zeros(256, 128, dtype=torch.bfloat16, requires_grad=True)
    w_key = torch.zeros(512, 128, dtype=torch.bfloat16, requires_grad=True)
    w_value = torch.zeros(128, 512, dtype=torch.bfloat16, requires_grad=True)
    out = squared_relu_mlp_triton.squared_relu_mlp_triton(x, w_key, w_value)
    torch.autograd.grad(out.float().sum(), [x, w_key, w_value])
    return launches


def _op(module, name):
    import importlib
    return getattr(importlib.import_module(f"flame.ops.{module}"), name)


# the backward with kept intermediates, recomputed ones, and recomputed states (`_scan_pair_kernel`)
CACHE = ({"cache_intermediates": False}, {"cache_intermediates": True}, {"recompute_states": True})
# one case per family, op and regime (each costs 6-65 s of compiling on one core; the suite keeps
# the 16-bit cases, whose kernels differ most, and fp32 where a regime has no 16-bit case here)
CASES = {
    "rwkv7_chunk_bf16_centred": lambda: _launches(_op("rwkv7.chunk_triton", "chunk_rwkv7_triton"), "rwkv7",
                                                  torch.bfloat16, [c | {"gate_lower_bound": BOUND} for c in CACHE]),
    "rwkv7_chunk_fp32_exact": lambda: _launches(_op("rwkv7.chunk_triton", "chunk_rwkv7_triton"), "rwkv7",
                                                torch.float32, CACHE),
    "rwkv7_fused_recurrent_bf16": lambda: _launches(
        _op("rwkv7.fused_recurrent_triton", "fused_recurrent_rwkv7_triton"), "rwkv7", torch.bfloat16),
    "rwkv6_chunk_bf16": lambda: _launches(_op("rwkv6.chunk_triton", "chunk_rwkv6_triton"), "rwkv6", torch.bfloat16),
    "rwkv6_fused_recurrent_bf16": lambda: _launches(
        _op("rwkv6.fused_recurrent_triton", "fused_recurrent_rwkv6_triton"), "rwkv6", torch.bfloat16),
    "gsa_chunk_bf16": lambda: _launches(_op("gsa.chunk_triton", "chunk_gsa_triton"), "gsa", torch.bfloat16),
    "gsa_fused_recurrent_bf16": lambda: _launches(
        _op("gsa.fused_recurrent_triton", "fused_recurrent_gsa_triton"), "gsa", torch.bfloat16),
    "token_shift_mix_bf16": _token_shift_mix_launches,
    "squared_relu_mlp_bf16": _squared_relu_mlp_launches,
}


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") != "1", "the sm_90 compile check needs TRITON_INTERPRET unset"
    sys.exit(1 if compile_all(CASES[sys.argv[1]]()) else 0)
