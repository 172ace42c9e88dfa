"""Speed of flame.ops.decode_matmul on one CUDA GPU against the PyTorch composition it replaces in
a decoding step without flame's fused kernels (F.layer_norm / F.rms_norm, the residual add and the
token-shift lerps as PyTorch elementwise ops, torch.bmm / nn.Linear on cuBLAS, the activations), at
the 340M models' shapes (hidden 1024), bf16, batch 1, 8 and 64:

    python -m bench.decode_matmul
    python -m bench.decode_matmul --batch-sizes 1,8,64,256 --cases rwkv7_in,ffn

Cases (what one sub-layer of a decoding step launches):
- rwkv7_in: RWKV7's norm, six token-shift lerps, r/k/v and the four LoRAs' first matrices with
  tanh/sigmoid. Composition: F.layer_norm, the lerps h + (prev - h) * mu (addcmul), prev.copy_(h),
  bmm (r, k, v), bmm (LoRA firsts), tanh_, sigmoid_.
- lora_out: RWKV7's four LoRA second matrices (rank 160 -> 1024 each): bmm.
- ffn: RWKV7's channel mix: the residual add (add_), F.layer_norm, the lerp, prev.copy_(h), key
  Linear, relu(.)^2, value Linear.
- out_residual: the output projection and the residual add: Linear, then add_.
- gsa_mlp: GSA's RMSNorm, gate/up, silu(gate) * up, down, residual add: F.rms_norm, Linear,
  silu * up, Linear, add_.
- gemv_*: one plain projection (N x K) against F.linear, with the achieved weight bandwidth.

Times are medians of `triton.testing.do_bench` (microseconds per call, one call = the whole case);
`ratio` = fused / composition (< 1: the fused launches are faster).

Sweep of the kernel's launch configurations (`--sweep`), what decode_matmul_tuning.TABLE holds:

    python -m bench.decode_matmul --sweep --out sweep.json \
        --emit-table flame/ops/decode_matmul/decode_matmul_tuning.py --steps 1,64

For every batch size of --sweep-batch-sizes and every distinct (N, K) that one decoding step of a
340M model of --families launches (recorded from `CausalLM.decode_step`: one eager step per
family and batch size with the launches' arguments kept), it times candidate configurations of
the plain kernel (stacked input, no prologue or epilogue, so that one compiled kernel serves every
shape): first the block sizes (the broadcast-and-sum GEMV up to 16 rows, tl.dot tiles from 2 rows,
4 warps, 2 stages), then warps 2/4/8 x stages 1-4 around the best; the --refine-top best are timed
on the recorded launch itself (its prologue and epilogue) and the fastest is the shape's entry.
The shipped entries of batch buckets not swept stay. With --steps covering the swept batch sizes,
a bucket whose whole decoding steps (all --families) take longer with its swept entries than with
the shipped ones keeps the shipped ones: a launch timed alone can rank differently in the step.
Next to it: cuBLAS F.linear of the same product. Every time is a CUDA graph of launches that read
--weight-copies of the weight in turn (enough that they do not stay in L2, as in a decoding step,
where each launch reads another weight), microseconds per launch, the median of a few replays.
Candidates compile in parallel (--jobs threads, Triton's AsyncCompileMode) before they are timed.
--steps times the whole decoding step (CUDA graph replay, tokens/s) at those batch sizes with the
shipped table and, after a sweep, with the swept one. --emit-table writes the table module; the
table also prints, ready to paste.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
import triton

from bench.timing import require_cuda
from flame.ops import squared_relu_mlp
from flame.ops.decode_matmul import Segment, decode_matmul
from flame.ops.decode_matmul import decode_matmul_triton as kernel_module
from flame.ops.decode_matmul.decode_matmul import decode_matmul_torch

C, RANK, FFN = 1024, 160, 4096


def _w(*shape, device):
    return (torch.randn(*shape, device=device) / shape[-1] ** 0.5).to(torch.bfloat16)


def _norm_params(device):
    """A norm's weight and bias in bf16, as a bf16 model holds them (so the PyTorch norms return bf16)."""
    return (torch.ones(C, device=device, dtype=torch.bfloat16), torch.zeros(C, device=device, dtype=torch.bfloat16))


