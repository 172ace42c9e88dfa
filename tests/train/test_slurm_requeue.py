"""Slurm: the batch script asks for the time-limit signal and requeues; a job that gets it saves,
requeues itself, and the requeued job resumes from the checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from flame.train.run_lock import LOCK_NAME
from tests.train import faults
from tests.train.faults import complete_steps, resumed_from


def test_the_batch_script_asks_for_the_signal_and_requeues():
    sbatch = (faults.ROOT / "launch" / "slurm.sbatch").read_text()
    for script in ("slurm.sbatch", "train.sh"):
        assert subprocess.run(["bash", "-n", str(faults.ROOT / "launch" / script)]).returncode == 0
    directives = [line.split()[1] for line in sbatch.splitlines() if line.startswith("#SBATCH")]
    assert "--signal=B:USR1@300" in directives and "--requeue" in directives
    assert 'scontrol requeue "$SLURM_JOB_ID"' in sbatch and "trap forward_stop USR1" in sbatch
    assert "SIGUSR1" in (faults.ROOT / "launch" / "train.sh").read_text()


def slurm_shims(folder):
    """Stand-ins for srun (runs its command in place) and scontrol (records requeues)."""
    folder.mkdir()
    (folder / "srun").write_text('#!/usr/bin/env bash\nwhile [[ "$1" == --* ]]; do shift; done\n'
                                 'exec "$@"\n')
    (folder / "scontrol").write_text('#!/usr/bin/env bash\ncase "$1" in\n'
                                     '  show) echo 127.0.0.1 ;;\n'
                                     '  requeue) echo "requeue $2" >> "$SCONTROL_LOG" ;;\n'
                                     'esac\n')
    for shim in ("srun", "scontrol"):
        (folder / shim).chmod(0o755)
    return folder


@pytest.mark.slow
def test_slurm_time_limit_signal_saves_requeues_and_the_requeued_job_resumes(config, tmp_path):
    shims, dump, requeues = slurm_shims(tmp_path / "bin"), tmp_path / "slurm-run", tmp_path / "requeues"

    def sbatch(restart: int, fault: str, log_path, ready=lambda text: False):
        """The job, started once more on another port while its torchrun finds the port taken
        (another test process may bind it after `free_port` released it); returned once `ready`
        holds for its log, or once it ended."""
        for _ in range(faults.PORT_ATTEMPTS):
            env = faults.environment(fault, SLURM_NNODES="1", SLURM_JOB_NODELIST="node0",
                                     SLURM_JOB_ID="4242", SLURM_NODEID="0",
                                     SLURM_RESTART_COUNT=str(restart), NGPU="1",
                                     MASTER_PORT=str(faults.free_port()), LOG_DIR=str(tmp_path / "logs"),
                                     SCONTROL_LOG=str(requeues), SHUTDOWN_TIMEOUT="60")
            env["PATH"] = os.pathsep.join([str(shims), os.path.dirname(sys.executable), env["PATH"]])
            with open(log_path, "w") as log:
                job = subprocess.Popen(["bash", "launch/slurm.sbatch", "--config", str(config),
                                        "--job.dump_folder", str(dump)], cwd=faults.ROOT, env=env,
                                       stdout=log, stderr=subprocess.STDOUT)
            faults.wait_for(lambda: ready(log_path.read_text()) or job.poll() is not None, 120, "the job")
            if job.poll() is None or not faults.port_taken(log_path.read_text()):
                return job
        raise AssertionError(f"{faults.PORT_ATTEMPTS} ports in a row were taken: {log_path.read_text()[-2000:]}")

    job = sbatch(0, "forward:3:sleep=4", tmp_path / "first.log",  # step 3 lasts 4 s more: the signal lands in it
                 ready=lambda text: "sleep=4 at forward of step 3" in text)
    faults.send_when(job, signal.SIGUSR1, lambda: True)
    assert job.wait(timeout=120) == 0
    output = (tmp_path / "first.log").read_text()
    assert "SIGUSR1 from Slurm" in output and "stopped by SIGUSR1 at step 3" in output, output
    assert requeues.read_text() == "requeue 4242\n"
    assert complete_steps(dump) == [3] and not (dump / LOCK_NAME).exists()

    assert sbatch(1, "", tmp_path / "second.log").wait(timeout=120) == 0
    output = (tmp_path / "second.log").read_text()
    assert resumed_from(output) == 3 and "exit status 0" in output, output
    assert requeues.read_text() == "requeue 4242\n"  # done: not requeued again
    assert complete_steps(dump) == [9, 12]
