"""Speed of flame's linear-attention kernels on one CUDA GPU, against fla's at the same shapes when
fla is installed, and against RWKV-LM's RWKV7 kernels where an op names them: the forward, and
forward + backward, of each registered op.

    python -m bench.ops                        # every registered op at its shapes
    python -m bench.ops --ops chunk_rwkv6      # a subset
    python -m bench.ops --profile              # also a per-kernel profile of one forward+backward
    python -m bench.ops --value-checks         # with flame's input value checks (a host sync per call)
    python -m bench.ops --ops chunk_gsa --warm-only   # compile (and autotune) only, no timing
    python -m bench.ops --ops chunk_gsa --shape 2 --libs fla   # one shape, one library
    python -m bench.ops --ops chunk_rwkv7_logit --libs flame,rwkvlm,rwkvlm_h100   # beside RWKV-LM's kernels
    python -m bench.ops --ops chunk_rwkv7 --libs flame --profile \
        --launch "_bwd_maps_kernel:num_warps=8,maxnreg=None"  # a launch-option variant of a kernel

Triton compiles (and fla autotunes) on first use, one CPU core per process; fla's cold autotune takes
minutes. `--warm-only` runs each op's forward+backward once per shape and library and prints nothing
else: several such processes in parallel (one per op, shape and library) fill Triton's on-disk cache,
and a timing run after them starts warm. Do not time while other processes use the GPU.

Times are medians of `triton.testing.do_bench` (ms): the forward, and forward + backward (the
backward of <o, do> with a fixed random do). Each op and shape prints one line per library; `ratio`
is flame / that library (< 1: flame is faster).

RWKV-LM's kernels (`rwkvlm`: its default `rwkv7_clampw`, `rwkvlm_h100`: `rwkv7_clampw_v3_for_h100`,
bench/rwkvlm_kernels.py) need its checkout (docs/rwkv-lm.md) and nvcc; each builds on first use.
They take the decay's logit and apply `-exp(-0.5) * sigmoid` inside, so `chunk_rwkv7_logit` times
flame's and fla's chunk_rwkv7 with that sigmoid in the timed call, as flame's RWKV7 layer runs it.

`--launch KERNEL:KEY=VALUE,...` (repeatable) overrides launch keywords (num_warps, num_stages,
maxnreg, or a kernel's constexpr block sizes) of any of flame's Triton kernels in flame/ops, by the
kernel's name, for this process: the way to time a launch variant of any family's kernels against
the default in two runs. Values are Python literals; a kernel under `triton.autotune` takes no
override of what its configs set.

Each op is one `BenchOp` in REGISTRY: a name, its shapes, an input builder, the flame and fla
callables (fla's is None where fla has no counterpart, or returns None when fla is not installed),
and further libraries' loaders (`peers`). A family adds its entry with `register(BenchOp(...))`
below the existing ones.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import pkgutil
import re
import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from bench.timing import (FLA_MISSING, fla_available, fla_function, forward_and_backward_ms, profile_forward_backward,
                          require_cuda, warm_forward_backward)


@dataclass(frozen=True)
class BenchOp:
    name: str
    shapes: tuple[dict, ...]                        # keyword arguments of make_inputs (B, T, H, K, V, ...)
    make_inputs: Callable[..., dict]                # (dtype, device, **shape) -> dict of tensors (leaves require grad)
    flame: Callable[[dict], torch.Tensor]           # inputs -> o
    fla: Callable[[], Callable[[dict], torch.Tensor] | None] | None = None   # () -> (inputs -> o), or None
    peers: tuple[tuple[str, Callable[[], Callable[[dict], torch.Tensor]]], ...] = ()
    """(library, loader): other implementations; a loader raises RwkvLmMissing (or ImportError)
    where its library is not available."""


REGISTRY: dict[str, BenchOp] = {}


def register(op: BenchOp) -> None:
    REGISTRY[op.name] = op


# ------------------------------------------------------------------------------------------------
# RWKV6

def _rwkv6_inputs(dtype, device, B, T, H, K, V):
    def leaf(x):
        return x.to(dtype).requires_grad_(True)
    gen = torch.Generator(device=device).manual_seed(0)
    return {
        "r": leaf(torch.randn(B, T, H, K, device=device, generator=gen)),
        "k": leaf(torch.randn(B, T, H, K, device=device, generator=gen)),
        "v": leaf(torch.randn(B, T, H, V, device=device, generator=gen)),
        "w": leaf(F.logsigmoid(torch.randn(B, T, H, K, device=device, generator=gen))),
        "u": leaf(torch.randn(H, K, device=device, generator=gen) * 0.5),
    }


def _flame_chunk_rwkv6(x):
    from flame.ops.rwkv6.chunk import chunk_rwkv6
    return chunk_rwkv6(x["r"], x["k"], x["v"], x["w"], x["u"], scale=1.0, backend="triton")[0]


def _fla_chunk_rwkv6():
    fn = fla_function("fla.ops.rwkv6", "chunk_rwkv6")
    return None if fn is None else (lambda x: fn(x["r"], x["k"], x["v"], x["w"], x["u"], scale=1.0)[0])


register(BenchOp(
    name="chunk_rwkv6",
    shapes=(dict(B=8, T=2048, H=16, K=64, V=64), dict(B=2, T=8192, H=16, K=64, V=64)),
    make_inputs=_rwkv6_inputs,
    flame=_flame_chunk_rwkv6,
    fla=_fla_chunk_rwkv6,
))


# ------------------------------------------------------------------------------------------------
# RWKV7

RWKV7_LOG_DECAY_BOUND = -0.6065306597126334  # the RWKV7 layer's log-decay lies in (bound, 0]


def _rwkv7_inputs(dtype, device, B, T, H, K, V):
    """The layer's distributions: w = bound * sigmoid(randn), a = -kappa_hat, b = kappa_hat * alpha."""
    def leaf(x):
        return x.to(dtype).requires_grad_(True)
    gen = torch.Generator(device=device).manual_seed(0)
    kappa = F.normalize(torch.randn(B, T, H, K, device=device, generator=gen), dim=-1)
    alpha = torch.sigmoid(torch.randn(B, T, H, K, device=device, generator=gen))
    return {
        "r": leaf(torch.randn(B, T, H, K, device=device, generator=gen)),
        "w": leaf(RWKV7_LOG_DECAY_BOUND * torch.sigmoid(torch.randn(B, T, H, K, device=device, generator=gen))),
        "k": leaf(torch.randn(B, T, H, K, device=device, generator=gen) * K ** -0.5),
        "v": leaf(torch.randn(B, T, H, V, device=device, generator=gen)),
        "a": leaf(-kappa),
        "b": leaf(kappa * alpha),
    }