def case_rwkv7_in(B, device):
    x, prev, h = (torch.randn(B, C, device=device, dtype=torch.bfloat16) for _ in range(3))
    ln_w, ln_b = _norm_params(device)
    mu = torch.rand(6, C, device=device, dtype=torch.bfloat16)
    rkv, lora_in = _w(3, C, C, device=device), _w(4, C, RANK, device=device)
    attn_in = torch.cat([rkv.flatten(0, 1), lora_in.transpose(1, 2).flatten(0, 1)])
    segments = (Segment(C, 0), Segment(C, 1), Segment(C, 2), Segment(RANK, 2), Segment(RANK, 3),
                Segment(RANK, 4, "tanh"), Segment(RANK, 5, "sigmoid"))

    def composed():
        normed = F.layer_norm(x, (C,), ln_w, ln_b, 1e-5)
        lerps = torch.addcmul(normed, prev - normed, mu[:, None])
        prev.copy_(normed)
        torch.bmm(lerps[0:3], rkv.transpose(1, 2))
        hidden = torch.bmm(lerps[2:6], lora_in)
        hidden[2].tanh_()
        hidden[3].sigmoid_()

    def fused():
        decode_matmul(x, attn_in, segments, norm="layer", norm_weight=ln_w, norm_bias=ln_b, eps=1e-5, previous=prev,
                      mu=mu, h_out=h)
    return composed, fused, attn_in.numel() * 2


def case_lora_out(B, device):
    hidden = torch.randn(4, B, RANK, device=device, dtype=torch.bfloat16)
    lora_out = _w(4, RANK, C, device=device)
    flat = lora_out.transpose(1, 2).flatten(0, 1).contiguous()
    segments = tuple(Segment(C, i) for i in range(4))
    return (lambda: torch.bmm(hidden, lora_out)), (lambda: decode_matmul(hidden, flat, segments)), flat.numel() * 2


def case_ffn(B, device):
    x, prev, h, add = (torch.randn(B, C, device=device, dtype=torch.bfloat16) for _ in range(4))
    ln_w, ln_b = _norm_params(device)
    mu = torch.rand(1, C, device=device, dtype=torch.bfloat16)
    key, value = _w(FFN, C, device=device), _w(C, FFN, device=device)

    def composed():
        x.add_(add)
        normed = F.layer_norm(x, (C,), ln_w, ln_b, 1e-5)
        lerp = torch.addcmul(normed, prev - normed, mu[0])
        prev.copy_(normed)
        squared_relu_mlp(lerp, key, value, backend="torch")

    def fused():
        k = decode_matmul(x, key, (Segment(FFN, 0, "sqrelu"),), norm="layer", norm_weight=ln_w, norm_bias=ln_b,
                          eps=1e-5, previous=prev, mu=mu, h_out=h)
        decode_matmul(k[None], value, residual=x, commit=(h, prev))
    return composed, fused, (key.numel() + value.numel()) * 2


def case_out_residual(B, device):
    x, y, h, prev = (torch.randn(B, C, device=device, dtype=torch.bfloat16) for _ in range(4))
    out = _w(C, C, device=device)
    return (lambda: x.add_(F.linear(y, out))), (lambda: decode_matmul(y[None], out, residual=x, commit=(h, prev))), \
        out.numel() * 2


def case_gsa_mlp(B, device):
    width = 2816
    x = torch.randn(B, C, device=device, dtype=torch.bfloat16)
    rms_w, _ = _norm_params(device)
    gate_up, down = _w(2 * width, C, device=device), _w(C, width, device=device)

    def composed():
        h = F.rms_norm(x, (C,), rms_w, 1e-6)
        gate, up = F.linear(h, gate_up).chunk(2, dim=1)
        x.add_(F.linear(F.silu(gate) * up, down))

    def fused():
        hidden = decode_matmul(x, gate_up, (Segment(width, 0, "swiglu"),), norm="rms", norm_weight=rms_w, eps=1e-6)
        decode_matmul(hidden[None], down, residual=x)
    return composed, fused, (gate_up.numel() + down.numel()) * 2


def gemv_case(N, K):
    def build(B, device):
        x = torch.randn(1, B, K, device=device, dtype=torch.bfloat16)
        w = _w(N, K, device=device)
        return (lambda: F.linear(x[0], w)), (lambda: decode_matmul(x, w)), w.numel() * 2
    return build


CASES = {"rwkv7_in": case_rwkv7_in, "lora_out": case_lora_out, "ffn": case_ffn, "out_residual": case_out_residual,
         "gsa_mlp": case_gsa_mlp, "gemv_1024x1024": gemv_case(1024, 1024), "gemv_4096x1024": gemv_case(4096, 1024),
         "gemv_1024x4096": gemv_case(1024, 4096)}


