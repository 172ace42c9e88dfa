"""Proofs of data parallelism on P GPUs (CPU processes with --device cpu): HSDP over two "nodes"
against one rank, preempt-and-resume under FSDP and under replicas, a killed rank; each run
launched as a user launches flame (launch/train.sh, torchrun). PASS or FAIL per check; exit
status 0 only when every selected check passed.

    python -m bench.dp_proofs [--checks hsdp_nodes,preempt_fsdp,preempt_replicas,kill_rank]
        [--nproc 4] [--config configs/tiny.toml] [--steps 20] [--device cuda|cpu]
        [--collective-timeout-minutes 0.5] [--out outputs/dp_proofs] [--timeout 300]
        [--section.key value ...]

On a machine with 4 GPUs, each check is one command (or all four in one, the default):

    python -m bench.dp_proofs --checks hsdp_nodes
    python -m bench.dp_proofs --checks preempt_fsdp
    python -m bench.dp_proofs --checks preempt_replicas
    python -m bench.dp_proofs --checks kill_rank

On CPU processes (gloo): `--device cpu --nproc 2` (hsdp_nodes needs --nproc 4).

The checks:

  hsdp_nodes        HSDP, 2 replicas of FSDP over P/2 ranks, as two "nodes" of P/2 GPUs on this
                    host (two launch/train.sh with NNODE=2, NODE_RANK=0|1 and NGPU=P/2, the GPUs
                    split by CUDA_VISIBLE_DEVICES), against one rank with P times the config's
                    gradient accumulation: the same samples in every optimizer step (below). Each
                    step's token count must be equal, its loss and gradient norm equal within the
                    relative bounds FP32_BOUNDS (BF16_BOUNDS where the config computes in bf16 on
                    GPUs): tight at step 1, from the same weights; looser after it (below).
  preempt_fsdp      FSDP over P ranks: the uninterrupted run, then the same run with checkpoints
                    sent SIGUSR1 (to torchrun) once half its steps are logged. Every rank must stop
                    at the same step and write its part of that step's checkpoint, the only
                    COMPLETE one; the same command again resumes, and the losses of every step,
                    before the stop and after the resume, must equal the uninterrupted run's,
                    bitwise (two identical runs log the same numbers: issue 39's first item).
  preempt_replicas  the same with a replica of the model on each rank.
  kill_rank         replicas on two "nodes" of P/2 ranks, a checkpoint every steps/4 steps,
                    parallel.collective_timeout_minutes = --collective-timeout-minutes: once a
                    checkpoint is complete and two more steps are logged, the last rank (on node 1)
                    gets SIGKILL. Node 0's ranks, whom no launcher stops, must stop within the
                    timeout (plus STOP_GRACE_S), each with an error that names its rank and its last
                    step; node 1's torchrun must name the killed rank. The same command again must
                    resume from the last complete checkpoint and run to the end, and every step
                    logged both before the kill and after the resume must have the same loss, bitwise.

The same samples per optimizer step. flame.data.loader cuts the corpus into windows, permutes them
per epoch with a generator seeded by the job's seed and the epoch (not the rank), and rank r of W
reads permuted positions r, r + W, r + 2W, ...; each micro-batch is the rank's next batch_size of
them. So step s of W ranks with GA g and batch B reads positions [s W g B, (s + 1) W g B) between
them, and one rank with GA W g reads the same interval: the same samples in every step, grouped
into micro-batches otherwise (one rank's micro-batch holds consecutive positions, a rank's holds
every W-th). The step's loss is the sum of its tokens' cross-entropies over the step's token count
(flame.train.loss), so the grouping changes only the order of the sums. This holds within the
first epoch (per_rank = windows // W differs from the one rank's count after it); the runs read a
small part of one.

FP32_BOUNDS. Step 1 starts from the same weights on the same samples, so only the order of the
fp32 sums differs: loss and gradient norm within 1e-6 (a few ulps; configs/tiny.toml on 4 CPU
processes: 1.1e-7 and 3.7e-7). Its update leaves the weights that far apart, and AdamW turns a
gradient that close to zero into a whole step of either sign, so the runs drift apart step by step,
the gradient norm (a sum over components that such steps reach) faster than the loss: over 20
steps the same CPU runs differ by at most 3.3e-6 in the loss and 5.0e-3 in the norm. Every step's
bounds: loss 1e-4 (tests/train/test_two_gpus.py's REPLICA_TOLERANCES, fp32 sums in another order on
GPUs), gradient norm 2e-2. A sample that is not the same moves a step's loss by 1e-2 and more, and
a gradient summed where it should be averaged multiplies the norm by the rank count. BF16_BOUNDS
(2e-2 loss, 5e-2 norm at every step, tests/train/step_check.py's GPU_TOLERANCES): FSDP gathers
every parameter in bf16, where one rank keeps the vectors in fp32 (tests/train/test_two_gpus.py).

The runs: --config (configs/tiny.toml: a 2.6M-parameter RWKV7 with fp32 weights and compute and
compile off, so each run takes seconds beyond its start and the comparison is fp32 against fp32),
the embedded corpus tokenized once into <out>/shards, every step logged. Results: PASS/FAIL per
check on stdout, the table in <out>/proofs.md, every number in <out>/proofs.json; each run's
console in <out>/<check>/<run>.log and each rank's output under <out>/<check>/<run>-logs/.
"""