def _rwkv7_args(x):
    return x["r"], x["w"], x["k"], x["v"], x["a"], x["b"]


def _flame_chunk_rwkv7(**options):
    """flame's chunk_rwkv7 on the layer's path (the gate bound), with the memory `options` of the op."""
    def run(x):
        from flame.ops.rwkv7.chunk import chunk_rwkv7
        return chunk_rwkv7(*_rwkv7_args(x), scale=1.0, backend="triton", gate_lower_bound=RWKV7_LOG_DECAY_BOUND,
                           **options)[0]
    return run


def _fla_chunk_rwkv7():
    fn = fla_function("fla.ops.rwkv7", "chunk_rwkv7")
    return None if fn is None else (
        lambda x: fn(*_rwkv7_args(x), scale=1.0, lower_bound=RWKV7_LOG_DECAY_BOUND)[0])


def _flame_chunk_rwkv7_exact(x):
    from flame.ops.rwkv7.chunk import chunk_rwkv7
    return chunk_rwkv7(*_rwkv7_args(x), scale=1.0, backend="triton")[0]


def _fla_chunk_rwkv7_exact():
    fn = fla_function("fla.ops.rwkv7", "chunk_rwkv7")
    return None if fn is None else (lambda x: fn(*_rwkv7_args(x), scale=1.0)[0])


def _flame_fused_recurrent_rwkv7(x):
    from flame.ops.rwkv7.fused_recurrent import fused_recurrent_rwkv7
    return fused_recurrent_rwkv7(*_rwkv7_args(x), scale=1.0, backend="triton")[0]


RWKV7_SHAPES = (dict(B=8, T=2048, H=16, K=64, V=64), dict(B=2, T=8192, H=16, K=64, V=64))

