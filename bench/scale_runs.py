"""The runs of bench/scale.py and how each is measured: the plan that every run of one invocation
shares, the `torchrun -m flame.train` launches (and the SIGKILL of a run with its ranks), the
reading of a run's metrics.jsonl, and the five runs: fsdp, single, hsdp, resume and model_only
(`python bench/scale.py --help` describes them)."""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]

RUNS = ("fsdp", "single", "hsdp", "resume", "model_only")
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}
EMBEDDED_DATA = {"data.dataset": "embedded", "data.tokenizer": "", "data.name": "",
                 "data.data_files": "", "data.sources": "", "data.probs": "",
                 "data.streaming": "false", "data.shard_dir": "", "model.vocab_size": "8192"}
# keys every run sets itself: an extra override of one of them would silently change the plan
OWNED_KEYS = ("job.dump_folder", "training.steps", "training.gradient_accumulation_steps",
              "training.device", "parallel.data_parallel_shard_degree",
              "parallel.data_parallel_replicate_degree", "checkpoint.enable",
              "checkpoint.interval", "checkpoint.keep_latest_k", "checkpoint.load_step",
              "checkpoint.initial_load_path", "checkpoint.initial_load_model_only",
              "checkpoint.async_mode", "metrics.log_freq", "metrics.val_freq",
              "metrics.enable_wandb", "lr_scheduler.warmup_steps")
EFFICIENCY_TARGET = 0.90


class ScaleError(RuntimeError):
    """A run failed or a check could not be made; the message says which and why."""