# ---- sweep of the launch configurations ------------------------------------------------------

FAMILIES = ("rwkv7", "rwkv6", "gsa")
SWEEP_BATCH_SIZES = "1,2,4,8,16,32,64,128,256"
L2_DEFEAT_BYTES = 160 * 2**20  # the weight copies of one timing together: several times an H100's L2


def build_model(family: str, device, tiny: bool):
    """The 340M model of `family` (bench.generate's configs; --tiny: its CPU smoke size), random
    init, bf16 on CUDA, fp32 on CPU with the Triton backend (the interpreter)."""
    import dataclasses

    from bench.generate import initialized_model, model_args

    args = model_args(family, tiny)
    if device.type != "cuda":
        args = dataclasses.replace(args, backend="triton")
    return initialized_model(args, device).to(torch.bfloat16 if device.type == "cuda" else torch.float32).eval()


def record_launches(models: dict, B: int) -> dict:
    """{(N, K): (families, args)}: the decode_matmul launches of one decoding step of each model at
    B rows, the first launch of each (N, K) with its arguments (decode_matmul_triton's positional
    ones); the step itself runs through the PyTorch form."""
    from flame.inference.decoder import Decoder

    launches: dict = {}
    family = None

    def record(*args):
        N, K = sum(seg.width for seg in args[2]), args[0].shape[-1]
        families, _ = launches.setdefault((N, K), ([], args))
        if family not in families:
            families.append(family)
        return decode_matmul_torch(*args)

    real = kernel_module.decode_matmul_triton
    kernel_module.decode_matmul_triton = record
    try:
        for family, model in models.items():
            with torch.no_grad():
                Decoder(model, B, graph=False).step()
    finally:
        kernel_module.decode_matmul_triton = real
    return launches


def config(dot, bb, bn, bk, warps=4, stages=2) -> dict:
    return dict(DOT=dot, BB=bb, BN=bn, BK=bk, num_warps=warps, num_stages=stages)


def block_candidates(B: int, N: int, K: int) -> list[dict]:
    """First round: block sizes. The GEMV up to 16 rows (BB the rows' power of two, BN 1-64,
    BK 64-4096, 1K to 16K products per step: down to one program per output column, with the whole
    of K in one block), tl.dot from 2 rows (BB 16-64 but at most one padded power of two, BN
    16-128, BK 64-256, at most 64 KB of operands per stage)."""
    pow2 = triton.next_power_of_2
    rows, cols, bk_max = pow2(B), max(8, pow2(N)), max(16, pow2(K))
    found = []
    if B <= 16:
        for bn in (1, 2, 4, 8, 16, 32, 64):
            for bk in (64, 128, 256, 512, 1024, 2048, 4096):
                bk = min(bk, bk_max)
                if bn <= cols and 1024 <= rows * bn * bk <= 16384:
                    found.append(config(False, rows, bn, bk))
    if B >= 2:
        for bb in (16, 32, 64):
            for bn in (16, 32, 64, 128):
                for bk in (64, 128, 256):
                    if bb <= max(16, rows) and bn <= max(16, cols) and bb * bn <= 8192 \
                            and (bb + bn) * bk * 2 <= 65536:
                        found.append(config(True, bb, bn, max(16, min(bk, bk_max))))
    unique = []
    for cfg in found:
        if cfg not in unique:
            unique.append(cfg)
    return unique


def launch_candidates(best: dict) -> list[dict]:
    """Second round: warps 2/4/8 x stages 1-4 around the best block sizes."""
    return [{**best, "num_warps": w, "num_stages": st} for w in (2, 4, 8) for st in (1, 2, 3, 4)
            if (w, st) != (best["num_warps"], best["num_stages"])]


