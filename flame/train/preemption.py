"""Preemption: a stop signal becomes a checkpoint at a step boundary that every rank agrees on.

A run that gets one of `training.stop_signals` (SIGTERM, SIGINT, SIGUSR1 by default) finishes the
optimizer step in flight, saves a checkpoint at that step (the usual COMPLETE-marker protocol),
flushes its metrics and exits with PREEMPTED_EXIT_CODE; a restart resumes from that checkpoint.
The signal handlers only record the signal. Once per step, while the step runs, the trainer asks
`StepBoundary.agree`, whose one host all-reduce (MAX, on the CPU/gloo group: no device sync) of
{the signal received, a timed save due} gives every rank the same answer for the same step: one
rank's signal is enough. The trainer then reads that step's numbers before queuing the next (the
checkpoint must hold exactly that step's weights), saves, and raises `Preempted`.

A second signal while stopping aborts at once with ABORTED_EXIT_CODE: the save in flight is left
without its COMPLETE marker, so the previous complete checkpoint stays the one to resume from.
The same signal again within DUPLICATE_WINDOW_S of the first counts as the first: launchers may
deliver one signal twice (Slurm to every process of a job step, torchrun again to its workers).

The step boundary also watches for a rank that stops: on several GPUs a collective that times out
ends the process from NCCL's watchdog thread, whose message names the collective, not the step;
`StallWarning` names the step first.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("flame.train")

PREEMPTED_EXIT_CODE = 75
"""Stopped by a signal after saving a checkpoint at its last step: resume by running again
(75 is EX_TEMPFAIL, "try again", in sysexits.h)."""
ABORTED_EXIT_CODE = 76
"""A second signal aborted the stop: resume by running again, from the last complete checkpoint
(the steps after it are lost)."""
DUPLICATE_WINDOW_S = 1.0


class Preempted(Exception):
    """The run stopped on a stop signal at a step boundary, after saving a checkpoint there."""

    def __init__(self, step: int, signal_name: str, checkpoint: Path | None):
        self.step = step
        self.signal_name = signal_name
        self.checkpoint = checkpoint
        saved = (f"checkpoint {checkpoint} saved; run again to resume from it" if checkpoint
                 else "no checkpoint saved (checkpoint.enable = false)")
        super().__init__(f"stopped by {signal_name} at step {step}: {saved} "
                         f"(exit code {PREEMPTED_EXIT_CODE}, preempted)")


class StopSignals:
    """Between `install()` and `restore()`: the configured signals request a stop instead of
    taking their default action (SIGINT included: Ctrl-C saves, then exits)."""

    def __init__(self, names: list[str]):
        self.signals = [signal.Signals[name] for name in names]
        self.received: signal.Signals | None = None
        self.received_at = 0.0
        self.stopping_step: int | None = None  # set once every rank agreed to stop
        self.previous: dict[signal.Signals, object] = {}

    @property
    def requested(self) -> bool:
        return self.received is not None

    def install(self) -> None:
        """Handle the signals from now on; a stop requested before is forgotten."""
        self.received, self.stopping_step = None, None
        if not self.signals or self.previous:
            return
        if threading.current_thread() is not threading.main_thread():
            logger.warning("stop signals: training runs outside the main thread, so %s keep "
                           "their default action", ", ".join(s.name for s in self.signals))
            return
        for sig in self.signals:
            self.previous[sig] = signal.signal(sig, self.on_signal)
            signal.siginterrupt(sig, False)  # system calls in flight resume after the handler

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self.previous.clear()

    def on_signal(self, signum: int, frame) -> None:
        now = time.monotonic()
        if self.received is None:
            self.received, self.received_at = signal.Signals(signum), now
            return
        if signum == self.received and now - self.received_at < DUPLICATE_WINDOW_S:
            return
        where = f" at step {self.stopping_step}" if self.stopping_step is not None else ""
        os.write(2, (f"flame: {signal.Signals(signum).name} while stopping on {self.received.name}"
                     f"{where}: aborting now (exit code {ABORTED_EXIT_CODE}); the last complete "
                     f"checkpoint stays the one to resume from (pid {os.getpid()})\n").encode())
        os._exit(ABORTED_EXIT_CODE)


@dataclass
class BoundaryDecision:
    stop: bool
    """A stop signal reached some rank: save at this step and exit."""
    save_due: bool
    """checkpoint.interval_minutes have passed since the last save began (on some rank's clock)."""
    signal_name: str = ""


class StepBoundary:
    """The agreement about every optimizer step's end, the same on every rank: `agree(step)` while
    the step runs, `step_done(step)` once it is done.

    The first agreement also shortens the collectives' timeout from
    parallel.init_timeout_minutes to parallel.collective_timeout_minutes: every rank has then
    queued its first step (setup, checkpoint load and compile are behind it). On several GPUs
    a `StallWarning` then names a step that runs into that timeout. `close()` when done."""

    def __init__(self, parallel, stop_signals: StopSignals, checkpointer,
                 collective_timeout_minutes: float):
        self.parallel = parallel
        self.stop_signals = stop_signals
        self.checkpointer = checkpointer
        self.collective_timeout_minutes = collective_timeout_minutes
        self.first = True
        self.stall_warning: StallWarning | None = None

    def step_done(self, step: int) -> None:
        if self.stall_warning is not None:
            self.stall_warning.step_done(step)

    def agree(self, step: int) -> BoundaryDecision:
        received = self.stop_signals.received
        local = [int(received) if received is not None else 0,
                 int(self.checkpointer.save_due_by_time())]
        signum, save_due = self.parallel.all_reduce_max(local)
        if self.first:
            self.first = False
            self.parallel.set_collective_timeout(self.collective_timeout_minutes)
        if (self.stall_warning is None and self.parallel.device.type == "cuda"
                and self.parallel.world_size > 1):
            self.stall_warning = StallWarning(self.parallel.rank, self.collective_timeout_minutes)
        if not signum:
            return BoundaryDecision(stop=False, save_due=bool(save_due))
        name = signal.Signals(signum).name
        if self.stop_signals.stopping_step is None:
            self.stop_signals.stopping_step = step
            where = "this rank" if received is not None else "another rank"
            logger.info("step %d: %s received (on %s): saving a checkpoint at this step, then "
                        "exiting with code %d (a second signal aborts)", step, name, where,
                        PREEMPTED_EXIT_CODE)
        return BoundaryDecision(stop=True, save_due=bool(save_due), signal_name=name)

    def close(self) -> None:
        """Stop the stall warning's thread (the next decision starts another)."""
        if self.stall_warning is not None:
            self.stall_warning.close()
            self.stall_warning = None


class StallWarning:
    """A thread that warns, once per step, when a step has run for most of the collective timeout.

    On GPUs a collective that times out ends the process from NCCL's watchdog thread, whose
    message names the collective, not the step: this warning comes first and names the step. It
    looks every `poll_seconds` (by default 5 s, or half the time between `fraction` of the timeout
    and the timeout where that is shorter, so that a short timeout is warned of before it ends)."""

    def __init__(self, rank: int, timeout_minutes: float, poll_seconds: float | None = None,
                 fraction: float = 0.9):
        self.rank = rank
        self.limit = 60 * timeout_minutes * fraction
        self.timeout_minutes = timeout_minutes
        self.poll_seconds = (poll_seconds if poll_seconds is not None
                             else min(5.0, 60 * timeout_minutes * (1 - fraction) / 2))
        self.last_step, self.since, self.warned = 0, time.monotonic(), False
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.watch, name="flame-stall-warning", daemon=True)
        self.thread.start()

    def step_done(self, step: int) -> None:
        self.last_step, self.since, self.warned = step, time.monotonic(), False

    def watch(self) -> None:
        while not self.stopped.wait(self.poll_seconds):
            waited = time.monotonic() - self.since
            if not self.warned and waited > self.limit:
                self.warned = True
                logger.warning(
                    "rank %d: no step finished for %.1f min since step %d; collectives time out "
                    "after %g min (parallel.collective_timeout_minutes): if this rank stops then, "
                    "another rank died or hangs in step %d", self.rank, waited / 60,
                    self.last_step, self.timeout_minutes, self.last_step + 1)

    def close(self) -> None:
        self.stopped.set()
