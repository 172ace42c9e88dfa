"""Scaling run of issue 8: FSDP and HSDP throughput, scaling efficiency, resume across a SIGKILL
and a model-only load at world size 1, one `torchrun -m flame.train` subprocess at a time.

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
visibly. With --runs a subset can run in a later call on the same --out (resume and model_only
need the fsdp run of the same plan); <out>/summary.json keeps every run's numbers.

The script prints a markdown table and writes or updates its rows in --results (default
bench/RESULTS.md), with the command, the device, the date and the torch/triton versions.
Exit status: 0 when every run finished and the resume and model-only checks passed, else 1.

Data: by default the embedded corpus and tokenizer (--data.dataset embedded, --data.tokenizer "",
--model.vocab_size 8192, not streamed), because the GPU machines have no network; --config-data
keeps the config's [data] and vocabulary instead.

On the lent GPU machines (nvidia-h200-x8 for P = 8; their image lacks torchtitan, datasets and
wandb, and has no network):
  here, once:  bash ../shared/device/fetch-wheels.sh      # writes .whl/ (git-ignored)
  device command, carrying .whl, from the repository root (the run tool's limit is 10 minutes per
  command, so split the runs over two calls on the same warm machine and the same --out; the
  timeout leaves time to copy the logs back, and on SIGTERM the script kills its running ranks):
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && \
    cp bench/RESULTS.md $OUT/RESULTS.md && \
    timeout 570 python3 bench/scale.py --config configs/rwkv7_1B.toml --nproc 8 \
        --out /tmp/scale --results $OUT/RESULTS.md --runs fsdp,single,hsdp; \
    cp /tmp/scale/summary.json /tmp/scale/*.log $OUT/
  then the same with --runs resume,model_only (the second call's RESULTS.md holds every row of
  the plan: summary.json in --out remembers the first call's), and copy the returned RESULTS.md
  over bench/RESULTS.md. Keep --out off $OUT: a 1B checkpoint with its optimizer state is ~15 GB.
  NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 are set in
  every run's environment (NVLink multicast stays off).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout

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
RESULTS_ROWS = ("<!-- scale.py rows -->", "<!-- /scale.py rows -->")
RESULTS_COMMANDS = ("<!-- scale.py commands -->", "<!-- /scale.py commands -->")
TABLE_HEADER = ("| config | run | world | global batch (tokens) | tok/s/GPU | MFU | "
                "peak mem/GPU (GiB) | scaling eff. | result | measured |\n"
                "|---|---|---|---|---|---|---|---|---|---|")


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

def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, dict[str, str]]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Any other --section.key value is passed to every run (it must not be one of the "
               "keys the script sets itself).")
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

def read_metrics(path: Path, start_line: int = 0) -> list[dict]:
    """The training records (not validation ones) of metrics.jsonl from line `start_line` on."""
    if not path.is_file():
        raise ScaleError(f"{path} is missing: the run logged nothing")
    records = []
    for number, line in enumerate(path.read_text().splitlines()[start_line:], start_line + 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut by the SIGKILL: not a record
            print(f"note: {path}:{number} is not JSON (cut by the kill?), skipped", file=sys.stderr)
            continue
        if "loss" in record:
            records.append(record)
    return records


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


# ---- reporting ---------------------------------------------------------------------------------

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


def versions() -> str:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return f"torch {torch.__version__}, triton {triton_version}"


def fmt(value, pattern: str = "{:,.0f}") -> str:
    return "n/a" if value is None else pattern.format(value)


def table_rows(plan: Plan, summary: dict) -> dict[tuple[str, str], str]:
    """{(config, run label): markdown row} for the runs in `summary`."""
    rows = {}
    base = summary.get("single", {}).get("tokens_per_s_per_gpu")
    for run in RUNS:
        result = summary.get(run)
        if result is None:
            continue
        label = plan.label(run)
        world = str(result.get("world", ""))
        if "error" in result:
            cells = ["—"] * 5 + [f"FAILED: {result['error'].splitlines()[0][:200]}"]
        elif run in ("fsdp", "single", "hsdp"):
            batch = plan.global_batch_tokens if run != "single" else plan.global_batch_tokens // plan.nproc
            eff = None if base is None or run == "single" else result["tokens_per_s_per_gpu"] / base
            note = "baseline" if run == "single" else (
                "no baseline" if eff is None else
                f"{'meets' if eff >= EFFICIENCY_TARGET else 'BELOW'} the 90% target")
            cells = [f"{batch:,}", fmt(result["tokens_per_s_per_gpu"]),
                     fmt(result["mfu"], "{:.1%}"), fmt(result["peak_memory_gib"], "{:.1f}"),
                     fmt(eff, "{:.1%}"), note]
        elif run == "resume":
            detail = ("bitwise equal" if result["bitwise"] else
                      f"max abs loss difference {result['max_abs_diff_after_resume']:.3g} "
                      f"(tolerance {result['tolerance']:g})")
            pre = result["max_abs_diff_before_kill"]
            cells = [f"{plan.global_batch_tokens:,}", "—", "—", "—", "—",
                     f"{'PASS' if result['passed'] else 'FAIL'}: killed at step "
                     f"{result['killed_at_step']}, resumed from {result['resumed_from']}, "
                     f"{result['compared_steps']} losses {detail}"
                     + ("" if pre is None else f"; before the kill: max abs difference {pre:.3g}")]
        else:
            cells = [f"{plan.global_batch_tokens // plan.nproc:,}", "—", "—", "—", "—",
                     f"{'PASS' if result['passed'] else 'FAIL'}: step-{plan.kill_step} weights, "
                     f"first loss {result['loaded_first_loss']:.4f} vs untrained "
                     f"{result['untrained_loss']:.4f} ({result['untrained_on']}); P-run loss "
                     f"with these weights {result['p_run_loss_same_weights']:.4f} (its own batch)"
                     + (f"; {result['note']}" if result.get("note") else "")]
        rows[(plan.name, label)] = "| " + " | ".join(
            [plan.name, label, world, *cells, result["measured"]]) + " |"
    return rows


def update_results(path: Path, rows: dict[tuple[str, str], str], commands: dict[tuple[str, str], str]) -> None:
    """Replace the rows (and command lines) with the same (config, run) key, append new ones."""
    text = path.read_text() if path.is_file() else (
        "# Benchmark results\n\n## Scaling (bench/scale.py)\n\n"
        f"{RESULTS_ROWS[0]}\n{TABLE_HEADER}\n{RESULTS_ROWS[1]}\n\n"
        f"### Commands\n\n{RESULTS_COMMANDS[0]}\n{RESULTS_COMMANDS[1]}\n")
    text = merge_block(text, RESULTS_ROWS, rows, key_of_row, keep_prefix=2)
    text = merge_block(text, RESULTS_COMMANDS, commands, key_of_command, keep_prefix=0)
    path.write_text(text)


def merge_block(text: str, markers: tuple[str, str], entries: dict, key_of, keep_prefix: int) -> str:
    start, end = markers
    if start not in text or end not in text:
        raise ScaleError(f"the results file lacks the markers {start} ... {end}")
    head, rest = text.split(start, 1)
    body, tail_text = rest.split(end, 1)
    lines = [line for line in body.strip("\n").splitlines() if line.strip()]
    prefix, items = lines[:keep_prefix], lines[keep_prefix:]
    pending = dict(entries)
    merged = []
    for line in items:
        key = key_of(line)
        merged.append(pending.pop(key) if key in pending else line)
    merged.extend(pending.values())
    return head + start + "\n" + "\n".join(prefix + merged) + "\n" + end + tail_text


def key_of_row(line: str) -> tuple[str, str]:
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    return (cells[0], cells[1]) if len(cells) > 1 else (line, "")


def key_of_command(line: str) -> tuple[str, str]:
    # "- **config · run label**: ..."
    inner = line.split("**", 2)[1] if line.count("**") >= 2 else line
    config, _, label = inner.partition(" · ")
    return config.strip(), label.strip()


# ---- main --------------------------------------------------------------------------------------

def stop_on_sigterm(signum, frame):
    """`timeout` and the device tool stop with SIGTERM: leave through the KeyboardInterrupt path
    of `launch`, which kills the running ranks (they live in sessions of their own)."""
    raise KeyboardInterrupt(f"signal {signum}")


def write_outputs(plan: Plan, summary: dict, summary_path: Path, results: Path) -> list[str]:
    """summary.json, and the rows of every run of this plan in the results file (an earlier
    call's too: the efficiencies use the baseline). Returns the rows."""
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    rows = table_rows(plan, summary)
    commands = {(plan.name, plan.label(r)): f"- **{plan.name} · {plan.label(r)}**: "
                f"`{summary[r]['invocation']}` ({summary[r]['measured']})"
                for r in RUNS if r in summary}
    update_results(results, rows, commands)
    return list(rows.values())


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
              f"arguments of the call that ran it)", file=sys.stderr)
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
                result = make_run(run, plan, summary, out, args)
            except ScaleError as err:
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


def make_run(run: str, plan: Plan, summary: dict, out: Path, args: argparse.Namespace) -> dict:
    if run in ("resume", "model_only") and "error" in summary["fsdp"]:
        raise ScaleError(f"{run} needs the fsdp run, which failed")
    if run == "fsdp":
        return run_fsdp(plan, out, args.timeout)
    if run == "single":
        return run_throughput(plan, "single", 1, out, args.timeout)
    if run == "hsdp":
        return run_throughput(plan, "hsdp", plan.nproc, out, args.timeout)
    if run == "resume":
        return run_resume(plan, out, args.timeout, args.resume_tolerance)
    single_ok = "single" in summary and "error" not in summary["single"]
    return run_model_only(plan, out, args.timeout, single_ok)


if __name__ == "__main__":
    sys.exit(main())