def plain_args(B: int, N: int, K: int, device) -> tuple:
    """decode_matmul_triton's arguments of the plain product x [1, B, K] @ W [N, K]^T."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(1, B, K, device=device, dtype=dtype)
    return (x, _w(N, K, device=device).to(dtype), (Segment(N),), None, None, None, 1e-5, False, None, None, None,
            None, None, None, None)


def weight_copies(args: tuple, max_copies: int) -> list[tuple]:
    """`args` with distinct copies of the weight (the first is the original), enough to read
    L2_DEFEAT_BYTES in all, at most `max_copies`."""
    weight = args[1]
    copies = max(1, min(max_copies, math.ceil(L2_DEFEAT_BYTES / (weight.numel() * weight.element_size()))))
    return [args] + [(args[0], args[1].clone(), *args[2:]) for _ in range(copies - 1)]


def time_launches(launches: list, device, reps: int = 5) -> float:
    """Microseconds per launch of the callables `launches`, run in turn: on CUDA a graph of
    (about 128 launches) replayed `reps` times, the median; on CPU (the interpreter, a smoke run)
    the wall time of one pass."""
    for launch in launches:
        launch()
    if device.type != "cuda":
        start = time.perf_counter()
        for launch in launches:
            launch()
        return (time.perf_counter() - start) * 1e6 / len(launches)
    rounds = max(1, 128 // len(launches))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for launch in launches:
                launch()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (rounds * len(launches)))
    del graph
    return statistics.median(times)


def time_config(arg_sets: list[tuple], cfg: dict, device) -> float:
    """Microseconds per launch of the kernel with `cfg` over the argument sets; inf when the
    configuration does not launch (out of shared memory or registers)."""
    try:
        return time_launches([lambda a=a: kernel_module.decode_matmul_triton(*a, config=cfg) for a in arg_sets],
                             device)
    except Exception as exc:  # a configuration the GPU cannot run
        print(f"  skipped {cfg}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}", flush=True)
        return math.inf


def compile_all(jobs: list[tuple[tuple, dict]], threads: int, device) -> None:
    """Compile the kernel for every (args, config) of `jobs` without running it, on `threads`
    threads (Triton's AsyncCompileMode; sequentially without it or under the interpreter)."""
    if device.type != "cuda" or not jobs:
        return
    warm = lambda args, cfg: kernel_module.decode_matmul_triton(*args, config=cfg, warmup=True)  # noqa: E731
    async_mode = getattr(triton, "AsyncCompileMode", None)
    if async_mode is None or threads <= 1:
        for args, cfg in jobs:
            try:
                warm(args, cfg)
            except Exception:  # reported when the configuration is timed
                pass
        return
    with ThreadPoolExecutor(threads) as pool, async_mode(pool, ignore_errors=True):
        for args, cfg in jobs:
            warm(args, cfg)


def sweep(models: dict, batch_sizes: list[int], device, threads: int, refine_top: int, max_copies: int) -> list[dict]:
    """One row per (B, N, K): the best configuration, its time on the plain and on the recorded
    launch, cuBLAS F.linear's time, the weight's bytes (module docstring)."""
    rows = []
    begin = time.perf_counter()
    for B in batch_sizes:
        launches = record_launches(models, B)
        shapes = sorted(launches)
        sets = {}
        for N, K in shapes:
            sets[N, K] = weight_copies(plain_args(B, N, K, device), max_copies)
        first = {shape: block_candidates(B, *shape) for shape in shapes}
        compile_all([(sets[s][0], cfg) for s in shapes for cfg in first[s]], threads, device)
        timed = {s: [(time_config(sets[s], cfg, device), cfg) for cfg in first[s]] for s in shapes}
        second = {s: launch_candidates(min(timed[s], key=lambda tc: tc[0])[1]) for s in shapes}
        compile_all([(sets[s][0], cfg) for s in shapes for cfg in second[s]], threads, device)
        for s in shapes:
            timed[s] += [(time_config(sets[s], cfg, device), cfg) for cfg in second[s]]
            timed[s].sort(key=lambda tc: tc[0])
        real = {}
        for s in shapes:
            real[s] = weight_copies(launches[s][1], max_copies)
        top = {s: [cfg for _, cfg in timed[s][:max(1, refine_top)]] for s in shapes}
        compile_all([(real[s][0], cfg) for s in shapes for cfg in top[s]], threads, device)
        for N, K in shapes:
            s = (N, K)
            fused, cfg = min((time_config(real[s], c, device), c) for c in top[s]) if len(top[s]) > 1 else \
                (time_config(real[s], top[s][0], device), top[s][0])
            x = sets[s][0][0][0]
            cublas = time_launches([lambda a=a: F.linear(x, a[1]) for a in sets[s]], device)
            weight = launches[s][1][1]
            nbytes = weight.numel() * weight.element_size()
            row = dict(B=B, N=N, K=K, families=launches[s][0], config=cfg, plain_us=timed[s][0][0],
                       fused_us=fused, cublas_us=cublas, weight_bytes=nbytes,
                       fused_gb_s=nbytes / fused / 1e3 if fused > 0 else 0.0, candidates=len(timed[s]))
            rows.append(row)
            print(format_row(row), flush=True)
        print(f"# batch {B} done, {time.perf_counter() - begin:.0f} s", flush=True)
        del launches, sets, real
    return rows


SWEEP_HEADER = (f"{'B':>4} {'N':>5} {'K':>5} {'dot':>4} {'BB':>3} {'BN':>4} {'BK':>4} {'w':>2} {'st':>2} "
                f"{'plain':>7} {'fused':>7} {'cuBLAS':>7} {'GB/s':>6}  families")


def format_row(row: dict) -> str:
    c = row["config"]
    return (f"{row['B']:>4} {row['N']:>5} {row['K']:>5} {'y' if c['DOT'] else 'n':>4} {c['BB']:>3} {c['BN']:>4} "
            f"{c['BK']:>4} {c['num_warps']:>2} {c['num_stages']:>2} {row['plain_us']:>7.1f} {row['fused_us']:>7.1f} "
            f"{row['cublas_us']:>7.1f} {row['fused_gb_s']:>6.0f}  {','.join(row['families'])}")


def table_of(rows: list[dict]) -> dict:
    return {(kernel_module.batch_bucket(r["B"]), r["N"], r["K"]): r["config"] for r in rows}


def table_source(table: dict) -> str:
    """The decode_matmul_tuning module holding `table`."""
    doc = kernel_module_tuning_doc()
    lines = [doc, "", "TABLE: dict[tuple[int, int, int], dict] = {"]
    for key in sorted(table):
        c = table[key]
        lines.append(f"    {key}: {{\"DOT\": {c['DOT']}, \"BB\": {c['BB']}, \"BN\": {c['BN']}, \"BK\": {c['BK']}, "
                     f"\"num_warps\": {c['num_warps']}, \"num_stages\": {c['num_stages']}}},")
    lines.append("}")
    return "\n".join(lines) + "\n"


def kernel_module_tuning_doc() -> str:
    from flame.ops.decode_matmul import decode_matmul_tuning

    return '"""' + decode_matmul_tuning.__doc__ + '"""'


def install_table(table: dict) -> None:
    """Make `launch_config` read `table` in this process (checked as the shipped one is)."""
    kernel_module.check_table(table)
    kernel_module.TABLE = table
    kernel_module._checked_table.cache_clear()


def step_rates(models: dict, batch_sizes: list[int], device, steps: int = 50) -> dict:
    """{(family, B): (ms per step, tokens/s)} of the whole decoding step replayed as a CUDA graph
    (flame.inference.decoder.Decoder) with the table `launch_config` reads now."""
    from flame.inference.decoder import Decoder

    rates = {}
    for family, model in models.items():
        for B in batch_sizes:
            decoder = Decoder(model, B)
            for _ in range(3):
                decoder.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                decoder.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            ms = (time.perf_counter() - start) * 1e3 / steps
            rates[family, B] = (ms, B * 1e3 / ms)
            del decoder
    return rates


def slower_buckets(before: dict, after: dict) -> set[int]:
    """The batch buckets whose decoding steps (`step_rates` of every family at those batch sizes)
    take longer in all with the swept table (`after`) than with the shipped one (`before`): an
    entry timed alone can lose in the step, where launches of other shapes run between its own."""
    totals: dict[int, list[float]] = {}
    for (family, B), (ms, _) in after.items():
        pair = totals.setdefault(kernel_module.batch_bucket(B), [0.0, 0.0])
        pair[0] += before[family, B][0]
        pair[1] += ms
    return {bucket for bucket, (shipped_ms, swept_ms) in totals.items() if swept_ms > shipped_ms}


def run_sweep(args) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not args.tiny:
        require_cuda("bench.decode_matmul --sweep", "on CPU only --tiny runs (a smoke run through the interpreter)")
    families = args.families.split(",")
    unknown = set(families) - set(FAMILIES)
    if unknown:
        raise SystemExit(f"--families: unknown {sorted(unknown)}; expected some of {FAMILIES}")
    models = {family: build_model(family, device, args.tiny) for family in families}
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (Triton interpreter)"
    print(f"# {name}, torch {torch.__version__}, triton {triton.__version__}; "
          f"microseconds per launch, CUDA graph of launches over weight copies (median)", flush=True)
    steps = [int(b) for b in args.steps.split(",")] if args.steps else []
    before = step_rates(models, steps, device) if steps else {}
    result = {"device": name, "torch": torch.__version__, "triton": triton.__version__}
    if args.sweep:
        begin = time.perf_counter()
        print(SWEEP_HEADER, flush=True)
        swept_sizes = [int(b) for b in args.sweep_batch_sizes.split(",")]
        rows = sweep(models, swept_sizes, device, args.jobs, args.refine_top, args.weight_copies)
        shipped = dict(kernel_module._checked_table())
        swept_buckets = {kernel_module.batch_bucket(B) for B in swept_sizes}
        table = {key: config for key, config in shipped.items() if key[0] not in swept_buckets}
        table.update(table_of(rows))
        install_table(table)
        after = step_rates(models, steps, device) if steps else {}
        kept = slower_buckets(before, after)
        if kept:
            table = {key: config for key, config in table.items() if key[0] not in kept}
            table.update({key: config for key, config in shipped.items() if key[0] in kept})
            install_table(table)
            print(f"# batch buckets {sorted(kept)}: the whole step is slower with the swept entries; "
                  f"the table keeps the shipped ones")
        source = table_source(table)
        print(f"# sweep: {time.perf_counter() - begin:.0f} s; the table (decode_matmul_tuning.py):\n{source}")
        result.update(rows=rows, table=[[list(k), v] for k, v in sorted(table.items())], kept_buckets=sorted(kept))
        if args.emit_table:
            with open(args.emit_table, "w") as f:
                f.write(source)
            print(f"# wrote {args.emit_table}")
    else:
        after = {}
    if steps:
        swept = f" {'swept ms':>9} {'tok/s':>9}" if after else ""
        print(f"{'family':<7} {'B':>4} {'shipped ms':>11} {'tok/s':>9}{swept}")
        for key, (ms, rate) in before.items():
            line = f"{key[0]:<7} {key[1]:>4} {ms:>11.3f} {rate:>9.0f}"
            if after:
                line += f" {after[key][0]:>9.3f} {after[key][1]:>9.0f}"
            print(line)
        result["steps"] = [dict(family=f, B=b, shipped_ms=before[f, b][0], shipped_tok_s=before[f, b][1],
                                **({"swept_ms": after[f, b][0], "swept_tok_s": after[f, b][1]} if after else {}))
                           for f, b in before]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="1,8,64")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--sweep", action="store_true", help="sweep the launch configurations (module docstring)")
    parser.add_argument("--sweep-batch-sizes", default=SWEEP_BATCH_SIZES)
    parser.add_argument("--families", default=",".join(FAMILIES), help="the 340M models whose launches are swept")
    parser.add_argument("--steps", default="", help="batch sizes at which to time the whole decoding step")
    parser.add_argument("--refine-top", type=int, default=1,
                        help="how many of the best plain-kernel configurations to time on the recorded launch")
    parser.add_argument("--weight-copies", type=int, default=32, help="at most this many weight copies per timing")
    parser.add_argument("--jobs", type=int, default=16, help="threads that compile the candidates")
    parser.add_argument("--out", help="write the sweep's rows, table and step times as JSON")
    parser.add_argument("--emit-table", help="write the swept table as the decode_matmul_tuning module to this file")
    parser.add_argument("--tiny", action="store_true", help="the tiny models (a CPU smoke run of --sweep)")
    args = parser.parse_args(argv)
    if args.sweep or args.steps:
        run_sweep(args)
        return
    require_cuda("bench.decode_matmul")
    from triton.testing import do_bench

    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16; microseconds per call (median)")
    print(f"{'case':<16} {'B':>4} {'composed':>10} {'fused':>10} {'ratio':>6} {'fused weight GB/s':>18}")
    for name in args.cases.split(","):
        for B in (int(b) for b in args.batch_sizes.split(",")):
            torch.manual_seed(0)
            composed, fused, weight_bytes = CASES[name](B, device)
            with torch.no_grad():
                t_comp = do_bench(composed, return_mode="median") * 1e3
                t_fused = do_bench(fused, return_mode="median") * 1e3
            print(f"{name:<16} {B:>4} {t_comp:>10.1f} {t_fused:>10.1f} {t_fused / t_comp:>6.2f} "
                  f"{weight_bytes / t_fused / 1e3:>18.0f}")


if __name__ == "__main__":
    main()