@dataclass(frozen=True)
class Plan:
    """What every run of one invocation shares."""

    config: str
    name: str            # the config's file stem, the first column of the results table
    nproc: int
    steps: int
    kill_step: int
    warmup_steps: int     # logged steps left out of the throughput medians
    batch_size: int
    seq_len: int
    grad_accum: int
    global_batch_tokens: int
    device: str
    overrides: tuple[tuple[str, str], ...]   # --section.key value pairs given to every run

    @property
    def hsdp_shape(self) -> tuple[int, int]:
        return 2, max(1, self.nproc // 2)

    def label(self, run: str) -> str:
        replicate, shard = self.hsdp_shape
        return {
            "fsdp": f"FSDP {self.nproc}",
            "single": "1 process (baseline)",
            "hsdp": f"HSDP {replicate}x{shard}",
            "resume": f"resume after SIGKILL at world {self.nproc}",
            "model_only": f"model-only load {self.nproc} -> 1",
        }[run]


# ---- planning ----------------------------------------------------------------------------------

def make_plan(args: argparse.Namespace, extra: dict[str, str]) -> Plan:
    from flame.config import ConfigError, load_config

    problems = []
    if args.nproc < 2 or args.nproc % 2:
        problems.append(f"--nproc must be even and >= 2 (HSDP replicates 2 ways), got {args.nproc}")
    if args.steps < 4 or args.steps % 2:
        problems.append(f"--steps must be even and >= 4 (the kill comes at steps/2), got {args.steps}")
    if not 0 <= args.warmup_steps < args.steps:
        problems.append(f"--warmup-steps must be in [0, steps), got {args.warmup_steps}")
    if args.global_batch_tokens < 1:
        problems.append(f"--global-batch-tokens must be >= 1, got {args.global_batch_tokens}")
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = [r for r in runs if r not in RUNS]
    if unknown or not runs:
        problems.append(f"--runs: unknown {unknown or 'empty list'}; choose from {','.join(RUNS)}")
    if problems:
        raise ScaleError("; ".join(problems))

    overrides = {} if args.config_data else dict(EMBEDDED_DATA)
    overrides.update(extra)  # the user's overrides win over the embedded-data defaults
    try:
        cfg = load_config(["--config", args.config, *flatten(overrides)])
    except ConfigError as err:
        raise ScaleError(f"{args.config} with these overrides is not a valid job: {err}") from err
    b, seq_len = cfg.training.batch_size, cfg.training.seq_len
    grad_accum = max(1, round(args.global_batch_tokens / (b * seq_len * args.nproc)))
    return Plan(config=args.config, name=Path(args.config).stem, nproc=args.nproc,
                steps=args.steps, kill_step=args.steps // 2, warmup_steps=args.warmup_steps,
                batch_size=b, seq_len=seq_len, grad_accum=grad_accum,
                global_batch_tokens=b * seq_len * grad_accum * args.nproc, device=args.device,
                overrides=tuple(overrides.items()))


def flatten(overrides: dict[str, str]) -> list[str]:
    return [item for key, value in overrides.items() for item in (f"--{key}", str(value))]


def run_overrides(plan: Plan, run: str, dump: Path, **extra: str) -> dict[str, str]:
    """Every --section.key of one run: the plan's, then the script's own keys."""
    shard, replicate = -1, 1
    if run in ("fsdp", "resume"):
        shard = plan.nproc
    elif run == "hsdp":
        replicate, shard = plan.hsdp_shape
    checkpoints = run in ("fsdp", "resume")
    keys = dict(plan.overrides)
    keys.update({
        "job.dump_folder": str(dump),
        "training.steps": str(plan.steps),
        "training.gradient_accumulation_steps": str(plan.grad_accum),
        "training.device": plan.device,
        "parallel.data_parallel_shard_degree": str(shard),
        "parallel.data_parallel_replicate_degree": str(replicate),
        "checkpoint.enable": "true" if checkpoints else "false",
        "checkpoint.interval": str(plan.kill_step),
        "checkpoint.keep_latest_k": "0",
        "checkpoint.async_mode": "disabled",
        "checkpoint.load_step": "-1",
        "checkpoint.initial_load_path": "",
        "checkpoint.initial_load_model_only": "true",
        "metrics.log_freq": "1",
        "metrics.val_freq": "0",
        "metrics.enable_wandb": "false",
        "lr_scheduler.warmup_steps": str(max(1, plan.steps // 5)),
    })
    keys.update(extra)
    return keys


# ---- running -----------------------------------------------------------------------------------

def child_env(device: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(NCCL_ENV)
    env.setdefault("OMP_NUM_THREADS", "1")  # the same for 1 and P processes (torchrun's default)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def torchrun_command(nproc: int, config: str, keys: dict[str, str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", str(nproc), "-m", "flame.train", "--config", config,
            *flatten(keys)]


def launch(command: list[str], log_path: Path, env: dict[str, str], *, timeout: float,
           kill_when: Path | None = None, forbidden: Path | None = None) -> None:
    """Run `command` to its end or, with `kill_when`, SIGKILL it and its ranks as soon as that
    file exists (`forbidden` must not exist by then). Raises ScaleError on a failure. The runs
    start in this process's working directory, so relative paths mean the same to them."""
    print("$ " + shlex.join(command), flush=True)
    start = time.monotonic()
    with open(log_path, "ab") as log:
        log.write(("$ " + shlex.join(command) + "\n").encode())
        log.flush()
        proc = subprocess.Popen(command, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while True:
                code = proc.poll()
                if kill_when is not None and kill_when.exists():
                    if code is not None:
                        raise ScaleError(f"the run exited (status {code}) before it could be "
                                         f"killed after {kill_when}: raise --steps")
                    kill_tree(proc)
                    if forbidden is not None and forbidden.exists():
                        raise ScaleError(f"{forbidden} exists: the run reached its last step "
                                         f"before the kill; raise --steps")
                    return
                if code is not None:
                    break
                if time.monotonic() - start > timeout:
                    kill_tree(proc)
                    raise ScaleError(f"timed out after {timeout:.0f}s (--timeout); log {log_path}")
                time.sleep(0.01)
        except BaseException:
            if proc.poll() is None:
                kill_tree(proc)
            raise
    if proc.returncode != 0:
        raise ScaleError(f"exited with status {proc.returncode}; log {log_path}:\n"
                         + tail(log_path))
    if kill_when is not None:
        raise ScaleError(f"the run finished before {kill_when} appeared; log {log_path}:\n"
                         + tail(log_path))


def tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def children(pid: int) -> list[int]:
    """Process ids whose parent is `pid` (torchrun's ranks: each leads its own session)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun's process group and each rank's (torchrun starts every rank in a new
    session, so killing the agent alone would leave the ranks running), then wait for them."""
    ranks = children(proc.pid)
    groups = []
    for pid in ranks:
        try:
            groups.append(os.getpgid(pid))
        except ProcessLookupError:
            pass
    for group in [*groups, proc.pid]:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    deadline = time.monotonic() + 60
    while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)


# ---- reading the runs --------------------------------------------------------------------------

def line_count(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.is_file() else 0


def throughput(records: list[dict], plan: Plan, checkpoint_steps: tuple[int, ...] = ()) -> dict:
    """Medians over the steps after warm-up, leaving out each step whose window holds a save."""
    after_save = {s + 1 for s in checkpoint_steps}
    timed = [r for r in records if r["step"] > plan.warmup_steps and r["step"] not in after_save
             and not r.get("skipped")]
    if not timed:
        raise ScaleError(f"no logged step after the {plan.warmup_steps} warm-up steps: raise --steps")
    result = {
        "tokens_per_s_per_gpu": statistics.median(r["tokens_per_s_per_device"] for r in timed),
        "timed_steps": len(timed),
        "mfu": statistics.median(r["mfu"] for r in timed) if all("mfu" in r for r in timed) else None,
        "peak_memory_gib": max((r["memory_gib"] for r in records if "memory_gib" in r),
                               default=None),
        "first_loss": records[0]["loss"],
        "last_loss": records[-1]["loss"],
    }
    return result


def losses_by_step(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records}


# ---- the runs ----------------------------------------------------------------------------------

def run_fsdp(plan: Plan, out: Path, timeout: float) -> dict:
    return run_throughput(plan, "fsdp", plan.nproc, out, timeout,
                          checkpoint_steps=(plan.kill_step, plan.steps))


def run_throughput(plan: Plan, run: str, nproc: int, out: Path, timeout: float,
                   checkpoint_steps: tuple[int, ...] = ()) -> dict:
    dump = fresh(out, run)
    command = torchrun_command(nproc, plan.config, run_overrides(plan, run, dump))
    launch(command, out / f"{run}.log", child_env(plan.device), timeout=timeout)
    records = read_metrics(dump / "metrics.jsonl")
    if [r["step"] for r in records] != list(range(1, plan.steps + 1)):
        raise ScaleError(f"{run}: metrics.jsonl does not log steps 1..{plan.steps}")
    result = throughput(records, plan, checkpoint_steps)
    result.update(world=nproc, command=shlex.join(command))
    return result


def run_resume(plan: Plan, out: Path, timeout: float, tolerance: float) -> dict:
    reference = losses_by_step(read_metrics(out / "fsdp" / "metrics.jsonl"))
    dump = fresh(out, "resume")
    command = torchrun_command(plan.nproc, plan.config, run_overrides(plan, "resume", dump))
    checkpoints = dump / "checkpoint"
    launch(command, out / "resume.log", child_env(plan.device), timeout=timeout,
           kill_when=checkpoints / f"step-{plan.kill_step}" / "COMPLETE",
           forbidden=checkpoints / f"step-{plan.steps}" / "COMPLETE")
    metrics = dump / "metrics.jsonl"
    before = read_metrics(metrics)
    reached = max((r["step"] for r in before), default=0)
    lines_before = line_count(metrics)
    launch(command, out / "resume.log", child_env(plan.device), timeout=timeout)
    after = read_metrics(metrics, lines_before)
    resumed_steps = [r["step"] for r in after]
    expected = list(range(plan.kill_step + 1, plan.steps + 1))
    if resumed_steps != expected:
        raise ScaleError(f"resume: the relaunched run logged steps {resumed_steps}, expected "
                         f"{expected[0]}..{expected[-1]} (a resume from step-{plan.kill_step})")
    post = [abs(r["loss"] - reference[r["step"]]) for r in after]
    pre = [abs(r["loss"] - reference[r["step"]]) for r in before if r["step"] <= plan.kill_step]
    max_post = max(post)
    return {
        "world": plan.nproc,
        "command": shlex.join(command),
        "killed_at_step": reached,
        "resumed_from": plan.kill_step,
        "compared_steps": len(post),
        "bitwise": max_post == 0.0,
        "max_abs_diff_after_resume": max_post,
        "max_abs_diff_before_kill": max(pre) if pre else None,
        "tolerance": tolerance,
        "passed": max_post <= tolerance,
    }


def run_model_only(plan: Plan, out: Path, timeout: float, single_ok: bool) -> dict:
    """Load the fsdp run's step-S/2 weights into a fresh 1-process run and compare its first loss
    (before any update) with the untrained model's on the same batch: the single run's step 1
    (same seed, same init, same 1-rank data), or the fsdp run's step 1 without a single run."""
    p_losses = losses_by_step(read_metrics(out / "fsdp" / "metrics.jsonl"))
    checkpoint = (out / "fsdp" / "checkpoint" / f"step-{plan.kill_step}").resolve()
    if not (checkpoint / "COMPLETE").is_file():
        raise ScaleError(f"model_only: {checkpoint} is not a complete checkpoint (run fsdp first)")
    dump = fresh(out, "model_only")
    keys = run_overrides(plan, "model_only", dump, **{
        "training.steps": "1",
        "checkpoint.initial_load_path": str(checkpoint),
        "checkpoint.initial_load_model_only": "true",
    })
    command = torchrun_command(1, plan.config, keys)
    log = out / "model_only.log"
    launch(command, log, child_env(plan.device), timeout=timeout)
    if "weights loaded from" not in log.read_text(errors="replace"):
        raise ScaleError(f"model_only: the run did not report loading the weights; log {log}")
    loaded = read_metrics(dump / "metrics.jsonl")[0]["loss"]
    if single_ok:
        untrained = losses_by_step(read_metrics(out / "single" / "metrics.jsonl"))[1]
        untrained_on = "same batch"
    else:
        untrained, untrained_on = p_losses[1], "P-run's first batch"
    # what training gained in the P-run itself (unseen batches): the load must show half of it
    gain = p_losses[1] - p_losses[plan.kill_step + 1]
    return {
        "world": 1,
        "command": shlex.join(command),
        "checkpoint": str(checkpoint),
        "loaded_first_loss": loaded,
        "untrained_loss": untrained,
        "untrained_on": untrained_on,
        "p_run_loss_same_weights": p_losses[plan.kill_step + 1],
        "p_run_gain": gain,
        "passed": gain > 0 and loaded < untrained - gain / 2,
        "note": "" if gain > 0 else "the fsdp run did not learn: raise --steps",
    }


def fresh(out: Path, run: str) -> Path:
    """An empty run folder (an old one would be resumed from) and no old log."""
    path = out / run
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    (out / f"{run}.log").unlink(missing_ok=True)
    return path


def run_one(run: str, plan: Plan, summary: dict, out: Path, timeout: float,
            resume_tolerance: float) -> dict:
    """One run of the plan; `summary` holds the runs made before it (resume and model_only need
    the fsdp run; model_only compares with the single run's first loss when there is one)."""
    if run in ("resume", "model_only") and "error" in summary["fsdp"]:
        raise ScaleError(f"{run} needs the fsdp run, which failed")
    if run == "fsdp":
        return run_fsdp(plan, out, timeout)
    if run == "single":
        return run_throughput(plan, "single", 1, out, timeout)
    if run == "hsdp":
        return run_throughput(plan, "hsdp", plan.nproc, out, timeout)
    if run == "resume":
        return run_resume(plan, out, timeout, resume_tolerance)
    single_ok = "single" in summary and "error" not in summary["single"]
    return run_model_only(plan, out, timeout, single_ok)


def device_description(device: str) -> str:
    """"8x NVIDIA H200" (asked in a child process: CUDA in this one would hold memory on GPU 0
    during every run), or the CPU."""
    if device == "cuda":
        probe = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.cuda.device_count(), "
             "torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"],
            capture_output=True, text=True, env=child_env(device))
        count, _, name = probe.stdout.strip().partition(" ")
        if probe.returncode != 0 or not name:
            detail = probe.stderr.strip()[-500:]
            raise ScaleError("--device cuda, but no CUDA device was found"
                             + (f": {detail}" if detail else " (use --device cpu for a smoke run)"))
        return f"{count}x {name}"
    return f"CPU ({os.cpu_count()} cores, {platform.machine()})"

