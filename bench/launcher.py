"""`launch/train.sh` run from the benchmarks as a user runs it (torchrun, the stop signals forwarded
to every rank), and the preempt-and-resume check; bench.scale and bench.dp_proofs share them.

- `trainer_keys`: the trainer arguments every benchmark run has (the embedded corpus, every step
  logged, no validation, no wandb, the node's compile cache `NODE_COMPILE_CACHE`).
- `launch`: P processes on one node, or on two "nodes" of this host (two launch/train.sh with
  NNODE=2 and NODE_RANK=0|1, the GPUs split between them by CUDA_VISIBLE_DEVICES, meeting on
  localhost); a `Trigger` acts on the run once a condition holds (`sigusr1_to_torchrun`,
  `kill_rank`). It returns each node's exit code and the moment it ended, and reads each rank's
  output from torchrun's per-rank files.
- `preempt_and_resume`: SIGUSR1 to torchrun halfway; every rank must stop and save at the same
  step, and the same command again must resume to losses bitwise equal to an uninterrupted run's.

NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 are set in every
run's environment (NVLink multicast stays off).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from bench.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
EMBEDDED_DATA = ["--data.dataset", "embedded", "--data.tokenizer", "", "--data.name", "",
                 "--data.streaming", "false", "--data.num_workers", "0"]
STOP_LINE = re.compile(r"stopped by (SIG[A-Z0-9]+) at step (\d+)")
"""A rank's line when a stop signal ended it (flame.train.preemption.Preempted)."""


class RunError(RuntimeError):
    """A run failed or a check could not be made; the message says which and why."""


NODE_COMPILE_CACHE = str(Path(tempfile.gettempdir()) / "flame-bench-compile-cache")
"""training.compile_cache_dir of every benchmark run: one folder on the node that the runs' new
dump folders share, with a subfolder per version of flame's source (flame.train.compile_cache), so
that runs of two versions on one node never load each other's compiled graphs."""


