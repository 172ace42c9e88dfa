"""One run per dump folder: an exclusive lock file, `<job.dump_folder>/.flame.lock`.

Rank 0 creates the file atomically (O_CREAT | O_EXCL) before the run writes anything into the
folder. Its JSON body names the holder: host, pid, the process's start time (from /proc), the
run's start time, job name, Slurm job id and restart count. The run removes it when it ends
(normally, on an exception, on a stop signal). A run that finds the file:

- takes it over, with a warning, when the holder is known to be gone: a process on this host that
  no longer runs (its pid is free, a zombie, or now another process), an earlier incarnation of
  this same Slurm job (a requeue: Slurm runs one incarnation at a time), or this very process (a
  Trainer that was never closed);
- takes it over whoever holds it with `job.force_unlock = true`;
- otherwise refuses to start, naming the holder.

A SIGKILLed run leaves the file behind; the next run on the same host takes it over.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

import torch.distributed as dist

logger = logging.getLogger("flame.train")

LOCK_NAME = ".flame.lock"


class RunLockedError(RuntimeError):
    """The dump folder is locked by another run that may be alive."""


class DumpFolderError(RuntimeError):
    """The dump folder cannot be created or written (a permission, a missing or read-only
    file system, a file in the way); the message names the folder and the cause."""


def dump_folder_error(folder: Path, err: OSError) -> DumpFolderError:
    """The error of `folder` that cannot be created or written: the cause, at the nearest path
    that exists (a file in the way, a folder this user cannot write)."""
    existing = next(p for p in [folder, *folder.absolute().parents] if p.exists() or p.is_symlink())
    if existing.is_symlink() and not existing.exists():
        cause = f"{existing} is a link to {os.readlink(existing)}, which does not exist"
    elif not existing.is_dir():
        cause = f"{existing} is a file, not a folder"
    elif isinstance(err, PermissionError):
        cause = f"permission denied: this user cannot write to {existing}"
    else:
        cause = (err.strerror or type(err).__name__).lower()
        if err.filename and str(err.filename) != str(folder):
            cause += f" ({err.filename})"
    return DumpFolderError(f"job.dump_folder {folder} cannot be created or written: {cause}; "
                           f"choose another with --job.dump_folder")


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state first; the start time, in
    clock ticks since boot, 20th); None when unknown (no /proc, no such process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2:].split()  # after "pid (command) "


def process_start_ticks(pid: int) -> int | None:
    fields = proc_stat(pid)
    return int(fields[19]) if fields and len(fields) > 19 else None


def process_alive(pid: int, start_ticks: int | None) -> bool:
    """Whether `pid` on this host is still the process that took the lock."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    fields = proc_stat(pid)
    if fields and fields[0] == "Z":  # a zombie: dead, not yet reaped by its parent
        return False
    current = process_start_ticks(pid)
    return start_ticks is None or current is None or current == start_ticks


@dataclass
class LockHolder:
    host: str
    pid: int
    pid_start_ticks: int | None
    started: str
    job: str
    slurm_job_id: str | None
    slurm_restart_count: int | None

    @classmethod
    def this_process(cls, job: str) -> LockHolder:
        restarts = os.environ.get("SLURM_RESTART_COUNT")
        return cls(host=socket.gethostname(), pid=os.getpid(),
                   pid_start_ticks=process_start_ticks(os.getpid()),
                   started=datetime.now().astimezone().isoformat(timespec="seconds"), job=job,
                   slurm_job_id=os.environ.get("SLURM_JOB_ID"),
                   slurm_restart_count=int(restarts) if restarts and restarts.isdigit() else None)

    @classmethod
    def parse(cls, text: str) -> LockHolder:
        data = json.loads(text)
        return cls(**{name: data.get(name) for name in cls.__dataclass_fields__})

    def describe(self) -> str:
        slurm = f", Slurm job {self.slurm_job_id}" if self.slurm_job_id else ""
        return f"job {self.job!r}, pid {self.pid} on host {self.host}{slurm}, started {self.started}"