# the layer's path: the centred tensor-core regime licensed by the gate bound (C = 32); by default the
# backward recomputes the per-chunk intermediates, "cached" keeps them from the forward (more memory),
# "recompute_states" keeps no states and recomputes them in the backward's scan launch (less memory)
for _name, _options in (("chunk_rwkv7", {}), ("chunk_rwkv7_cached", {"cache_intermediates": True}),
                        ("chunk_rwkv7_recompute_states", {"recompute_states": True})):
    register(BenchOp(name=_name, shapes=RWKV7_SHAPES, make_inputs=_rwkv7_inputs,
                     flame=_flame_chunk_rwkv7(**_options), fla=_fla_chunk_rwkv7))


def _rwkv7_logit_inputs(dtype, device, B, T, H, K, V):
    """The layer's inputs with the decay as its logit (standard normal), as RWKV-LM's kernels take it."""
    x = _rwkv7_inputs(dtype, device, B, T, H, K, V)
    gen = torch.Generator(device=device).manual_seed(1)
    x["w"] = torch.randn(B, T, H, K, device=device, generator=gen).to(dtype).requires_grad_(True)
    return x


def _logit_to_log_decay(x):
    return {**x, "w": RWKV7_LOG_DECAY_BOUND * torch.sigmoid(x["w"])}


def _flame_chunk_rwkv7_logit(x):
    return _flame_chunk_rwkv7()(_logit_to_log_decay(x))


def _fla_chunk_rwkv7_logit():
    fn = _fla_chunk_rwkv7()
    return None if fn is None else (lambda x: fn(_logit_to_log_decay(x)))


def _rwkvlm_rwkv7(lib: str):
    def load():
        from bench.rwkvlm_kernels import attention
        kernel = attention(lib)
        return lambda x: kernel(*_rwkv7_args(x))
    return load


# the layer's decay from its logit inside the timed call, beside RWKV-LM's two kernels, at the shipped
# configs' shapes (rwkv7_340M B8 H16, rwkv7_1B's heads per batch B4 H32 and B4 H16) and longer T
register(BenchOp(
    name="chunk_rwkv7_logit",
    shapes=(dict(B=8, T=2048, H=16, K=64, V=64), dict(B=4, T=2048, H=32, K=64, V=64),
            dict(B=4, T=2048, H=16, K=64, V=64), dict(B=4, T=4096, H=16, K=64, V=64),
            dict(B=2, T=8192, H=16, K=64, V=64), dict(B=1, T=16384, H=16, K=64, V=64)),
    make_inputs=_rwkv7_logit_inputs,
    flame=_flame_chunk_rwkv7_logit,
    fla=_fla_chunk_rwkv7_logit,
    peers=(("rwkvlm", _rwkvlm_rwkv7("rwkvlm")), ("rwkvlm_h100", _rwkvlm_rwkv7("rwkvlm_h100"))),
))
register(BenchOp(  # no bound: exact per-pair exponents (C = 16) on both sides
    name="chunk_rwkv7_exact",
    shapes=RWKV7_SHAPES[:1],
    make_inputs=_rwkv7_inputs,
    flame=_flame_chunk_rwkv7_exact,
    fla=_fla_chunk_rwkv7_exact,
))
register(BenchOp(  # fla's fused recurrent RWKV7 has no backward: flame only
    name="fused_recurrent_rwkv7",
    shapes=(dict(B=8, T=512, H=16, K=64, V=64),),
    make_inputs=_rwkv7_inputs,
    flame=_flame_fused_recurrent_rwkv7,
))


# ------------------------------------------------------------------------------------------------
# GSA

def _gsa_inputs(dtype, device, B, T, H, K, V, M):
    """The layer's distributions: swish q and k, g = logsigmoid(randn) / 8, s = 1 - exp(g)."""
    def leaf(x):
        return x.to(dtype).requires_grad_(True)
    gen = torch.Generator(device=device).manual_seed(0)
    g = F.logsigmoid(torch.randn(B, T, H, M, device=device, generator=gen)) / 8
    return {
        "q": leaf(F.silu(torch.randn(B, T, H, K, device=device, generator=gen))),
        "k": leaf(F.silu(torch.randn(B, T, H, K, device=device, generator=gen))),
        "v": leaf(torch.randn(B, T, H, V, device=device, generator=gen)),
        "s": leaf(-torch.expm1(g)),
        "g": leaf(g),
    }


def _gsa_args(x):
    return x["q"], x["k"], x["v"], x["s"], x["g"]


