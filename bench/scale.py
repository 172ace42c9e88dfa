"""Data-parallel scaling of `python -m flame.train`: per-GPU tokens/s on P GPUs against the one-GPU
path of the same config, in the same invocation, with peak memory, where the step's time goes, a
preempt-and-resume on P GPUs, and a model of larger clusters.

    python -m bench.scale --configs configs/rwkv7_340M.toml[,configs/rwkv7_1B.toml,...] --nproc 2
        [--runs single,replicate,fsdp] [--steps 30] [--warmup 10] [--profile] [--out DIR]
        [--device cuda|cpu] [--section.key value ...]

Every run launches `launch/train.sh` as a user would (torchrun, the stop signals forwarded to every
rank), logs every step and keeps the config's per-GPU batch (batch_size x seq_len x GA), so the
per-GPU work is the same in every run and the global batch grows with the GPUs. The runs:

  single          1 GPU: the one-GPU path (the baseline of every ratio)
  replicate       P GPUs, a replica on each (parallel.data_parallel_shard_degree = 1)
  fsdp            P GPUs, FSDP over P (parallel.data_parallel_shard_degree = P)
  hsdp            P GPUs, 2 replicas of FSDP over P/2 (P >= 4)
  nodes           2 "nodes" of P/2 GPUs each on this host (two launch/train.sh with NNODE=2,
                  NODE_RANK=0|1, the GPUs split by CUDA_VISIBLE_DEVICES, rendezvous on
                  localhost), flame's default choice of data parallelism
  nodes_fsdp      the same two nodes, FSDP over P
  preempt         the replicate run again with checkpoints, sent SIGUSR1 (to torchrun) once half of
                  its steps are logged: every rank must save the same step and exit; the same
                  command again resumes, and the losses of every step (before the stop and after
                  the resume) must equal the replicate run's, bitwise

Throughput = median of metrics.jsonl's tokens_per_s_per_device over the steps after --warmup (the
profiled steps left out); peak memory = the largest memory_gib (rank 0). With --profile each
throughput run also traces its last two steps ([profiling]), and the table gives per step: GPU
busy, compute and communication kernel time, exposed communication (collective time with no
compute kernel running beside it) and host-bound time (step time minus GPU busy). From a replicate
run's trace the tool also models 8 and 64 GPUs: see `cluster_model`.

Data: the embedded corpus and tokenizer, the config's model (vocab_size included: the tokenizer's
8192 ids fit a padded 32000 vocabulary). The table goes to stdout and <out>/scale.md, every number
to <out>/summary.json. The launching and the preempt check are bench.launcher's (NVLink multicast
stays off in every run).
Exit status: 0 when every run finished and the preempt check passed.
"""

from __future__ import annotations

import datetime
import json
import shlex
import signal
import statistics
import sys
import time
from pathlib import Path

from bench.launcher import (RunError, data_parallel_kind, device_name, launch, nproc_problems, pick,
                            preempt_and_resume, stop_on_sigterm, tail, tool_parser, trainer_keys)
from bench.metrics import read_metrics
from bench.timing import require_cuda, versions
from flame.run_metrics import MetricsFileError

RUNS = ("single", "replicate", "fsdp", "hsdp", "nodes", "nodes_fsdp", "preempt")
PROFILED_STEPS = 2