from __future__ import annotations

import datetime
import json
import re
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path

from bench.launcher import (EMBEDDED_DATA, Launched, RunError, Trigger, complete_checkpoints,
                            data_parallel_kind, device_name, kill_rank, launch, logged_steps, losses,
                            nproc_problems, pick, preempt_and_resume, stop_on_sigterm, tail,
                            tool_parser, trainer_keys)
from bench.metrics import read_metrics
from bench.timing import require_cuda, versions
from flame.run_metrics import MetricsFileError

CHECKS = ("hsdp_nodes", "preempt_fsdp", "preempt_replicas", "kill_rank")
FP32_BOUNDS = {"loss": (1e-6, 1e-4), "grad_norm": (1e-6, 2e-2)}
"""Relative bounds of hsdp_nodes (at step 1, at every step) in fp32 (module docstring)."""
BF16_BOUNDS = {"loss": (2e-2, 2e-2), "grad_norm": (5e-2, 5e-2)}
STOP_GRACE_S = 15.0
"""Seconds beyond the collective timeout for a rank to stop: NCCL's watchdog notices a timed-out
collective within its poll, then the process aborts and torchrun sees it go."""
NO_CHECKPOINTS = ["--checkpoint.enable", "false"]
FAILURE_LINE = re.compile(r"rank (\d+): (?:a collective failed after step|no step finished for "
                          r"[\d.]+ min since step) (\d+)")
"""flame's error (flame.train.parallel.collective_failure) or, before NCCL's watchdog aborts the
process, its warning (flame.train.preemption.StallWarning): the rank and its last finished step."""
RESUMED_LINE = re.compile(r"resumed from .*?step-(\d+): step (\d+)")


def keys(args, dump: Path, extra: list[str]) -> list[str]:
    return [*trainer_keys(args.config, dump, args.steps, args.device, args.overrides), *extra]


def data_parallel(shard: int, replicate: int = 1) -> list[str]:
    return ["--parallel.data_parallel_shard_degree", str(shard),
            "--parallel.data_parallel_replicate_degree", str(replicate)]


def run_to_end(args, out: Path, name: str, gpus: int, extra: list[str], *, nodes: int = 1) -> Launched:
    """One run of `gpus` ranks to its end; a failed run is a RunError."""
    log = out / f"{name}.log"
    launched = launch(keys(args, out / name, extra), log, gpus, device=args.device, timeout=args.timeout,
                      nodes=nodes)
    if any(launched.codes):
        raise RunError(f"{name} exited with {launched.codes}; log {log}:\n{tail(log)}")
    return launched


def require_kind(launched: Launched, expected: str, name: str) -> str:
    kind = data_parallel_kind(launched.rank_output.get(0, ""))
    if not kind.startswith(expected):
        raise RunError(f"{name}: rank 0 logged data parallel {kind!r}, not {expected!r}")
    return kind


# ---- hsdp_nodes ----------------------------------------------------------------------------------

