"""One run per dump folder: a second run on the folder is refused, a lock held by a live process names
it, stale locks (a dead or SIGKILLed process) are taken over, other hosts' locks need a force unlock."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from flame.train.run_lock import LOCK_NAME, LockHolder, RunLock, RunLockedError
from tests.train.faults import run, start, wait_for


@pytest.mark.slow
def test_a_second_run_on_the_folder_is_refused_and_a_killed_runs_lock_taken_over(config, tmp_path):
    dump = tmp_path / "locked"
    first = start(config, dump, faults="forward:2:hang", log=tmp_path / "first.log")
    try:
        wait_for(lambda: "fault injection: hang" in (tmp_path / "first.log").read_text(), 60,
                 "the first run to hold the lock")
        second = run(config, dump, "--training.steps", "2")
        assert second.returncode == 1, second.output
        assert f"dump folder {dump} is in use by job 'flame', pid {first.pid} on host" in second.output
        assert "--job.force_unlock true" in second.output
    finally:
        first.kill()
        first.wait()
    third = run(config, dump, "--training.steps", "2")
    assert third.returncode == 0, third.output
    assert f"taking over the lock of job 'flame', pid {first.pid}" in third.output
    assert not (dump / LOCK_NAME).exists()


def write_lock(folder, **changes) -> RunLock:
    holder = LockHolder.this_process("other")
    for name, value in changes.items():
        setattr(holder, name, value)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / LOCK_NAME).write_text(json.dumps(dataclasses.asdict(holder)))
    return RunLock(folder, "mine")


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_lock_held_by_a_live_process_is_refused_and_names_it(tmp_path):
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        lock = write_lock(tmp_path, pid=sleeper.pid, pid_start_ticks=None)
        with pytest.raises(RunLockedError, match=rf"in use by job 'other', pid {sleeper.pid} on host"):
            lock.acquire()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_stale_locks_are_taken_over(tmp_path, flame_log):
    lock = write_lock(tmp_path / "dead", pid=dead_pid())
    lock.acquire()
    assert lock.held and "no longer runs on this host" in flame_log[-1]
    lock.release()
    assert not (tmp_path / "dead" / LOCK_NAME).exists()
    # a pid that now belongs to another process (its start time differs)
    lock = write_lock(tmp_path / "reused", pid=os.getpid(), pid_start_ticks=1)
    lock.acquire()
    lock.release()


def test_other_hosts_locks_need_force_unlock_unless_from_the_same_slurm_job(tmp_path, monkeypatch):
    with pytest.raises(RunLockedError, match="pid 4242 on host elsewhere"):
        write_lock(tmp_path / "a", host="elsewhere", pid=4242).acquire()
    lock = write_lock(tmp_path / "b", host="elsewhere", pid=4242)
    lock.force = True
    lock.acquire()
    lock.release()
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # a requeue of job 77 on another node
    lock = write_lock(tmp_path / "c", host="elsewhere", pid=4242, slurm_job_id="77",
                      slurm_restart_count=0)
    lock.acquire()
    lock.release()
    with pytest.raises(RunLockedError):  # the same incarnation: maybe another step of it
        write_lock(tmp_path / "d", host="elsewhere", pid=4242, slurm_job_id="77",
                   slurm_restart_count=1).acquire()


def test_release_leaves_a_lock_that_another_run_took(tmp_path):
    lock = RunLock(tmp_path, "mine")
    lock.acquire()
    (tmp_path / LOCK_NAME).write_text('{"host": "x", "pid": 1}')  # forced away by another run
    lock.release()
    assert (tmp_path / LOCK_NAME).exists()


def test_a_dump_folder_that_cannot_be_created_is_one_line(tmp_path, monkeypatch, capsys):
    """A file in the way, a link to nowhere, a folder this user cannot write: `flame-train` names
    the folder and the cause in one line and exits 1, before any work."""
    from pathlib import Path

    from flame.train.__main__ import main

    tiny = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"

    def refusal(dump) -> str:
        assert main(["--config", str(tiny), "--job.dump_folder", str(dump), "--training.device", "cpu"]) == 1
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and err.startswith(f"flame-train: DumpFolderError: job.dump_folder {dump} "
                                                  f"cannot be created or written: "), err
        return err

    (tmp_path / "a_file").write_text("")
    assert f"{tmp_path / 'a_file'} is a file, not a folder" in refusal(tmp_path / "a_file" / "run")
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    assert f"{tmp_path / 'link'} is a link to {tmp_path / 'nowhere'}, which does not exist" in refusal(
        tmp_path / "link" / "run")

    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):  # the tests may run as root, whom no permission stops
        if self.is_relative_to(tmp_path / "shared"):
            raise PermissionError(13, "Permission denied", str(self))
        return real_mkdir(self, *args, **kwargs)

    (tmp_path / "shared").mkdir()
    monkeypatch.setattr(Path, "mkdir", mkdir)
    assert f"permission denied: this user cannot write to {tmp_path / 'shared'}" in refusal(
        tmp_path / "shared" / "runs" / "run")
