"""Registers and spills of flame's largest Triton kernels, compiled for an NVIDIA GPU on any machine.

    python -m bench.registers                        # every kernel below, for sm_90 (H100)
    python -m bench.registers --only rwkv7.bwd --json regs.json

Triton compiles each kernel with the launch settings and block sizes the op ships at the 340M
layer shape (RWKV7 and RWKV6: B8 T2048 H16 K=V=64, RWKV7 with the model's gate bound; GSA: H4
K=V=256 M64; the channel mix's products with their squared-ReLU epilogues; bf16) for the target,
and ptxas (the one in Triton's wheel, run by Triton itself) reports per kernel its registers per
thread and the bytes it spills. No GPU is needed, so a change
to a kernel's tiles or their live ranges can be checked in seconds on a laptop or in CI. Spills are
a hint, not a timing: bench.launch_settings and bench.train_step on a GPU decide what ships
(bench/RESULTS.md, "Chunk kernels' launch settings"). Run it without TRITON_INTERPRET: under the
interpreter the kernels are not compiled.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import io
import json
import os
import re
from dataclasses import asdict, dataclass

# ptxas -v: "Used 255 registers, ..." and "208 bytes stack frame, 200 bytes spill stores, 200 bytes spill loads"
_REGISTERS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
# argument types every chunk kernel shares: the chunk tables and the scale
_TABLE_TYPES = {"cu_seqlens": "*i64", "chunk_info": "*i32", "chunk_indices": "*i32", "scale": "fp32"}


@dataclass
class Report:
    kernel: str
    warps: int
    registers: int
    spill_stores: int
    spill_loads: int
    stack: int


def parse_ptxas_log(log: str, kernel_name: str) -> tuple[int, int, int, int]:
    """(registers, spill store bytes, spill load bytes, stack frame bytes) of `kernel_name` in a
    ptxas -v log."""
    block = log[log.index(f"Compiling entry function '{kernel_name}'"):]
    registers = _REGISTERS.search(block)
    spills = _SPILLS.search(block)
    if registers is None or spills is None:
        raise ValueError(f"no register or spill line for {kernel_name} in the ptxas log:\n{log}")
    stack, stores, loads = (int(x) for x in spills.groups())
    return int(registers.group(1)), stores, loads, stack


def _signature(fn, constexprs: dict, types: dict) -> tuple[dict, dict, dict]:
    """Triton's (signature, constexprs, attributes) of `fn` (a JITFunction): `types` names the
    kernel's own types, over the chunk tables' and scale's (`_TABLE_TYPES`); every other argument is
    an fp32 pointer. Pointers and i32 arguments are marked divisible by 16, as Triton specializes
    them at the launches timed (torch's allocations and head sizes that are multiples of 16)."""
    names = list(inspect.signature(fn.fn).parameters)
    types = {**_TABLE_TYPES, **types}
    signature = {name: "constexpr" if name in constexprs else types.get(name, "*fp32") for name in names}
    consts = {(names.index(name),): value for name, value in constexprs.items()}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
             if signature[name].startswith("*") or signature[name] == "i32"}
    return signature, consts, attrs