def run_keys(args, config: str, run: str, dump: Path) -> list[str]:
    """The trainer's arguments of one run."""
    shard = {"replicate": 1, "preempt": 1, "fsdp": args.nproc, "nodes_fsdp": args.nproc,
             "hsdp": args.nproc // 2}.get(run, -1)
    keys = [*trainer_keys(config, dump, args.steps, args.device, args.overrides),
            "--parallel.data_parallel_shard_degree", str(shard),
            "--parallel.data_parallel_replicate_degree", "2" if run == "hsdp" else "1",
            "--checkpoint.enable", "true" if run == "preempt" else "false",
            "--checkpoint.interval", str(args.steps), "--checkpoint.keep_latest_k", "0"]
    if args.profile and run != "preempt":
        keys += ["--profiling.enable", "true", "--profiling.steps", str(PROFILED_STEPS),
                 "--profiling.start_step", str(args.steps - PROFILED_STEPS + 1)]
    return keys


# ---- reading a run -----------------------------------------------------------------------------

def throughput(args, dump: Path) -> dict:
    """Median tokens/s per GPU after the warm-up (profiled steps left out), peak memory, losses."""
    records = read_metrics(dump / "metrics.jsonl")
    if [r["step"] for r in records] != list(range(1, args.steps + 1)):
        raise RunError(f"{dump}/metrics.jsonl does not log steps 1..{args.steps}")
    last_timed = args.steps - (PROFILED_STEPS + 1 if args.profile else 0)
    timed = [r for r in records if args.warmup < r["step"] <= last_timed]
    if not timed:
        raise RunError(f"no step between --warmup {args.warmup} and the profiled steps: raise --steps")
    return {
        "tokens_per_s_per_gpu": statistics.median(r["tokens_per_s_per_device"] for r in timed),
        "step_time_s": statistics.median(r["step_time_s"] for r in timed),
        "peak_memory_gib": max((r.get("memory_gib", 0.0) for r in records), default=0.0) or None,
        "losses": {r["step"]: r["loss"] for r in records},
    }


def trace_breakdown(trace: Path, step_time_s: float) -> dict:
    """Per-step GPU time of a Chrome trace (torch.profiler's) of a run whose steps take
    `step_time_s`: busy (any kernel), compute (non-collective kernels), communication (NCCL kernels),
    exposed communication (NCCL time with no compute kernel beside it), and the bytes the
    all-reduces moved. The trace's window need not hold whole steps (the loop queues a step's
    forward before the previous step is read): each total is scaled by the step time over the
    window, from the first kernel's start to the last kernel's end."""
    events = json.loads(trace.read_text())["traceEvents"]
    compute, comm, reduced = [], [], 0
    for e in events:
        if e.get("ph") != "X" or e.get("cat") != "kernel":
            continue
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        if "nccl" in e["name"].lower():
            comm.append(span)
        else:
            compute.append(span)
    for e in events:  # the host-side records of the collectives carry their message sizes
        a = e.get("args", {})
        if e.get("ph") == "X" and e.get("name") == "record_param_comms" and \
                str(a.get("Collective name", "")).replace("_", "") == "allreduce":
            reduced += int(a.get("In msg nelems", 0)) * _dtype_bytes(a.get("dtype", "Float"))
    kernels = compute + comm
    if not kernels:
        raise RunError(f"{trace} holds no GPU kernel")
    window_us = max(stop for _, stop in kernels) - min(start for start, _ in kernels)
    scale = step_time_s * 1e6 / window_us  # one step's share of the window's totals
    busy_ms = union_us(kernels) * scale / 1e3
    compute_ms = union_us(compute) * scale / 1e3
    return {"gpu_busy_ms": busy_ms, "compute_ms": compute_ms, "comm_ms": union_us(comm) * scale / 1e3,
            "exposed_comm_ms": busy_ms - compute_ms, "all_reduce_bytes": int(reduced * scale)}


def _dtype_bytes(name: str) -> int:
    return {"Float": 4, "BFloat16": 2, "Half": 2, "Double": 8, "Long": 8, "Int": 4}.get(str(name), 4)


def union_us(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


# ---- the runs ----------------------------------------------------------------------------------

def run_throughput(args, config: str, run: str, out: Path) -> dict:
    dump = out / run
    log = out / f"{run}.log"
    gpus = 1 if run == "single" else args.nproc
    nodes = 2 if run.startswith("nodes") else 1
    codes = launch(run_keys(args, config, run, dump), log, gpus, device=args.device, timeout=args.timeout,
                   nodes=nodes).codes
    if any(codes):
        raise RunError(f"{run} exited with {codes}; log {log}:\n{tail(log)}")
    result = throughput(args, dump)
    result["gpus"] = gpus
    result["data_parallel"] = data_parallel_kind(log.read_text(errors="replace"))
    trace = dump / "profile" / "rank0.json"
    if args.profile and trace.is_file():
        result.update(trace_breakdown(trace, result["step_time_s"]))
        result["host_bound_ms"] = result["step_time_s"] * 1e3 - result["gpu_busy_ms"]
    return result


def run_preempt(args, config: str, out: Path, reference: dict) -> dict:
    """`preempt_and_resume` on P GPUs, against the uninterrupted replicate run."""
    dump = out / "preempt"
    return preempt_and_resume(run_keys(args, config, "preempt", dump), dump, out / "preempt.log", args.nproc,
                              {int(step): loss for step, loss in reference["losses"].items()},  # JSON: str keys
                              device=args.device, timeout=args.timeout)


def cluster_model(compute_ms: float, grad_bytes: int, busbw_gbs: float, gpus: int,
                  backward_fraction: float, ga: int) -> dict:
    """A replicated step on `gpus` GPUs, on paper: a ring all-reduce of the step's gradients
    (`grad_bytes`) moves 2 (N-1)/N of them through each GPU's link at the bus bandwidth
    `busbw_gbs`; it overlaps the last micro-batch's backward (`backward_fraction` of a micro-batch's
    compute, 1/ga of the step's compute) and what does not fit is exposed. Efficiency = compute /
    (compute + exposed)."""
    comm_ms = 2 * (gpus - 1) / gpus * grad_bytes / (busbw_gbs * 1e9) * 1e3
    hidden_ms = backward_fraction * compute_ms / ga
    exposed_ms = max(0.0, comm_ms - hidden_ms)
    return {"gpus": gpus, "busbw_gbs": busbw_gbs, "all_reduce_ms": comm_ms, "exposed_ms": exposed_ms,
            "efficiency": compute_ms / (compute_ms + exposed_ms)}


# ---- the report --------------------------------------------------------------------------------

def fmt(value, pattern="{:,.1f}") -> str:
    return "—" if value is None else pattern.format(value)


def table(results: dict) -> str:
    lines = ["| config | run | GPUs | data parallel | tok/s/GPU | x 1 GPU | peak GiB/GPU | step ms | "
             "GPU busy ms | compute ms | comm ms | exposed comm ms | host-bound ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, runs in results.items():
        base = runs.get("single", {}).get("tokens_per_s_per_gpu")
        for run, r in runs.items():
            if run == "preempt" or run == "model":
                continue
            if "error" in r:
                lines.append(f"| {name} | {run} | | FAILED: {r['error'].splitlines()[0][:160]} |" + " |" * 9)
                continue
            ratio = r["tokens_per_s_per_gpu"] / base if base else None
            lines.append(
                f"| {name} | {run} | {r['gpus']} | {r['data_parallel']} | {r['tokens_per_s_per_gpu']:,.0f} | "
                f"{fmt(ratio, '{:.3f}')} | {fmt(r['peak_memory_gib'])} | {r['step_time_s'] * 1e3:,.1f} | "
                f"{fmt(r.get('gpu_busy_ms'))} | {fmt(r.get('compute_ms'))} | {fmt(r.get('comm_ms'))} | "
                f"{fmt(r.get('exposed_comm_ms'))} | {fmt(r.get('host_bound_ms'))} |")
    for name, runs in results.items():
        p = runs.get("preempt")
        if p and "error" not in p and p["compared_steps"]:
            lines.append(f"\n{name} preempt on {p['gpus']} GPUs: SIGUSR1 once step {p['signalled_after_step']} was "
                         f"logged -> checkpoint at step {p['stopped_at_step']}, exit codes {p['exit_codes']}; the losses "
                         f"of all {p['compared_steps']} steps, before the stop and after the resume: max |diff| "
                         f"{p['max_abs_loss_diff']:.3g} "
                         f"against the uninterrupted replicate run ({'bitwise' if p['passed'] else 'NOT equal'})"
                         + "".join(f"; {problem}" for problem in p["problems"]))
        elif p and "error" not in p:
            lines.append(f"\n{name} preempt: FAILED: {'; '.join(p['problems'])[:300]}")
        elif p:
            lines.append(f"\n{name} preempt: FAILED: {p['error'].splitlines()[0][:300]}")
        for m in runs.get("model", []):
            lines.append(f"{name} on {m['gpus']} GPUs, modelled: all-reduce {m['all_reduce_ms']:.1f} ms at "
                         f"{m['busbw_gbs']:.0f} GB/s bus bandwidth, exposed {m['exposed_ms']:.1f} ms, "
                         f"efficiency {m['efficiency']:.3f}")
    return "\n".join(lines)


def parse_args(argv):
    parser = tool_parser(__doc__, nproc=2, steps=30, out="outputs/scale", timeout=900)
    parser.add_argument("--configs", required=True, help="comma-separated job TOMLs")
    parser.add_argument("--runs", default="single,replicate,fsdp", help=f"comma-separated of {','.join(RUNS)}")
    parser.add_argument("--warmup", type=int, default=10, help="first steps left out of the medians")
    parser.add_argument("--profile", action="store_true", help="trace the last 2 steps of each run")
    parser.add_argument("--internode-busbw", type=float, default=45.0,
                        help="all-reduce bus bandwidth (GB/s) between nodes for the 64-GPU model")
    args, overrides = parser.parse_known_args(argv)
    args.overrides = overrides
    args.runs, problems = pick("--runs", args.runs, RUNS)
    problems += nproc_problems(args.nproc)
    if "hsdp" in args.runs and args.nproc < 4:
        problems.append("hsdp needs --nproc >= 4 (2 replicas of FSDP over P/2)")
    if not 0 <= args.warmup < args.steps - (PROFILED_STEPS + 1 if args.profile else 0):
        problems.append("--warmup must leave timed steps before the profiled ones: raise --steps")
    if problems:
        parser.error("; ".join(problems))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.device == "cuda":
        require_cuda("bench.scale", "--device cpu runs the same runs on CPU processes")
    out_root = Path(args.out).resolve()
    out_root.mkdir(parents=True, exist_ok=True)
    summary_path = out_root / "summary.json"
    results = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    failed = False
    for config in args.configs.split(","):
        name = Path(config).stem
        runs = results.setdefault(name, {})
        out = out_root / name
        out.mkdir(exist_ok=True)
        for run in args.runs:
            print(f"== {name}: {run}", flush=True)
            started = time.monotonic()
            try:
                if run == "preempt":
                    if "tokens_per_s_per_gpu" not in runs.get("replicate", {}):
                        raise RunError("preempt compares with the replicate run: run it first")
                    runs[run] = run_preempt(args, config, out, runs["replicate"])
                    failed |= not runs[run]["passed"]
                else:
                    runs[run] = run_throughput(args, config, run, out)
            except (RunError, MetricsFileError) as err:
                print(f"{name} {run}: FAILED: {err}", file=sys.stderr, flush=True)
                runs[run] = {"error": str(err)}
                failed = True
            runs[run]["wall_s"] = round(time.monotonic() - started, 1)
            if run == "replicate":
                runs["model"] = model_clusters(args, config, runs)
            summary_path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    report = table(results)
    header = (f"bench/scale.py on {device_name(args.device)}, {datetime.date.today()}, "
              f"{versions()}: `python -m bench.scale {shlex.join(sys.argv[1:] if argv is None else argv)}`")
    (out_root / "scale.md").write_text(header + "\n\n" + report + "\n")
    print("\n" + header + "\n\n" + report)
    return 1 if failed else 0


def model_clusters(args, config: str, runs: dict) -> list[dict]:
    """`cluster_model` on P, 8 and 64 GPUs from the traced replicate and single runs (none without
    their traces): the bus bandwidth measured on P GPUs within a node, --internode-busbw between."""
    from flame.config import load_config

    rep, single = runs.get("replicate", {}), runs.get("single", {})
    if not (rep.get("all_reduce_bytes") and rep.get("comm_ms") and "compute_ms" in single):
        return []
    p = args.nproc
    busbw = rep["all_reduce_bytes"] * 2 * (p - 1) / p / (rep["comm_ms"] / 1e3) / 1e9
    ga = load_config(["--config", config, *args.overrides]).training.gradient_accumulation_steps
    return [cluster_model(single["compute_ms"], rep["all_reduce_bytes"], bw, n, 2 / 3, ga)
            for n, bw in ((p, busbw), (8, busbw), (64, args.internode_busbw))]


if __name__ == "__main__":
    sys.exit(main())