def compare_steps(reference: list[dict], other: list[dict], bounds: dict[str, tuple[float, float]]) -> dict:
    """Step by step: the token counts, which must be equal, and the relative differences of loss and
    gradient norm, which must be within `bounds` ({"loss": (at step 1, at every step), ...})."""
    ref = {r["step"]: r for r in reference}
    got = {r["step"]: r for r in other}
    problems = []
    if sorted(ref) != sorted(got):
        problems.append(f"the runs logged steps {sorted(ref)} and {sorted(got)}")
    steps = sorted(set(ref) & set(got))
    tokens = [s for s in steps if ref[s]["tokens"] != got[s]["tokens"]]
    if tokens:
        problems.append(f"the token counts differ at steps {tokens}: not the same global batch")
    result = {"steps": len(steps), "bounds": bounds}
    for key, (first, every) in bounds.items():
        rel = {s: abs(got[s][key] - ref[s][key]) / abs(ref[s][key]) for s in steps}
        worst = max(rel, key=rel.get) if rel else None
        result[key] = {"max_rel_diff": rel[worst] if rel else None, "at_step": worst,
                       "first_step_rel_diff": rel.get(1)}
        if rel.get(1, 0.0) > first:
            problems.append(f"{key} differs by {rel[1]:.3g} (relative) at step 1, more than {first:g}")
        if rel and rel[worst] > every:
            problems.append(f"{key} differs by {rel[worst]:.3g} (relative) at step {worst}, more than {every:g}")
    result["problems"] = problems
    result["passed"] = not problems and bool(steps)
    return result


def fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.2g}"


