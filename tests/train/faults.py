"""Launching, faulting and reading the runs of the fault tests (tests/train/test_two_rank_faults.py,
test_sigkill_resume.py, test_stop_signals.py, test_slurm_requeue.py and others); `torchrun` also
launches tests/train/test_two_gpus.py's ranks.

Every run is `python -m flame.train` in a subprocess (one process, or ranks over gloo without a
launcher, or torchrun), on one shared config file: a tiny RWKV7 on CPU reading pre-tokenized
shards, checkpoints every 3 steps, the two newest kept, fused AdamW (so the loop queues step N+1
before it reads step N, as on GPUs). FLAME_FAULT_INJECT
(flame/train/fault_injection.py) places the faults; OMP_NUM_THREADS=1 keeps every process's float
arithmetic in the same order, so that runs are comparable bitwise.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from flame.config import to_toml
from tests.train.helpers import tiny_config
from tests.train.ranks import rank_environment, rendezvous_store

ROOT = Path(__file__).resolve().parents[2]
STEPS = 12
INTERVAL = 3


def write_config(folder: Path) -> Path:
    """Tokenize the embedded corpus into shards once, and write the config file of every run."""
    from flame.data.prepare import main as prepare

    cfg = tiny_config(folder / "unused", training={"steps": STEPS, "seq_len": 32, "batch_size": 2},
                      checkpoint={"enable": True, "interval": INTERVAL, "keep_latest_k": 2},
                      lr_scheduler={"warmup_steps": 2, "decay_type": "cosine", "lr_min": 1e-4},
                      optimizer={"implementation": "fused"})  # the GPU configs' pipelined loop
    path = folder / "faults.toml"
    path.write_text(to_toml(cfg))
    prepare(["--config", str(path), "--out", str(folder / "shards")])
    cfg.data.shard_dir = str(folder / "shards")
    path.write_text(to_toml(cfg))
    return path


def environment(faults: str = "", **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("FLAME_FAULT_INJECT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                        "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE",
                        "SLURM_JOB_ID")}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", FLAME_FAULT_INJECT=faults, **extra)
    return env


def train_command(config: Path, dump: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "flame.train", "--config", str(config),
            "--job.dump_folder", str(dump), *overrides]


@dataclass
class Finished:
    returncode: int
    output: str


def run(config: Path, dump: Path, *overrides: str, faults: str = "", timeout: float = 120) -> Finished:
    """One process to its end (a fault may end it early)."""
    done = subprocess.run(train_command(config, dump, *overrides), env=environment(faults),
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return Finished(done.returncode, done.stdout + done.stderr)


def start(config: Path, dump: Path, *overrides: str, faults: str = "", log: Path) -> subprocess.Popen:
    """One process in the background, its output into `log`."""
    with open(log, "w") as out:
        return subprocess.Popen(train_command(config, dump, *overrides), env=environment(faults),
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)


def start_ranks(config: Path, dump: Path, *overrides: str, faults: str = "", world: int = 2,
                tag: str = "run") -> list[tuple[subprocess.Popen, Path]]:
    """`world` ranks joined over gloo, each a plain process (no launcher watching them), meeting at
    a store that this process hosts (tests/train/ranks.py) as long as any rank's Popen lives; rank
    r logs to `<dump>.<tag>.rank<r>.log`."""
    store, ranks = rendezvous_store(world), []
    for rank in range(world):
        env = environment(faults, **rank_environment(store, rank, world))
        log = dump.parent / f"{dump.name}.{tag}.rank{rank}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(train_command(config, dump, *overrides), env=env, cwd=ROOT,
                                    stdout=out, stderr=subprocess.STDOUT)
        proc.rendezvous_store = store
        ranks.append((proc, log))
    return ranks


PORT_ATTEMPTS = 3


def free_port() -> int:
    """A port that was free a moment ago, for a launcher that binds a port it is given (torchrun
    through launch/train.sh): another process can take it before the launcher binds it, so the
    caller starts again on another one when `port_taken` says so. Ranks that the tests start
    themselves meet at a store this process holds instead (tests/train/ranks.py)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_taken(output: str) -> bool:
    """Whether a launch's output says that its store could not bind its port (TCPStore's error)."""
    return "EADDRINUSE" in output or "address already in use" in output.lower()


def wait_all(ranks, timeout: float = 120) -> list[Finished]:
    deadline = time.monotonic() + timeout
    finished = []
    for proc, log in ranks:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for other, _ in ranks:
                other.kill()
            raise AssertionError(f"ranks still running after {timeout}s; logs: "
                                 + ", ".join(str(log) for _, log in ranks))
        finished.append(Finished(proc.returncode, log.read_text()))
    return finished


def torchrun(config: Path, dump: Path, *overrides: str, faults: str = "", nproc: int = 2,
             max_restarts: int = 0, timeout: float = 240, module: str = "flame.train") -> Finished:
    """`module` (flame.train, or a test's own program that reads flame's command line) under
    torchrun on `nproc` ranks of this machine; torchrun's --standalone rendezvous binds its own port."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
               "--monitor-interval", "0.2", "-m", module, "--config", str(config),
               "--job.dump_folder", str(dump), *overrides]
    done = subprocess.run(command, env=environment(faults), cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    return Finished(done.returncode, done.stdout + done.stderr)


def wait_for(predicate, timeout: float = 60, what: str = "a condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def metrics(dump: Path) -> list[dict]:
    path = dump / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def losses(dump: Path) -> dict[int, float]:
    """step -> loss, the last logged value of each step (a resumed run logs some steps again)."""
    return {r["step"]: r["loss"] for r in metrics(dump) if "loss" in r}


def complete_steps(dump: Path) -> list[int]:
    folder = dump / "checkpoint"
    if not folder.is_dir():
        return []
    return sorted(int(p.name.split("-")[1]) for p in folder.iterdir() if (p / "COMPLETE").is_file())


def checkpoint_tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint (model and optimizer state), read without ranks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(step_dir)).read_metadata()
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in metadata.state_dict_metadata.items()
             if isinstance(meta, TensorStorageMetadata)}
    dcp.load(state, checkpoint_id=str(step_dir), no_dist=True)
    return state


def resumed_from(output: str) -> int | None:
    """The step a run resumed from, from its log; None when it started at step 0."""
    for line in output.splitlines():
        if "resumed from " in line and "/step-" in line:
            return int(line.split("/step-")[1].split(":")[0])
    return None


def send_when(proc: subprocess.Popen, sig: signal.Signals, ready, timeout: float = 60) -> None:
    wait_for(lambda: ready() or proc.poll() is not None, timeout, f"the moment to send {sig.name}")
    assert proc.poll() is None, "the run ended before the signal was sent"
    proc.send_signal(sig)


def assert_same_run(dump, reference, steps=STEPS):
    """`dump` ended where the reference did, bitwise: every logged loss (each restart's, repeated
    steps included; not the resume markers) and every tensor of the final checkpoint."""
    ref_losses, ref_tensors = reference
    for record in (r for r in metrics(dump) if "loss" in r):
        assert record["loss"] == ref_losses[record["step"]], record
    assert sorted(losses(dump)) == list(range(1, steps + 1))
    final = checkpoint_tensors(dump / "checkpoint" / f"step-{steps}")
    assert final.keys() == ref_tensors.keys()
    for key, value in ref_tensors.items():
        assert torch.equal(final[key], value), key