def compile_report(label: str, fn, constexprs: dict, types: dict, options: dict, arch: int) -> Report:
    """Compile `fn` for sm_`arch` and read ptxas's report."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, consts, attrs = _signature(fn, constexprs, types)
    log = io.StringIO()
    with knobs.nvidia.scope(), knobs.compilation.scope(), contextlib.redirect_stdout(log):
        knobs.nvidia.dump_ptxas_log = True  # Triton prints its own ptxas -v call's log
        knobs.compilation.always_compile = True  # a cached kernel would skip ptxas and its log
        compiled = triton.compile(ASTSource(fn, signature, consts, attrs), target=GPUTarget("cuda", arch, 32),
                                  options=options)
    registers, stores, loads, stack = parse_ptxas_log(log.getvalue(), compiled.metadata.name)
    return Report(label, options.get("num_warps", 4), registers, stores, loads, stack)


def _rwkv7_jobs() -> dict:
    """RWKV7's per-chunk kernels with the plan of the 340M layer (`ChunkPlan`), bf16."""
    import torch

    from flame.models.rwkv7 import DECAY_BOUND
    from flame.ops.rwkv7 import chunk_bwd_triton, chunk_prepare_triton
    from flame.ops.rwkv7.chunk_plan import ChunkPlan

    r = torch.empty(8, 2048, 16, 64, dtype=torch.bfloat16, device="meta")
    plan = ChunkPlan(r, r, None, -DECAY_BOUND)
    mode = plan.modes[0]  # the centred regime's launch: every chunk of a trained model
    bf16 = {name: "*bf16" for name in ("q", "w", "k", "v", "a", "b", "do", "Qs", "Es", "Cs", "dq", "dw", "dk", "da",
                                       "db")}
    types = {**bf16, "regime": "*i8", "lower_bound": "fp32", "H": "i32", "K": "i32", "V": "i32"}
    common = dict(BT=plan.BT, BK=plan.BK, MODE=mode, LOWP=plan.lowp, TF32=plan.tf32, PREC=plan.prec, HP=plan.HP)
    prepare = dict(num_warps=plan.warps_prepare, num_stages=1, maxnreg=plan.maxnreg)
    return {
        # the forward of the shipped 340M config (cache_intermediates = true) keeps W, G, M^ak, M^qb and Tm
        "rwkv7.prepare_cached": (chunk_prepare_triton._prepare_kernel, dict(common, STORE_BWD=True, TM_MODE=0), types,
                                 prepare),
        # without the cache: the forward keeps Tm, the backward runs prepare again from it
        "rwkv7.prepare_fwd": (chunk_prepare_triton._prepare_kernel, dict(common, STORE_BWD=False, TM_MODE=1), types,
                              prepare),
        "rwkv7.prepare_bwd": (chunk_prepare_triton._prepare_kernel, dict(common, STORE_BWD=True, TM_MODE=2), types,
                              prepare),
        "rwkv7.bwd_maps": (chunk_bwd_triton._bwd_maps_kernel, dict(common, BV=plan.BV_bwd), types,
                           dict(num_warps=plan.warps_maps, num_stages=plan.stages_maps)),
        "rwkv7.bwd_intra": (chunk_bwd_triton._bwd_intra_kernel, common, types,
                            dict(num_warps=plan.warps_intra, num_stages=1, maxnreg=plan.maxnreg)),
    }


def _gsa_jobs() -> dict:
    """GSA's slot kernels at gsa_340M's layer shape, bf16."""
    import triton.language as tl

    from flame.ops.gsa import chunk_triton as gsa

    K, M = 256, 64
    BK, BM = gsa._slot_blocks(K, M)
    types = {name: "*bf16" for name in ("q", "k", "s", "dq", "dk", "ds", "dg")}
    const = dict(H=4, K=K, M=M, BT=64, BC=16, BK=BK, BM=BM, DT=gsa._slot_dot_dtype(M, tl.bfloat16))
    options = dict(num_warps=gsa._SLOT_WARPS, num_stages=gsa._SLOT_STAGES)
    from flame.ops.common.chunk_triton import output

    intra = dict(H=4, K=M, V=1, BT=64, BC=16, BK=BM, BV=64, EXCLUSIVE=False, HAS_U=False, LOCAL_STATE=False,
                 DT=tl.bfloat16)
    return {"gsa.slots_fwd": (gsa._slots_fwd_kernel, dict(const, STORE_Z=True), types, options),
            "gsa.slots_bwd": (gsa._slots_bwd_kernel, const, types, options),
            "gsa.value_intra": (output._intra_fwd_kernel, intra, {"q": "*fp32", "k": "*bf16", "H": "i32"},
                                dict(num_warps=gsa._CORE_WARPS, num_stages=1))}