def check_hsdp_nodes(args, out: Path) -> dict:
    p = args.nproc
    one = run_to_end(args, out, "one_rank", 1,
                     ["--training.gradient_accumulation_steps", str(args.ga * p), *NO_CHECKPOINTS])
    hsdp = run_to_end(args, out, "hsdp", p, [*data_parallel(p // 2, 2), *NO_CHECKPOINTS], nodes=2)
    require_kind(one, "one rank", "one_rank")
    kind = require_kind(hsdp, f"HSDP, 2 replicas of FSDP over {p // 2} ranks", "hsdp")
    result = compare_steps(read_metrics(out / "one_rank" / "metrics.jsonl"),
                           read_metrics(out / "hsdp" / "metrics.jsonl"), args.bounds)
    loss, norm = result["loss"], result["grad_norm"]
    result.update(
        data_parallel=kind,
        summary=(f"{result['steps']} steps, 2 nodes x {p // 2} (GA {args.ga}) vs 1 rank (GA {args.ga * p}): "
                 f"loss max rel diff {fmt(loss['max_rel_diff'])} (step {loss['at_step']}; step 1 "
                 f"{fmt(loss['first_step_rel_diff'])}), grad norm {fmt(norm['max_rel_diff'])} (step "
                 f"{norm['at_step']}; step 1 {fmt(norm['first_step_rel_diff'])})"),
        bound="tokens equal; relative at step 1 / every step: " + ", ".join(
            f"{key.replace('_', ' ')} {first:g} / {every:g}" for key, (first, every) in args.bounds.items()))
    return result


# ---- preempt_fsdp, preempt_replicas -------------------------------------------------------------

def check_preempt(args, out: Path, shard: int) -> dict:
    p = args.nproc
    expected = f"FSDP over {p} ranks" if shard > 1 else f"replicated over {p} ranks"
    reference = run_to_end(args, out, "uninterrupted", p, [*data_parallel(shard), *NO_CHECKPOINTS])
    kind = require_kind(reference, expected, "uninterrupted")
    dump = out / "preempted"
    result = preempt_and_resume(
        keys(args, dump, [*data_parallel(shard), "--checkpoint.enable", "true", "--checkpoint.interval",
                          str(args.steps), "--checkpoint.keep_latest_k", "0"]),
        dump, out / "preempted.log", p, losses(out / "uninterrupted"), device=args.device, timeout=args.timeout)
    stops = sorted(set(result["rank_stop_steps"].values()), key=str)
    result.update(
        data_parallel=kind,
        summary=(f"{kind}: SIGUSR1 after step {result['signalled_after_step']} -> ranks stopped at step(s) "
                 f"{stops}, checkpoint written by ranks {result['checkpoint_ranks']}; {result['compared_steps']} "
                 f"steps compared (before the stop and after the resume), max |loss diff| {result['max_abs_loss_diff']}"),
        bound="one step on every rank; bitwise")
    return result


# ---- kill_rank ------------------------------------------------------------------------------------

def check_kill_rank(args, out: Path) -> dict:
    p, per_node = args.nproc, args.nproc // 2
    victim = p - 1
    interval = max(2, args.steps // 4)
    dump, log = out / "killed", out / "killed.log"
    run_keys = keys(args, dump, [*data_parallel(1), "--checkpoint.enable", "true",
                                 "--checkpoint.interval", str(interval), "--checkpoint.keep_latest_k", "0",
                                 "--parallel.collective_timeout_minutes", str(args.collective_timeout_minutes)])
    metrics = dump / "metrics.jsonl"
    trigger = Trigger(lambda: logged_steps(metrics) >= interval + 2 and bool(complete_checkpoints(dump)),
                      kill_rank(victim, per_node))
    killed = launch(run_keys, log, p, device=args.device, timeout=args.timeout, nodes=2, trigger=trigger)
    if trigger.fired_at is None:
        raise RunError(f"the run ended (exit codes {killed.codes}) before step {interval + 2} was logged "
                       f"after a complete checkpoint; log {log}:\n{tail(log)}")
    kind = require_kind(killed, f"replicated over {p} ranks", "killed")
    before = losses(dump)
    last_complete = complete_checkpoints(dump)[-1]
    limit = 60 * args.collective_timeout_minutes + STOP_GRACE_S
    problems = []
    stop_s = [round(end - trigger.fired_at, 2) for end in killed.ended]
    if killed.codes[0] == 0 or stop_s[0] > limit:
        problems.append(f"node 0 exited with {killed.codes[0]} {stop_s[0]:.1f}s after the kill "
                        f"(an error within {limit:.0f}s expected)")
    named = {}
    for rank in range(per_node):  # node 0: no launcher stops these ranks
        found = FAILURE_LINE.findall(killed.rank_output.get(rank, ""))
        named[rank] = [int(s) for r, s in found if int(r) == rank]
        if not any(last_complete <= s <= args.steps for s in named[rank]):
            problems.append(f"rank {rank} logged no error naming itself and a step >= {last_complete} "
                            f"(found {found})")
    text = log.read_text(errors="replace")
    launcher_named = bool(re.search(rf"rank\s*:\s*{victim} \(local_rank: {victim - per_node}\)\s*\n\s*"
                                    r"exitcode\s*:\s*-9", text))
    if not launcher_named:
        problems.append(f"node 1's torchrun did not report rank {victim} killed (exitcode -9)")

    resumed = launch(run_keys, log, p, device=args.device, timeout=args.timeout, nodes=2)
    if any(resumed.codes):
        problems.append(f"the resumed run exited with {resumed.codes}")
    resumed_from = [int(m[0]) for m in RESUMED_LINE.findall(resumed.rank_output.get(0, ""))]
    if resumed_from != [last_complete]:
        problems.append(f"the resumed run resumed from {resumed_from}, not [{last_complete}]")
    after = losses(dump)
    if sorted(after) != list(range(1, args.steps + 1)):
        problems.append(f"the resumed run logged steps {sorted(after)}")
    again = [s for s in sorted(before) if s > last_complete and s in after]
    differ = [s for s in again if after[s] != before[s]]
    if not again or differ:
        problems.append(f"steps logged before the kill and after the resume: {again}, losses differ at {differ}")
    if problems:
        print(f"kill_rank: {'; '.join(problems)}; log {log}:\n{tail(log)}", file=sys.stderr, flush=True)
    return {
        "data_parallel": kind, "killed_rank": victim, "logged_before_the_resume": max(before),
        "last_complete_checkpoint": last_complete, "exit_codes": killed.codes, "stop_seconds": stop_s,
        "steps_named": named, "launcher_named_the_rank": launcher_named, "resumed_from": resumed_from,
        "steps_compared": again, "problems": problems, "passed": not problems,
        "summary": (f"rank {victim} killed, the run logged up to step {max(before)}; node 0 stopped "
                    f"{stop_s[0]:.1f}s after the kill (exit {killed.codes[0]}), its ranks named (rank: steps) "
                    f"{named}; resumed from step {resumed_from} to {args.steps}, steps {again} logged again "
                    + ("bitwise equal" if again and not differ else f"differ at {differ}")),
        "bound": f"stop <= {limit:.0f}s (timeout {60 * args.collective_timeout_minutes:g}s + {STOP_GRACE_S:g}s)",
    }


# ---- the tool -------------------------------------------------------------------------------------

def run_check(args, check: str, out: Path) -> dict:
    if check == "hsdp_nodes":
        return check_hsdp_nodes(args, out)
    if check == "kill_rank":
        return check_kill_rank(args, out)
    return check_preempt(args, out, shard=args.nproc if check == "preempt_fsdp" else 1)


def prepare_shards(args, out_root: Path) -> None:
    """Tokenize the corpus once for every run (else each rank of each run does it)."""
    from flame.data.prepare import main as prepare

    if any(key.startswith("--data.shard_dir") for key in args.overrides):
        return
    shards = out_root / "shards"
    shutil.rmtree(shards, ignore_errors=True)
    prepare(["--config", args.config, *EMBEDDED_DATA, *args.overrides, "--out", str(shards)])
    args.overrides = [*args.overrides, "--data.shard_dir", str(shards)]


def table(results: dict) -> str:
    lines = ["| check | result | measured | bound | s |", "|---|---|---|---|---|"]
    for check, r in results.items():
        measured = r.get("summary") or r.get("error", "").splitlines()[0][:300]
        if r.get("problems"):
            measured += " — " + "; ".join(r["problems"])[:400]
        lines.append(f"| {check} | {'PASS' if r['passed'] else 'FAIL'} | {measured} | {r.get('bound', '')} | "
                     f"{r['wall_s']:.0f} |")
    return "\n".join(lines)


def parse_args(argv):
    parser = tool_parser(__doc__, nproc=4, steps=20, out="outputs/dp_proofs", timeout=300)
    parser.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated of {','.join(CHECKS)}")
    parser.add_argument("--config", default="configs/tiny.toml")
    parser.add_argument("--collective-timeout-minutes", type=float, default=0.5,
                        help="parallel.collective_timeout_minutes of kill_rank (minutes, any number > 0)")
    args, overrides = parser.parse_known_args(argv)
    args.overrides = overrides
    args.checks, problems = pick("--checks", args.checks, CHECKS)
    problems += nproc_problems(args.nproc)
    if "hsdp_nodes" in args.checks and args.nproc < 4:
        problems.append("hsdp_nodes needs --nproc >= 4 (2 nodes of FSDP over P/2 >= 2 ranks)")
    if args.steps < 8:
        problems.append(f"--steps must be >= 8 (a checkpoint, two steps and a kill before the end), got {args.steps}")
    if args.collective_timeout_minutes <= 0:
        problems.append("--collective-timeout-minutes must be > 0")
    if problems:
        parser.error("; ".join(problems))
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.device == "cuda":
        import torch

        hint = "--device cpu runs the same checks on CPU processes"
        require_cuda("bench.dp_proofs", hint)
        if torch.cuda.device_count() < args.nproc:
            raise SystemExit(f"bench.dp_proofs runs {args.nproc} ranks on GPUs and {torch.cuda.device_count()} "
                             f"are visible: --nproc {torch.cuda.device_count()}, or {hint}")
    from flame.config import load_config

    training = load_config(["--config", args.config, *args.overrides]).training
    args.ga = training.gradient_accumulation_steps
    fp32 = args.device == "cpu" or training.mixed_precision_param == "float32"
    args.bounds = FP32_BOUNDS if fp32 else BF16_BOUNDS
    out_root = Path(args.out).resolve()
    out_root.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    prepare_shards(args, out_root)
    results = {}
    for check in args.checks:
        out = out_root / check
        shutil.rmtree(out, ignore_errors=True)  # a run left there would be resumed
        out.mkdir()
        print(f"== {check}", flush=True)
        started = time.monotonic()
        try:
            results[check] = run_check(args, check, out)
        except (RunError, MetricsFileError) as err:
            print(f"{check}: {err}", file=sys.stderr, flush=True)
            results[check] = {"error": str(err), "passed": False}
        results[check]["wall_s"] = round(time.monotonic() - started, 1)
        r = results[check]
        print(f"{check}: {'PASS' if r['passed'] else 'FAIL'}: "
              f"{r.get('summary') or r['error'].splitlines()[0]}", flush=True)
    header = (f"bench/dp_proofs.py on {device_name(args.device)}, {datetime.date.today()}, {versions()}: "
              f"`python -m bench.dp_proofs {shlex.join(argv)}`")
    (out_root / "proofs.json").write_text(json.dumps({"command": header, "results": results}, indent=1,
                                                     default=str) + "\n")
    report = header + "\n\n" + table(results) + "\n"
    (out_root / "proofs.md").write_text(report)
    print("\n" + report)
    return 0 if all(r["passed"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
