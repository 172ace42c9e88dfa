"""Scaling of flame's training over P GPUs of one host (or P CPU processes with --device cpu):
FSDP and HSDP throughput, MFU, peak memory and scaling efficiency against one process, a resume
across a SIGKILL, and a model-only load at world size 1; one `torchrun -m flame.train` at a time.

    python bench/scale.py --config configs/rwkv7_1B.toml --nproc 8 [--steps 20]
        [--global-batch-tokens 524288] [--device cuda|cpu] [--out DIR] [--results FILE]
        [--runs fsdp,single,hsdp,resume,model_only] [--section.key value ...]

The runs, with P = --nproc, the config's per-GPU batch b and seq_len L, and
GA = round(global-batch-tokens / (b x L x P)):
  fsdp        P processes, FSDP over P (parallel.data_parallel_shard_degree = P), --steps S steps,
              checkpoints at S/2 and S; it is also the uninterrupted reference of `resume` and
              writes the checkpoint that `model_only` loads;
  single      1 process, the same per-GPU batch (b, L, GA): the scaling baseline;
  hsdp        P processes, replicate 2 x shard P/2 (P = 2: replicate 2 x shard 1);
  resume      the fsdp run again in its own folder, killed with SIGKILL (torchrun's process group
              and every rank's, at once) as soon as its step-S/2 checkpoint is COMPLETE, then
              relaunched with the same command: its losses at steps S/2+1..S must equal the fsdp
              run's (bitwise by default, --resume-tolerance to allow a difference);
  model_only  1 process started from the fsdp run's step-S/2 checkpoint with
              checkpoint.initial_load_path + initial_load_model_only. Its first loss (before any
              update) cannot be the fsdp run's loss at that point exactly: one data-parallel rank
              reads other batches than P ranks. It is compared instead with the untrained model's
              loss on the same batch (the single run's step 1: same seed, same init, same data)
              and must lie below it by at least half of what the fsdp run itself gained from
              step 1 to step S/2+1 (a load that did not happen shows no gain at all). The fsdp
              run's step-S/2+1 loss (the same weights on its own batch) is reported beside it;
              the fsdp run may have trained on the 1-process run's first batch (the same epoch
              order), so the loaded loss can be lower than that one.
Throughput = median over the logged steps after --warmup-steps of metrics.jsonl's
tokens_per_s_per_device and mfu (the step after a checkpoint save is left out: its time includes
the save), peak memory = the largest memory_gib (rank 0's torch.cuda.max_memory_allocated).
Scaling efficiency = tokens/s/GPU at P / tokens/s/GPU of `single`. The runs log every step
(metrics.log_freq 1), skip validation, and warm the LR up over S/5 steps so that S steps train
visibly. With --runs a subset can run in a later invocation on the same --out (resume and
model_only need the fsdp run of the same plan); <out>/summary.json keeps every run's numbers.

The script prints a markdown table and writes or updates its rows in --results (default
bench/RESULTS.md), with the command, the device, the date and the torch/triton versions.
Exit status: 0 when every run finished and the resume and model-only checks passed, else 1.

Data: by default the embedded corpus and tokenizer (--data.dataset embedded, --data.tokenizer "",
--model.vocab_size 8192, not streamed), so that machines without network access can run it;
--config-data keeps the config's [data] and vocabulary instead.

On a GPU machine without network access whose Python lacks torchtitan, datasets and wandb: copy
their wheels along (here into .whl/) and, from the repository root,
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && \
    timeout 570 python3 bench/scale.py --config configs/rwkv7_1B.toml --nproc 8 \
        --out /tmp/scale --results RESULTS.md --runs fsdp,single,hsdp
and, where one job may run 10 minutes at most, the same with --runs resume,model_only as a second
job on the same machine and --out (its results file then holds every row of the plan: summary.json
in --out keeps the first job's). On SIGTERM (as from `timeout`) the script kills its running ranks.
Keep --out on local disk with room: a 1B checkpoint with its optimizer state is ~15 GB.
NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 are set in
every run's environment (NVLink multicast stays off).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

from bench.metrics import MetricsError
from bench.scale_report import TABLE_HEADER, write_outputs
from bench.scale_runs import OWNED_KEYS, RUNS, ScaleError, device_description, make_plan, run_one
from bench.timing import versions

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, dict[str, str]]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n", 1)[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1] + "\nAny other --section.key value is passed to every run "
               "(it must not be one of the keys the script sets itself).")
    parser.add_argument("--config", required=True, help="job TOML, e.g. configs/rwkv7_1B.toml")
    parser.add_argument("--nproc", type=int, required=True, help="processes (GPUs) P, even, >= 2")
    parser.add_argument("--steps", type=int, default=20,
                        help="optimizer steps S of the fsdp, hsdp, single and resume runs (even)")
    parser.add_argument("--warmup-steps", type=int, default=5,
                        help="first logged steps left out of the throughput medians")
    parser.add_argument("--global-batch-tokens", type=int, default=524288,
                        help="target tokens per optimizer step at P processes")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", default="outputs/scale", help="run folders and summary.json")
    parser.add_argument("--results", default=str(ROOT / "bench" / "RESULTS.md"),
                        help="markdown file whose rows are written or updated")
    parser.add_argument("--runs", default=",".join(RUNS),
                        help=f"comma-separated subset of {','.join(RUNS)}")
    parser.add_argument("--resume-tolerance", type=float, default=0.0,
                        help="largest |loss difference| allowed after the resume (0: bitwise)")
    parser.add_argument("--timeout", type=float, default=1800,
                        help="seconds one run may take before it is killed")
    parser.add_argument("--config-data", action="store_true",
                        help="keep the config's [data] and vocab_size (default: embedded data)")
    args, extra = parser.parse_known_args(argv)
    from flame.config import ConfigError
    from flame.config.loader import parse_command_line

    try:
        command_line = parse_command_line(extra)
    except ConfigError as err:
        parser.error(str(err))
    if command_line.config is not None or command_line.help or command_line.print_config:
        parser.error("give --config once, to bench/scale.py; --help/--print-config are not passed on")
    owned = sorted(set(command_line.overrides) & set(OWNED_KEYS))
    if owned:
        parser.error(f"{', '.join('--' + k for k in owned)} is set by bench/scale.py for each run "
                     f"(use --steps, --global-batch-tokens, --nproc, --out)")
    return args, dict(command_line.overrides)


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(argv)
    try:
        plan = make_plan(args, extra)
        device = device_description(plan.device)
    except ScaleError as err:
        print(f"bench/scale.py: {err}", file=sys.stderr)
        return 2
    requested = {r.strip() for r in args.runs.split(",") if r.strip()}
    runs = [r for r in RUNS if r in requested]  # fsdp first: resume and model_only use it
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results = Path(args.results)
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    plan_record = json.loads(json.dumps(asdict(plan)))
    if summary.get("plan") != plan_record:  # another plan: nothing of the old one applies
        summary = {}
    elif "fsdp" in runs:  # a new fsdp run: the checks made against the old one are stale
        summary = {k: v for k, v in summary.items() if k not in ("resume", "model_only")}
    summary["plan"] = plan_record
    dependent = [r for r in runs if r in ("resume", "model_only")]
    if dependent and "fsdp" not in runs and "fsdp" not in summary:
        print(f"bench/scale.py: {', '.join(dependent)} need(s) the fsdp run of this plan, which "
              f"{summary_path} does not hold: add fsdp to --runs (or use the --out and the "
              f"arguments of the invocation that ran it)", file=sys.stderr)
        return 2

    measured = f"{datetime.date.today().isoformat()}, {device}, {versions()}"
    invocation = shlex.join(["python", "bench/scale.py", *(sys.argv[1:] if argv is None else argv)])
    print(f"bench/scale.py: {plan.name}, P = {plan.nproc}, per-GPU batch {plan.batch_size} x "
          f"seq_len {plan.seq_len} x GA {plan.grad_accum} -> global batch "
          f"{plan.global_batch_tokens:,} tokens at P; {plan.steps} steps; {device}", flush=True)
    previous_handler = signal.signal(signal.SIGTERM, stop_on_sigterm)
    try:
        for run in runs:
            started = time.monotonic()
            print(f"\n== {run} ({plan.label(run)}) ==", flush=True)
            try:
                result = run_one(run, plan, summary, out, args.timeout, args.resume_tolerance)
            except (ScaleError, MetricsError) as err:
                print(f"{run}: FAILED: {err}", file=sys.stderr, flush=True)
                world = plan.nproc if run in ("fsdp", "hsdp", "resume") else 1
                result = {"error": str(err), "world": world}
            result.update(measured=measured, invocation=invocation,
                          wall_s=round(time.monotonic() - started, 1))
            summary[run] = result
            rows = write_outputs(plan, summary, summary_path, results)  # after each run
    finally:
        signal.signal(signal.SIGTERM, previous_handler)

    print("\n" + TABLE_HEADER + "\n" + "\n".join(rows))
    print(f"\nrows written to {results}; details in {summary_path}")
    failed = [r for r in runs if "error" in summary[r] or summary[r].get("passed") is False]
    if failed:
        print(f"bench/scale.py: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def stop_on_sigterm(signum, frame):
    """`timeout` and job schedulers stop a job with SIGTERM: leave through the KeyboardInterrupt path
    of `launch`, which kills the running ranks (they live in sessions of their own)."""
    raise KeyboardInterrupt(f"signal {signum}")



if __name__ == "__main__":
    sys.exit(main())
