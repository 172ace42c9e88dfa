"""Launch settings of flame's chunk kernels, of the channel mix's product kernel and of the norms,
one at a time around the shipped ones, by GPU kernel time.

    python -m bench.launch_settings --ops chunk_rwkv6,chunk_gsa --out launch.json
    python -m bench.launch_settings --ops chunk_rwkv7_cached --only stages    # a subset of the variants
    python -m bench.launch_settings --ops squared_relu_mlp
    python -m bench.launch_settings --ops layer_norm,rms_norm

Each variant changes one launch setting (a sub-chunk, a warp count, a pipeline depth or a block width
that the kernels' modules expose as constants or keyword arguments) and times the op's forward and
backward at the 340M layer shape (squared_relu_mlp and the norms: one micro-batch of rwkv7_340M's
channel mix and norms, gsa_340M's for rms_norm), bf16: the GPU time of each kernel over `--iters` calls under
torch.profiler after two warm-up calls (bench.timing's `profile_forward_backward` and
`kernel_times`). Kernel time, not wall time: a fwd+bwd of a few ms through autograd is partly
host-bound, and a wall-clock timer measures the host's load as much as the kernels
(bench/RESULTS.md, kernels: "Chunk kernels' launch settings"). A setting is worth shipping only when
the whole training step confirms it (`bench.train_step`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from bench.timing import grad_leaves, kernel_times, profile_forward_backward, require_cuda

SHAPES = {"chunk_rwkv6": dict(B=8, T=2048, H=16, K=64, V=64),
          "chunk_gsa": dict(B=8, T=2048, H=4, K=256, V=256, M=64),
          "chunk_rwkv7_cached": dict(B=8, T=2048, H=16, K=64, V=64),
          "squared_relu_mlp": dict(M=16384, C=1024, F=4096),
          "layer_norm": dict(M=16384, C=1024), "rms_norm": dict(M=32768, C=1024)}


def kernel_ms(fn: Callable[[dict], object], inputs: dict, iters: int) -> dict[str, float]:
    """GPU ms per forward+backward of `fn` on `inputs`, by kernel name (every kernel)."""
    prof = profile_forward_backward(fn, inputs, iters, warmup=2)
    return dict(kernel_times(prof, iters, set(), set(), floor_ms=0.0)["top_kernels_ms_per_step"])


def _with_kwargs(fn: Callable, **kwargs) -> Callable:
    def call(*args, **kw):
        return fn(*args, **{**kw, **kwargs})
    return call


def _plan_with(**settings) -> Callable:
    """ChunkPlan.__init__ (RWKV7's launch plan) followed by `settings` on the plan (a scan V block
    BV also sets the scans' block count NV)."""
    import triton

    from flame.ops.rwkv7.chunk_plan import ChunkPlan

    init = ChunkPlan.__init__

    def plan_init(plan, *args, **kwargs):
        init(plan, *args, **kwargs)
        for name, value in settings.items():
            setattr(plan, name, value)
        plan.NV = triton.cdiv(plan.V, plan.BV)
    return plan_init


def _rwkv7_variants() -> dict[str, tuple[object, str, object]]:
    """RWKV7's chunk kernels: the plan's register cap of `prepare`, pipeline stages of `_bwd_maps`
    and the scans, the V blocks of the backward's reductions and of the scans, the scans' warps."""
    from flame.ops.rwkv7 import chunk_plan, chunk_scan_triton

    out: dict[str, tuple[object, str, object]] = {}
    for name, values in (("maxnreg", (None, 128, 232)), ("stages_maps", (1, 2, 4)), ("scan_stages", (1, 3)),
                         ("BV_bwd", (16, 64)), ("BV", (16, 64))):
        for value in values:
            out[f"plan.{name} {value}"] = (chunk_plan.ChunkPlan, "__init__", _plan_with(**{name: value}))
    for warps in (2, 8):
        out[f"WARPS_SCAN {warps}"] = (chunk_scan_triton, "WARPS_SCAN", warps)
    # the per-chunk kernels at 8 warps: half the registers per thread for their fp32 tiles
    for kernel in ("prepare", "maps", "intra"):
        out[f"plan.warps_{kernel} 8"] = (chunk_plan.ChunkPlan, "__init__", _plan_with(**{f"warps_{kernel}": 8}))
    return out


def _mlp_variants() -> dict[str, tuple[object, str, object]]:
    """The channel mix's product kernel (squared_relu_mlp): its tile's rows, columns and reduction step,
    pipeline stages, L2 grouping and persistent programs. Each variant fits an H100's shared memory and
    registers with the other settings shipped; 4 warps do not (a 128 x 256 fp32 accumulator spills 2 KB
    per thread; `python -m bench.registers --only mlp` reads that on any machine)."""
    from flame.ops.squared_relu import squared_relu_mlp_triton as mlp

    out: dict[str, tuple[object, str, object]] = {}
    for name, values in (("BLOCK_M", (64,)), ("BLOCK_N", (128,)), ("BLOCK_K", (32,)), ("NUM_STAGES", (2,)),
                         ("GROUP_M", (4, 16)), ("PERSISTENT", (False,))):
        for value in values:
            out[f"{name} {value}"] = (mlp, name, value)
    return out


def _norm_variants() -> dict[str, tuple[object, str, object]]:
    """The norms' kernels (flame.ops.norm.norm_triton): the tile's elements (whole rows), the
    backward program's elements (rows a program), and the warps of each."""
    from flame.ops.norm import norm_triton

    out: dict[str, tuple[object, str, object]] = {}
    for name, values in (("TILE_ELEMENTS", (1024, 4096)), ("PROGRAM_ELEMENTS", (16384, 65536)),
                         ("FWD_WARPS", (8,)), ("BWD_WARPS", (8,))):
        for value in values:
            out[f"{name} {value}"] = (norm_triton, name, value)
    return out


def variants(op: str) -> dict[str, tuple[object, str, object] | list[tuple[object, str, object]]]:
    """{label: (module, attribute, value), or a list of them set together}: one launch setting each (a
    sub-chunk or warp count as a keyword argument of the function the op calls, or a module constant
    set to another value)."""
    from flame.ops.common.chunk_triton import grads, output, state
    from flame.ops.gsa import chunk_triton as gsa
    from flame.ops.rwkv6 import chunk_triton as rwkv6

    if op == "chunk_rwkv7_cached":
        return _rwkv7_variants()
    if op == "squared_relu_mlp":
        return _mlp_variants()
    if op in ("layer_norm", "rms_norm"):
        return _norm_variants()

    family = {"chunk_rwkv6": rwkv6, "chunk_gsa": gsa}[op]
    out: dict[str, tuple[object, str, object]] = {}
    for sub in (8, 16, 32):
        out[f"dq/dk/dg sub-chunk {sub}"] = (family, "chunk_dqkg_from_dA",
                                            _with_kwargs(family.chunk_dqkg_from_dA, sub_chunk=sub))
        out[f"intra sub-chunk {sub}"] = (family, "chunk_intra_fwd", _with_kwargs(family.chunk_intra_fwd, sub_chunk=sub))
    for warps in (2, 4, 8):
        out[f"dq/dk/dg warps {warps}"] = (family, "chunk_dqkg_from_dA",
                                          _with_kwargs(family.chunk_dqkg_from_dA, num_warps=warps))
    if op == "chunk_rwkv6":
        # narrower K blocks of the dq/dk/dg kernel: half or a quarter of its [BT, BK] fp32 tiles per
        # program (its 64-wide blocks spill at 4 warps: `python -m bench.registers --only dqkg`), alone
        # and at 8 warps. RWKV6 only: GSA's second pass at these blocks stops at an illegal memory
        # access (triton 3.6, bench/RESULTS.md)
        for block in (32, 16):
            out[f"DQKG_BLOCK_K {block}"] = (grads, "DQKG_BLOCK_K", block)
            out[f"DQKG_BLOCK_K {block}, 8 warps"] = [(grads, "DQKG_BLOCK_K", block), (grads, "DQKG_WARPS", 8)]
    for module, name, values in ((grads, "DV_WARPS", (2, 8)), (state, "WALK_WARPS", (2, 8)),
                                 (state, "WALK_STAGES", (1, 2, 4)), (state, "WALK_BLOCK", (32, 128)),
                                 (output, "OUTPUT_WARPS", (2, 8))):
        for value in values:
            out[f"{name} {value}"] = (module, name, value)
    if op == "chunk_gsa":
        for name, values in (("_SLOT_WARPS", (2, 8)), ("_SLOT_STAGES", (2, 3))):
            for value in values:
                out[f"{name} {value}"] = (gsa, name, value)
    return out


def sweep(op: str, iters: int, only: str = "") -> dict[str, dict]:
    """{variant: {"kernels": {kernel: ms per call}, "grad_diff": the largest relative difference of
    an input gradient from the shipped settings' (a setting that breaks a kernel shows here)}} for
    `op`, "shipped" first."""
    import torch

    from bench.ops import REGISTRY

    bench_op = REGISTRY[op]
    inputs = bench_op.make_inputs(torch.bfloat16, "cuda", **SHAPES[op])
    leaves = grad_leaves(inputs)
    grad_out = torch.randn_like(bench_op.flame(inputs))

    def grads():
        for t in leaves:
            t.grad = None
        bench_op.flame(inputs).backward(grad_out)
        return [t.grad.float().clone() for t in leaves]

    shipped_grads = grads()
    results = {"shipped": {"kernels": kernel_ms(bench_op.flame, inputs, iters), "grad_diff": 0.0}}
    for label, settings in variants(op).items():
        if only not in label:
            continue
        settings = settings if isinstance(settings, list) else [settings]
        shipped = [getattr(module, name) for module, name, _ in settings]
        for module, name, value in settings:
            setattr(module, name, value)
        try:
            diff = max(((g - r).norm() / r.norm()).item() for g, r in zip(grads(), shipped_grads))
            results[label] = {"kernels": kernel_ms(bench_op.flame, inputs, iters), "grad_diff": diff}
        finally:
            for (module, name, _), value in zip(settings, shipped):
                setattr(module, name, value)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", default=",".join(SHAPES), help=f"comma-separated, of {sorted(SHAPES)}")
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--only", default="", help="the variants whose label contains this text (and the shipped)")
    parser.add_argument("--out", help="write {op: {variant: {kernels: {kernel: ms}, grad_diff}}} as JSON here")
    args = parser.parse_args()
    ops = [op for op in args.ops.split(",") if op]
    unknown = sorted(set(ops) - set(SHAPES))
    if unknown:
        parser.error(f"--ops: unknown {unknown}; choose from {sorted(SHAPES)}")
    require_cuda("bench.launch_settings")
    report = {}
    for op in ops:
        report[op] = sweep(op, args.iters, args.only)
        shipped = sum(report[op]["shipped"]["kernels"].values())
        for label, found in report[op].items():
            kernels = found["kernels"]
            top = ", ".join(f"{name[:24]} {ms * 1e3:.0f}" for name, ms in
                            sorted(kernels.items(), key=lambda kv: -kv[1])[:5])
            print(f"{op} {label}: {sum(kernels.values()) * 1e3:.0f} us ({sum(kernels.values()) / shipped:.2f}), "
                  f"gradients {found['grad_diff']:.1e} from shipped | {top}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