def _flame_chunk_gsa(x):
    from flame.ops.gsa.chunk import chunk_gsa
    return chunk_gsa(*_gsa_args(x), scale=1.0, backend="triton")[0]


def _fla_chunk_gsa():
    fn = fla_function("fla.ops.gsa", "chunk_gsa")
    return None if fn is None else (lambda x: fn(*_gsa_args(x), scale=1.0)[0])


def _flame_fused_recurrent_gsa(x):
    from flame.ops.gsa.fused_recurrent import fused_recurrent_gsa
    return fused_recurrent_gsa(*_gsa_args(x), scale=1.0, backend="triton")[0]


def _fla_fused_recurrent_gsa():
    fn = fla_function("fla.ops.gsa", "fused_recurrent_gsa")
    return None if fn is None else (lambda x: fn(*_gsa_args(x), scale=1.0)[0])


register(BenchOp(  # 4 heads of dim 256 with 64 slots (the GSA-340M layer shape), and
    # 32 slots of head dim 64, where the slot kernels multiply in fp32 (flame/ops/gsa/chunk_triton.py)
    name="chunk_gsa",
    shapes=(dict(B=8, T=2048, H=4, K=256, V=256, M=64), dict(B=2, T=8192, H=4, K=256, V=256, M=64),
            dict(B=8, T=2048, H=16, K=64, V=64, M=32)),
    make_inputs=_gsa_inputs,
    flame=_flame_chunk_gsa,
    fla=_fla_chunk_gsa,
))
register(BenchOp(
    name="fused_recurrent_gsa",
    shapes=(dict(B=8, T=512, H=4, K=128, V=128, M=64),),
    make_inputs=_gsa_inputs,
    flame=_flame_fused_recurrent_gsa,
    fla=_fla_fused_recurrent_gsa,
))


# ------------------------------------------------------------------------------------------------
# The RWKV channel mix: relu(x W_k^T)^2 W_v^T, flame's squared_relu_mlp (the activation in the Triton
# products' epilogues) against the same formula compiled by Inductor (cuBLAS products, one fused
# elementwise kernel each way), at the shipped configs' shapes per micro-batch: rwkv7_340M (8 x 2048
# tokens, C 1024, F 4C), rwkv7_1B (4 x 2048, C 2048), rwkv6_340M (F 3.5 C)

def _channel_mix_inputs(dtype, device, M, C, F):
    gen = torch.Generator(device=device).manual_seed(0)
    return {
        "x": torch.randn(M, C, device=device, generator=gen).to(dtype).requires_grad_(True),
        "w_key": (torch.randn(F, C, device=device, generator=gen) / C**0.5).to(dtype).requires_grad_(True),
        "w_value": (torch.randn(C, F, device=device, generator=gen) / F**0.5).to(dtype).requires_grad_(True),
    }


def _flame_squared_relu_mlp(x):
    from flame.ops import squared_relu_mlp
    return squared_relu_mlp(x["x"], x["w_key"], x["w_value"], backend="triton")


def _inductor_squared_relu_mlp():
    from flame.ops import squared_relu_mlp
    composed = torch.compile(lambda x, w_key, w_value: squared_relu_mlp(x, w_key, w_value, backend="torch"))
    return lambda x: composed(x["x"], x["w_key"], x["w_value"])


register(BenchOp(
    name="squared_relu_mlp",
    shapes=(dict(M=16384, C=1024, F=4096), dict(M=8192, C=2048, F=8192), dict(M=16384, C=1024, F=3584)),
    make_inputs=_channel_mix_inputs,
    flame=_flame_squared_relu_mlp,
    peers=(("inductor", _inductor_squared_relu_mlp),),
))


# ------------------------------------------------------------------------------------------------
# The blocks' norms in the form the models' blocks call them (flame.ops.layer_norm / rms_norm with
# the residual add; s + y so that the backward takes the stream's gradient too), per micro-batch
# of the shipped configs: layer_norm rwkv7_340M (8 x 2048 tokens, C 1024) and rwkv7_1B (4 x 2048,
# C 2048), rms_norm gsa_340M (16 x 2048, C 1024) and gsa_1B (8 x 2048, C 2048)