def _rwkv6_jobs() -> dict:
    """RWKV6's backward kernels of the common chunk core (dv and dA; dq, dk, dw) at rwkv6_340M's layer
    shape, bf16."""
    import torch

    from flame.ops.common.chunk_triton import grads
    from flame.ops.common.chunk_triton.plan import block_sizes, dot_dtype, three_programs_register_cap
    from flame.ops.rwkv6.chunk_triton import CHUNK_SIZE

    K = V = 64
    BK, BV = block_sizes(K, V)
    types = {name: "*bf16" for name in ("q", "k", "v", "do", "dq", "dk", "dv", "dg", "u")}
    types["H"] = "i32"
    const = dict(K=K, V=V, BT=CHUNK_SIZE, BV=BV, EXCLUSIVE=True, HAS_U=True, DT=dot_dtype(torch.bfloat16, K))
    dqkg = dict(const, BK=min(BK, grads.DQKG_BLOCK_K), BC=16, SOFTMAX_BWD=False)
    from flame.ops.common.chunk_triton import output
    from flame.ops.rwkv6.chunk_triton import INTRA_SUB_CHUNK

    intra = dict(K=K, V=V, BT=CHUNK_SIZE, BC=INTRA_SUB_CHUNK, BK=min(BK, output.INTRA_BLOCK_K), BV=BV, EXCLUSIVE=True,
                 HAS_U=True, LOCAL_STATE=False, DT=dot_dtype(torch.bfloat16, K))
    return {"rwkv6.intra_fwd": (output._intra_fwd_kernel, intra, types,
                                dict(num_warps=output.INTRA_WARPS, num_stages=1)),
            "rwkv6.dv": (grads._dv_kernel, dict(const, BK=BK, STORE_DV=True, STORE_DA=True), types,
                         dict(num_warps=grads.DV_WARPS, num_stages=1, maxnreg=three_programs_register_cap(K))),
            "rwkv6.dqkg": (grads._dqkg_kernel, dqkg, types,
                           dict(num_warps=grads.DQKG_WARPS, num_stages=1))}


def _mlp_jobs() -> dict:
    """The RWKV channel mix's product with relu(.)^2 in its epilogue (squared_relu_mlp): the forward's
    key product and the backward's dout W_v, bf16, with the shipped tiles."""
    import triton.language as tl

    from flame.ops.squared_relu import squared_relu_mlp_triton as mlp

    BM, BN, BK = mlp.BLOCK_M, mlp.BLOCK_N, mlp.BLOCK_K

    def desc(rows: int, cols: int) -> str:
        return f"tensordesc<bf16[{rows}, {cols}]>"

    types = {"a_desc": desc(BM, BK), "y_desc": desc(BM, BN), "out_desc": desc(BM, BN), "M": "i32", "N": "i32",
             "K": "i32"}
    const = dict(DT=tl.bfloat16, BM=BM, BN=BN, BK=BK, GROUP=mlp.GROUP_M)
    options = dict(num_warps=mlp.NUM_WARPS, num_stages=mlp.NUM_STAGES)
    return {"mlp.sqrelu_fwd": (mlp._matmul_epilogue_kernel, dict(const, EPILOGUE=mlp.SQRELU, B_TRANSPOSED=True),
                               dict(types, b_desc=desc(BN, BK)), options),
            "mlp.sqrelu_bwd": (mlp._matmul_epilogue_kernel, dict(const, EPILOGUE=mlp.SQRELU_GRAD, B_TRANSPOSED=False),
                               dict(types, b_desc=desc(BK, BN)), options)}


def jobs() -> dict:
    """{label: (kernel, constexprs, argument types, compile options)}."""
    return {**_rwkv7_jobs(), **_rwkv6_jobs(), **_gsa_jobs(), **_mlp_jobs()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="the kernels whose label contains this text")
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100, H200)")
    parser.add_argument("--json", help="write the reports here")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("bench.registers compiles kernels: unset TRITON_INTERPRET (the interpreter compiles nothing)")
    reports = []
    for label, (fn, constexprs, types, options) in jobs().items():
        if args.only not in label:
            continue
        report = compile_report(label, fn, constexprs, types, options, args.arch)
        reports.append(report)
        print(f"{label:22s} {report.warps} warps  {report.registers:3d} registers  spills {report.spill_stores} B "
              f"stored / {report.spill_loads} B loaded per thread  stack {report.stack} B", flush=True)
    if not reports:
        parser.error(f"--only {args.only!r} matches none of {sorted(jobs())}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in reports], f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