def trainer_keys(config: str, dump: Path, steps: int, device: str, overrides: list[str]) -> list[str]:
    """The trainer's arguments that every benchmark run shares; the caller's `overrides` come after
    the config and the embedded corpus, and the keys after them win over them."""
    return ["--config", config, *EMBEDDED_DATA, *overrides,
            "--job.dump_folder", str(dump), "--training.steps", str(steps),
            "--training.compile_cache_dir", NODE_COMPILE_CACHE,
            "--training.device", device,
            "--metrics.log_freq", "1", "--metrics.val_freq", "0", "--metrics.enable_wandb", "false",
            "--lr_scheduler.warmup_steps", str(max(1, steps // 5))]


# ---- launching ---------------------------------------------------------------------------------

@dataclass
class Trigger:
    """Act on a running launch once: `act(procs)` (each node's torchrun process) as soon as
    `when()` holds; `fired_at` is the time.monotonic() of the act."""

    when: Callable[[], bool]
    act: Callable[[list[subprocess.Popen]], None]
    fired_at: float | None = None


@dataclass
class Launched:
    """One launch: each node's torchrun exit code and the time.monotonic() at which it was seen to
    end, and each node's LOG_DIR (torchrun's per-rank files)."""

    codes: list[int]
    ended: list[float]
    log_dirs: list[Path]
    per_node: int
    rank_output: dict[int, str] = field(default_factory=dict)

    def read_rank_output(self) -> dict[int, str]:
        """Each rank's stdout and stderr (torchrun's files in LOG_DIR/<run>/attempt_*/<local
        rank>/), by global rank."""
        out: dict[int, str] = {}
        for node, folder in enumerate(self.log_dirs):
            for local in range(self.per_node):
                texts = [p.read_text(errors="replace")
                         for p in sorted(folder.glob(f"*/attempt_*/{local}/std*.log"))]
                out[node * self.per_node + local] = "\n".join(texts)
        self.rank_output = out
        return out


def launch(keys: list[str], log: Path, gpus: int, *, device: str, timeout: float, nodes: int = 1,
           trigger: Trigger | None = None) -> Launched:
    """Run launch/train.sh with `gpus` processes (over `nodes` nodes of this host) to its end, its
    console output appended to `log`; `trigger` acts on it while it runs."""
    port = free_port()
    per_node = gpus // nodes
    launches = sum(1 for _ in log.parent.glob(f"{log.stem}-logs/launch*-node0"))
    log_dirs = [log.parent / f"{log.stem}-logs" / f"launch{launches}-node{node}" for node in range(nodes)]
    procs = []
    with open(log, "ab") as out:
        for node in range(nodes):
            env = dict(os.environ, **NCCL_ENV, NGPU=str(per_node), NNODE=str(nodes), NODE_RANK=str(node),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOG_DIR=str(log_dirs[node]),
                       OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
            # torchrun from this interpreter's environment, activated or not
            env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
            if device == "cpu":
                env["CUDA_VISIBLE_DEVICES"] = ""
            elif nodes > 1:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(str(node * per_node + i) for i in range(per_node))
            command = ["bash", str(ROOT / "launch" / "train.sh"), *keys]
            out.write(f"$ NNODE={nodes} NODE_RANK={node} NGPU={per_node} {shlex.join(command)}\n".encode())
            out.flush()
            procs.append(subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True, cwd=ROOT))
        ended: list[float | None] = [None] * nodes
        deadline = time.monotonic() + timeout
        try:
            while None in ended:
                for node, p in enumerate(procs):
                    if ended[node] is None and p.poll() is not None:
                        ended[node] = time.monotonic()
                if trigger and trigger.fired_at is None and None in ended and trigger.when():
                    trigger.act(procs)
                    trigger.fired_at = time.monotonic()
                if time.monotonic() > deadline:
                    raise RunError(f"timed out after {timeout:.0f}s (--timeout); log {log}")
                # a trigger waits for a step of a run whose steps may take milliseconds
                time.sleep(0.01 if trigger and trigger.fired_at is None else 0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
    launched = Launched([p.returncode for p in procs], ended, log_dirs, per_node)
    launched.read_rank_output()
    return launched


def sigusr1_to_torchrun(procs: list[subprocess.Popen]) -> None:
    """What a scheduler does before a preemption: SIGUSR1 to (node 0's) torchrun, which forwards it
    to its ranks."""
    procs[0].send_signal(signal.SIGUSR1)


def kill_rank(rank: int, per_node: int) -> Callable[[list[subprocess.Popen]], None]:
    """An action that SIGKILLs global rank `rank` (a child of its node's torchrun), as the kernel's
    OOM killer or a failed host would end it."""
    def act(procs: list[subprocess.Popen]) -> None:
        torchrun = procs[rank // per_node].pid
        pid = rank_pid(torchrun, rank)
        if pid is None:
            raise RunError(f"no process of rank {rank} among the children of torchrun {torchrun}")
        os.kill(pid, signal.SIGKILL)
    return act


def rank_pid(parent: int, rank: int) -> int | None:
    """The process id of the child of `parent` whose environment has RANK=`rank` (Linux /proc)."""
    wanted = f"RANK={rank}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == parent and wanted in (entry / "environ").read_bytes().split(b"\0"):
                return int(entry.name)
        except (OSError, IndexError, ValueError):  # gone meanwhile, or not ours to read
            continue
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- reading a run -----------------------------------------------------------------------------

def logged_steps(metrics: Path) -> int:
    try:
        return sum(1 for line in metrics.read_text().splitlines() if '"loss"' in line)
    except OSError:
        return 0


def complete_checkpoints(dump: Path) -> list[int]:
    """The steps of the run's checkpoints that carry their COMPLETE marker, in order."""
    return sorted(int(p.name.split("-")[1]) for p in (dump / "checkpoint").glob("step-*")
                  if (p / "COMPLETE").is_file())


def checkpoint_ranks(step_dir: Path) -> list[int]:
    """The ranks that wrote a file of the checkpoint `step_dir` (DCP's `__<rank>_<n>.distcp`)."""
    return sorted({int(p.name.split("_")[2]) for p in step_dir.glob("__*_*.distcp")})


def losses(dump: Path) -> dict[int, float]:
    """The run's loss at each step (the last value logged for it)."""
    return {r["step"]: r["loss"] for r in read_metrics(dump / "metrics.jsonl")}


def data_parallel_kind(output: str) -> str:
    """How a run split the model over its ranks, from its first "data parallel:" line (without the
    reason and the memory estimates that follow it in brackets); "one rank" without one."""
    choice = [line for line in output.splitlines() if "data parallel:" in line]
    return choice[0].split("data parallel:", 1)[1].split(" (", 1)[0].strip() if choice else "one rank"


def tail(path: Path, lines: int = 25) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


# ---- the preempt check -------------------------------------------------------------------------

def preempt_and_resume(keys: list[str], dump: Path, log: Path, gpus: int, reference: dict[int, float], *,
                       device: str, timeout: float, nodes: int = 1) -> dict:
    """SIGUSR1 to torchrun once half of the steps of `reference` (the uninterrupted run's loss at
    each step) are logged: every rank must stop at the same step and write its part of that step's
    checkpoint, the only COMPLETE one; the same command (`keys`, checkpoints on) again resumes. The
    loss of every step, those logged before the stop (the same run started twice must log the same
    numbers) and those after the resume, must equal `reference`'s, bitwise."""
    steps = max(reference)
    half = steps // 2
    metrics = dump / "metrics.jsonl"
    trigger = Trigger(lambda: logged_steps(metrics) >= half, sigusr1_to_torchrun)
    stopped = launch(keys, log, gpus, device=device, timeout=timeout, nodes=nodes, trigger=trigger)
    saved = complete_checkpoints(dump)
    rank_stops = {}
    for rank, text in stopped.rank_output.items():
        found = STOP_LINE.findall(text)
        rank_stops[rank] = int(found[-1][1]) if found else None
    problems = []
    if trigger.fired_at is None:
        problems.append(f"the run ended before step {half} was logged (exit codes {stopped.codes})")
    if len(saved) != 1 or not half <= saved[0] < steps:
        problems.append(f"expected one complete checkpoint between steps {half} and {steps - 1}, found {saved}")
    step = saved[-1] if saved else None
    if set(rank_stops.values()) != {step}:
        problems.append(f"the ranks stopped at steps {rank_stops} (rank: step), not all at {step}")
    writers = checkpoint_ranks(dump / "checkpoint" / f"step-{step}") if step is not None else []
    if writers != list(range(gpus)):
        problems.append(f"ranks {writers} wrote the checkpoint of step {step}, not all {gpus}")
    diffs = []
    if step is not None:  # nothing to resume from otherwise
        resumed = launch(keys, log, gpus, device=device, timeout=timeout, nodes=nodes)
        if any(resumed.codes):
            problems.append(f"the resumed run exited with {resumed.codes}")
        got = losses(dump)
        compared = range(1, steps + 1)
        missing = [s for s in compared if s not in got]
        if missing:
            problems.append(f"no loss logged at steps {missing}")
        diffs = [abs(got[s] - reference[s]) for s in compared if s in got]
        differ = [s for s in compared if s in got and got[s] != reference[s]]
        if differ:
            before = [s for s in differ if s <= step]
            problems.append(f"losses differ from the uninterrupted run's at steps {differ} ({len(before)} of them "
                            f"before the stop at step {step}), by up to {max(diffs):.3g}")
    equal = bool(diffs) and max(diffs) == 0.0
    if problems:
        print(f"preempt: {'; '.join(problems)}; log {log}:\n{tail(log)}", file=sys.stderr, flush=True)
    return {"gpus": gpus, "signalled_after_step": half, "stopped_at_step": step, "exit_codes": stopped.codes,
            "rank_stop_steps": rank_stops, "checkpoint_ranks": writers, "compared_steps": len(diffs),
            "max_abs_loss_diff": max(diffs) if diffs else None, "problems": problems,
            "passed": equal and not problems}


# ---- the tools' process ------------------------------------------------------------------------

def tool_parser(doc: str, *, nproc: int, steps: int, out: str, timeout: float) -> argparse.ArgumentParser:
    """The argument parser of a tool whose module docstring is `doc` (its first paragraph the
    description, the rest the epilog), with the options of its launches and these defaults."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n", 1)[0], epilog=doc.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=nproc, help="GPUs (processes) P of the multi-GPU runs")
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", default=out)
    parser.add_argument("--timeout", type=float, default=timeout, help="seconds one launch may take")
    return parser


def pick(option: str, text: str, names: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """The names in `text` (option `option`'s comma-separated value) in the order of `names`, and
    the problems with it (unknown names, none at all)."""
    requested = [name for name in text.split(",") if name]
    unknown = [name for name in requested if name not in names]
    chosen = [name for name in names if name in requested]
    problems = [f"{option}: unknown {unknown}; choose from {','.join(names)}"] if unknown else []
    if not chosen and not unknown:
        problems.append(f"{option}: none given")
    return chosen, problems


def nproc_problems(nproc: int) -> list[str]:
    """Two halves of the processes are the two "nodes" of this host: an even count of two or more."""
    return [] if nproc >= 2 and nproc % 2 == 0 else [f"--nproc must be even and >= 2, got {nproc}"]


def stop_on_sigterm(signum, frame):
    """`timeout` and schedulers stop a job with SIGTERM: leave through `launch`'s cleanup, which
    kills the running ranks (they live in sessions of their own)."""
    raise KeyboardInterrupt(f"signal {signum}")


def device_name(device: str) -> str:
    if device == "cpu":
        return f"CPU ({os.cpu_count()} cores)"
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count(), "
                            "torch.cuda.get_device_name(0))"], capture_output=True, text=True)
    count, _, name = probe.stdout.strip().partition(" ")
    return f"{count}x {name}" if probe.returncode == 0 else "unknown GPU"