def _norm_inputs(bias: bool):
    """The inputs of a norm's entry: x, residual, weight, and a bias for LayerNorm (its presence
    picks layer_norm over rms_norm in `_flame_norm`)."""
    def make(dtype, device, M, C):
        gen = torch.Generator(device=device).manual_seed(0)
        inputs = {
            "x": torch.randn(M, C, device=device, generator=gen).to(dtype).requires_grad_(True),
            "residual": torch.randn(M, C, device=device, generator=gen).to(dtype).requires_grad_(True),
            "weight": (1 + 0.1 * torch.randn(C, device=device, generator=gen)).to(dtype).requires_grad_(True),
        }
        if bias:
            inputs["bias"] = (0.1 * torch.randn(C, device=device, generator=gen)).to(dtype).requires_grad_(True)
        return inputs
    return make


def _flame_norm(x):
    from flame.ops import layer_norm, rms_norm
    if "bias" in x:
        s, y = layer_norm(x["x"], x["weight"], x["bias"], 1e-5, residual=x["residual"], backend="triton")
    else:
        s, y = rms_norm(x["x"], x["weight"], 1e-5, residual=x["residual"], backend="triton")
    return s + y


register(BenchOp(name="layer_norm", shapes=(dict(M=16384, C=1024), dict(M=8192, C=2048)),
                 make_inputs=_norm_inputs(bias=True), flame=_flame_norm))
register(BenchOp(name="rms_norm", shapes=(dict(M=32768, C=1024), dict(M=16384, C=2048)),
                 make_inputs=_norm_inputs(bias=False), flame=_flame_norm))


# ------------------------------------------------------------------------------------------------
# launch-option variants

def parse_launch(spec: str) -> tuple[str, dict]:
    """("KERNEL", {key: value}) from "KERNEL:KEY=VALUE,..."; values are Python literals."""
    kernel, sep, pairs = spec.partition(":")
    items = [item for item in re.split(r",(?=\s*\w+=)", pairs) if item.strip()]  # "(1, 2)" stays whole
    if not kernel or not sep or not items or any("=" not in item for item in items):
        raise SystemExit(f"--launch {spec!r}: expected KERNEL:KEY=VALUE[,KEY=VALUE...]")

    def literal(text: str):
        try:
            return ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            return text.strip()
    return kernel, {key.strip(): literal(value) for key, value in (item.split("=", 1) for item in items)}


def override_launches(specs: list[str], package: str = "flame.ops") -> list[str]:
    """Make every launch of each named Triton kernel in `package` use the given keywords (for this
    process). Returns "module.kernel: overrides" lines; exits naming a kernel that is not found."""
    if not specs:
        return []
    root = importlib.import_module(package)
    for info in pkgutil.walk_packages(root.__path__, package + "."):
        importlib.import_module(info.name)
    applied = []
    for spec in specs:
        name, overrides = parse_launch(spec)
        found = [(mod_name, module) for mod_name, module in list(sys.modules.items())
                 if (mod_name == package or mod_name.startswith(package + ".")) and module is not None
                 and hasattr(getattr(module, name, None), "run")]
        if not found:
            raise SystemExit(f"--launch: no Triton kernel {name!r} in {package}")
        patched = set()
        for mod_name, module in found:
            kernel = getattr(module, name)
            if id(kernel) in patched:  # the same kernel imported into another module
                continue
            patched.add(id(kernel))
            run = kernel.run

            def patched_run(*args, _run=run, _overrides=overrides, **kwargs):
                kwargs.update(_overrides)
                return _run(*args, **kwargs)
            kernel.run = patched_run
            applied.append(f"{mod_name}.{name}: {overrides}")
    return applied


# ------------------------------------------------------------------------------------------------

