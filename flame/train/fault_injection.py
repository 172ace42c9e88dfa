"""Test hook: deterministic faults at named points of a run, chosen by an environment variable.

`FLAME_FAULT_INJECT="POINT:STEP[:ACTION][:rank=R][:attempt=A],..."` makes the process act when
it reaches POINT during optimizer step STEP. The points:

    forward     the model's forward of step STEP (inside the step)
    update      right after step STEP's optimizer update, before it is logged or saved
    boundary    step STEP finished and logged, before its save decision (between steps)
    save-start  the step-STEP checkpoint folder exists, no shard written yet
    save        the shards and metadata of step STEP are written, its COMPLETE marker is not
    purge       step STEP is COMPLETE, older checkpoints not yet pruned (checkpoint.keep_latest_k)

ACTION is `kill` (SIGKILL itself; the default), `hang` (sleep until killed), `sleep=SECONDS`, or
a signal name (SIGTERM, SIGUSR1, ...) sent to itself. `rank=R` limits the fault to global rank R,
`attempt=A` to torchrun's restart A (TORCHELASTIC_RESTART_COUNT). Each fault acts once.

tests/train/test_faults.py drives it. When the variable is unset (every real run), `arm` returns
at once and `fault_point` is one test of an empty dict.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

ENV_VAR = "FLAME_FAULT_INJECT"
POINTS = ("forward", "update", "boundary", "save-start", "save", "purge")


@dataclass(frozen=True)
class Fault:
    point: str
    step: int
    action: str = "kill"
    rank: int | None = None
    attempt: int | None = None

    def applies_here(self) -> bool:
        rank = int(os.environ.get("RANK", "0"))
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        return (self.rank is None or self.rank == rank) and (
            self.attempt is None or self.attempt == attempt)


def parse_faults(text: str) -> dict[tuple[str, int], list[Fault]]:
    """{(point, step): faults} from the variable's value; a malformed entry is a ValueError."""
    plan: dict[tuple[str, int], list[Fault]] = {}
    for entry in filter(None, (part.strip() for part in text.split(","))):
        fields = entry.split(":")
        if len(fields) < 2 or fields[0] not in POINTS or not fields[1].isdigit():
            raise ValueError(f"{ENV_VAR}: {entry!r} is not POINT:STEP[:ACTION][:rank=R][:attempt=A] "
                             f"with POINT one of {', '.join(POINTS)}")
        options = {"action": "kill"}
        for option in fields[2:]:
            name, _, value = option.partition("=")
            if name in ("rank", "attempt") and value.isdigit():
                options[name] = int(value)
            elif name in ("kill", "hang") or (name == "sleep" and value):
                options["action"] = option
            elif name.startswith("SIG") and hasattr(signal, name):
                options["action"] = name
            else:
                raise ValueError(f"{ENV_VAR}: unknown option {option!r} in {entry!r}")
        fault = Fault(fields[0], int(fields[1]), **options)
        plan.setdefault((fault.point, fault.step), []).append(fault)
    return plan


PLAN = parse_faults(os.environ.get(ENV_VAR, ""))
_done: set[Fault] = set()


def fault_point(point: str, step: int) -> None:
    """Act on the faults planned for `point` at `step` (nothing when none are)."""
    if not PLAN:
        return
    for fault in PLAN.get((point, step), ()):
        if fault in _done or not fault.applies_here():
            continue
        _done.add(fault)
        act(fault)


def act(fault: Fault) -> None:
    print(f"fault injection: {fault.action} at {fault.point} of step {fault.step} "
          f"(pid {os.getpid()})", flush=True)
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.action == "hang":
        while True:
            time.sleep(3600)
    elif fault.action.startswith("sleep="):
        time.sleep(float(fault.action.partition("=")[2]))
    else:
        os.kill(os.getpid(), getattr(signal, fault.action))


def arm(trainer) -> None:
    """Hook the points inside a step into `trainer`'s model and optimizer (when any is planned).

    The hooks count from the step the run starts at, one step per gradient_accumulation_steps
    forwards in training mode and per optimizer update: the loop may queue step N+1 before it
    counts step N. (A non-finite step that reloads a checkpoint throws the count off.)"""
    if not PLAN or getattr(trainer, "faults_armed", False):
        return
    trainer.faults_armed = True
    planned = {point for point, _ in PLAN}
    start, per_step = trainer.state.step, trainer.cfg.training.gradient_accumulation_steps
    forwards, updates = [0], [0]

    def on_forward(module, args):
        if module.training:
            forwards[0] += 1
            fault_point("forward", start + (forwards[0] + per_step - 1) // per_step)

    def on_update(optimizer, args, kwargs):
        updates[0] += 1
        fault_point("update", start + updates[0])

    if "forward" in planned:
        trainer.model.register_forward_pre_hook(on_forward)
    if "update" in planned:
        trainer.optimizer.register_step_post_hook(on_update)