class RunLock:
    """The lock of one dump folder; `acquire()` and `release()` are for rank 0 only."""

    def __init__(self, dump_folder: str | Path, job_name: str, force: bool = False):
        self.path = Path(dump_folder) / LOCK_NAME
        self.job_name = job_name
        self.force = force
        self.body: str | None = None  # what this process wrote, while it holds the lock

    @property
    def held(self) -> bool:
        return self.body is not None

    def acquire(self) -> None:
        """Create the lock file, or take over a stale one; RunLockedError when it is held."""
        if self.held:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise dump_folder_error(self.path.parent, err) from err
        me = LockHolder.this_process(self.job_name)
        body = json.dumps(asdict(me), indent=1) + "\n"
        for _ in range(20):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                seen = self.read()
                if seen is None:  # removed meanwhile, or its holder is still writing it
                    time.sleep(0.05)
                    continue
                reason = self.takeover_reason(seen, me)
                if reason is None:
                    raise RunLockedError(self.refusal(seen))
                self.take_over(seen, reason)
                continue
            except OSError as err:
                raise dump_folder_error(self.path.parent, err) from err
            with os.fdopen(fd, "w") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            self.body = body
            atexit.register(self.release)
            return
        raise RunLockedError(f"could not lock the dump folder: {self.path} keeps changing (other "
                             f"runs are starting on {self.path.parent})")

    def read(self) -> tuple[str, LockHolder | None] | None:
        """(the file's text, its holder or None when unreadable); None when there is no file or
        it was created a moment ago and its body is not written yet."""
        try:
            text = self.path.read_text()
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return None
        try:
            return text, LockHolder.parse(text)
        except (ValueError, TypeError):
            return None if age < 2.0 else (text, None)

    def takeover_reason(self, seen: tuple[str, LockHolder | None], me: LockHolder) -> str | None:
        """Why the lock in `seen` can be taken over; None when its holder may be alive."""
        _, holder = seen
        if self.force:
            return "job.force_unlock = true"
        if holder is None:
            return None
        if holder.host == me.host:
            if holder.pid == me.pid and holder.pid_start_ticks == me.pid_start_ticks:
                return "it is this process's own lock, from a run that was not closed"
            if not process_alive(holder.pid, holder.pid_start_ticks):
                return f"its process {holder.pid} no longer runs on this host"
        if (holder.slurm_job_id and holder.slurm_job_id == me.slurm_job_id
                and (holder.slurm_restart_count or 0) < (me.slurm_restart_count or 0)):
            return f"it is from an earlier run of Slurm job {holder.slurm_job_id} (requeued since)"
        return None

    def refusal(self, seen: tuple[str, LockHolder | None]) -> str:
        text, holder = seen
        who = holder.describe() if holder else f"an unreadable lock ({text[:200]!r})"
        return (f"dump folder {self.path.parent} is in use by {who} (lock file {self.path}): two "
                f"runs on one folder overwrite each other's checkpoints and metrics. Stop that run "
                f"or choose another job.dump_folder; if that run is gone (killed on another host, "
                f"say), start with --job.force_unlock true")

    def take_over(self, seen: tuple[str, LockHolder | None], reason: str) -> None:
        """Remove the lock file read as `seen`, unless another run replaced it in the meantime."""
        text, holder = seen
        moved = self.path.with_name(f"{LOCK_NAME}.stale-{socket.gethostname()}-{os.getpid()}")
        try:
            os.rename(self.path, moved)
        except FileNotFoundError:
            return  # another run moved it first: acquire() tries again
        if moved.read_text() != text:  # a new holder came in between: give its lock back
            try:
                os.link(moved, self.path)
            except FileExistsError:
                pass
            moved.unlink()
            return
        moved.unlink()
        who = holder.describe() if holder else f"an unreadable lock ({text[:200]!r})"
        logger.warning("dump folder %s: taking over the lock of %s: %s", self.path.parent, who, reason)

    def release(self) -> None:
        """Remove the lock file if this process still holds it (idempotent)."""
        if self.body is None:
            return
        try:
            if self.path.read_text() == self.body:
                self.path.unlink()
        except FileNotFoundError:
            pass
        self.body = None
        atexit.unregister(self.release)


def lock_dump_folder(lock: RunLock, parallel) -> None:
    """Rank 0 acquires `lock`; a refusal (or a folder it cannot create) stops every rank, with
    rank 0's error."""
    refusal = None
    if parallel.rank == 0:
        try:
            lock.acquire()
        except (RunLockedError, DumpFolderError) as err:
            refusal = err
    if parallel.distributed and parallel.world_size > 1:
        shared = [None if refusal is None else type(refusal)(str(refusal))]
        dist.broadcast_object_list(shared, src=0)
        refusal = refusal or shared[0]
    if refusal is not None:
        raise refusal