def _profile(fn: Callable[[dict], torch.Tensor], inputs: dict, title: str) -> None:
    prof = profile_forward_backward(fn, inputs, 5)
    print(f"\nprofile of 5 x forward+backward: {title}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))


def _lines(name: str, label: str, times: dict[str, tuple[float, float]]) -> list[str]:
    """One line per library: its forward and forward+backward ms, and flame's time over its."""
    mine = times.get("flame")
    lines = []
    for lib, (fwd, both) in times.items():
        ratios = (f"{mine[0] / fwd:>7.2f}{mine[1] / both:>7.2f}" if mine and lib != "flame"
                  else f"{'-':>7}{'-':>7}")
        lines.append(f"{name:<24}{label:<28}{lib:<13}{fwd:>9.3f}{both:>9.3f}{ratios}")
    return lines


def known_libs() -> list[str]:
    """flame, fla, then every registered op's peer libraries."""
    libs = ["flame", "fla"]
    for op in REGISTRY.values():
        libs += [lib for lib, _ in op.peers if lib not in libs]
    return libs


def load_callables(op: BenchOp, libs: set[str], unavailable: dict[str, str]) -> list[tuple[str, Callable]]:
    """(library, inputs -> o) of `op` for the selected libraries that it has; a library that cannot
    be loaded is named once in `unavailable` (with why) and left out."""
    fns = []
    if "flame" in libs:
        fns.append(("flame", op.flame))
    if "fla" in libs and op.fla is not None and (fn := op.fla()) is not None:
        fns.append(("fla", fn))
    for lib, loader in op.peers:
        if lib not in libs or lib in unavailable:
            continue
        try:
            fns.append((lib, loader()))
        except (ImportError, OSError, RuntimeError) as err:  # RwkvLmMissing is a RuntimeError
            unavailable[lib] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
            print(f"{lib}: not available ({unavailable[lib]})", flush=True)
    return fns


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", default=",".join(REGISTRY), help="comma-separated op names")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--profile", action="store_true",
                        help="print a per-kernel profile of each op's first shape (or of --shape)")
    parser.add_argument("--warm-only", action="store_true",
                        help="compile and autotune only: one forward+backward per op, shape and library")
    parser.add_argument("--shape", type=int, default=None, help="only this index into each op's shapes")
    parser.add_argument("--libs", default="flame,fla",
                        help=f"comma-separated of {', '.join(known_libs())} (default flame,fla)")
    parser.add_argument("--value-checks", action="store_true",
                        help="keep flame's input value checks on (one host sync per call; fla has none)")
    parser.add_argument("--launch", action="append", default=[], metavar="KERNEL:KEY=VALUE,...",
                        help="override launch keywords of one of flame's Triton kernels (repeatable)")
    args = parser.parse_args(argv)
    names = [n for n in args.ops.split(",") if n]
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise SystemExit(f"unknown ops {unknown}; registered: {list(REGISTRY)}")
    libs = {lib for lib in args.libs.split(",") if lib}
    if not libs or not libs <= set(known_libs()):
        raise SystemExit(f"--libs takes a comma-separated subset of {', '.join(known_libs())}, not {args.libs!r}")
    require_cuda("bench.ops")
    dtype = getattr(torch, args.dtype)

    if "fla" in libs and not fla_available():
        print(FLA_MISSING)
    for line in override_launches(args.launch):
        print(f"launch override: {line}")

    from flame.ops.utils.checks import set_value_checks
    set_value_checks(args.value_checks)
    print(f"device: {torch.cuda.get_device_name()}, dtype {args.dtype}, times in ms (median), "
          f"flame value checks {'on' if args.value_checks else 'off'}")
    header = f"{'op':<24}{'shape':<28}{'lib':<13}{'fwd':>9}{'f+b':>9}{'ratio':>7}{'ratio':>7}"
    print(header + "   (ratio: flame / lib, fwd and f+b)")
    print("-" * len(header))
    unavailable: dict[str, str] = {}
    for name in names:
        op = REGISTRY[name]
        fns = load_callables(op, libs, unavailable)
        for i, shape in enumerate(op.shapes):
            if args.shape is not None and i != args.shape:
                continue
            label = "_".join(f"{k}{v}" for k, v in shape.items())
            try:  # one failing op (or fla version mismatch) must not hide the others' numbers
                inputs = op.make_inputs(dtype, "cuda", **shape)
                if args.warm_only:
                    for _, fn in fns:
                        warm_forward_backward(fn, inputs)
                    print(f"{name:<24}{label:<28}warm", flush=True)
                else:
                    for line in _lines(name, label, {lib: forward_and_backward_ms(fn, inputs) for lib, fn in fns}):
                        print(line, flush=True)
                    if args.profile and (args.shape is not None or i == 0):
                        for lib, fn in fns:
                            _profile(fn, inputs, f"{lib} {name} {label}")
            except Exception as err:  # noqa: BLE001 - reported, then the next shape runs
                print(f"{name:<24}{label:<28}FAILED: {type(err).__name__}: {str(err).splitlines()[0][:200]}", flush=True)
            inputs = None
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
