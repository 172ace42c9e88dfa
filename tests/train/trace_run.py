"""`python -m tests.train.trace_run --config FILE [--section.key value ...]` (flame's command
line): the step trace (tests/train/step_check.py) of the config's trainer over TRACE_STEPS steps of
learnable data, TRACE_ROWS rows per step over all data-parallel ranks, each rank its block of them
in micro-batches of training.batch_size rows. Alone it is one rank; under torchrun
(tests/train/test_two_gpus.py) each rank runs it. Rank 0 writes the trace and how the run was
parallelised to `<job.dump_folder>/trace.pt`.
"""

from __future__ import annotations

import sys
from dataclasses import fields
from pathlib import Path

import torch
import torch.distributed as dist

from flame.config import load_config
from flame.train.trainer import Trainer
from tests.train.step_check import StepTrace, learnable_steps, trace_steps

TRACE_STEPS = 6
TRACE_ROWS = 4
TRACE_FILE = "trace.pt"


def main(argv: list[str]) -> None:
    cfg = load_config(argv)
    trainer = Trainer(cfg, dataloader=())
    parallel = trainer.parallel
    steps = learnable_steps(TRACE_STEPS, TRACE_ROWS, cfg.training.seq_len, cfg.training.batch_size,
                            rank=parallel.dp_rank, world=parallel.dp_world_size)
    if len(steps[0]) != cfg.training.gradient_accumulation_steps:
        raise ValueError(f"{TRACE_ROWS} rows over {parallel.dp_world_size} rank(s) in micro-batches of "
                         f"{cfg.training.batch_size} make {len(steps[0])} micro-batches per step, not "
                         f"training.gradient_accumulation_steps = {cfg.training.gradient_accumulation_steps}")
    trace = trace_steps(trainer, steps)
    if trainer.rank == 0:
        record = {f.name: [v.cpu() if torch.is_tensor(v) else v for v in getattr(trace, f.name)]
                  for f in fields(StepTrace)}
        torch.save({"trace": record, "world_size": parallel.world_size, "fsdp": parallel.fsdp,
                    "cuda_graphs": trainer.cuda_graphs, "data_parallel": parallel.data_parallel},
                   Path(cfg.job.dump_folder) / TRACE_FILE)
    if dist.is_initialized():
        dist.destroy_process_group()


def read_trace(dump: Path) -> tuple[StepTrace, dict]:
    """(the trace, what the run was) that rank 0 wrote to `dump`."""
    saved = torch.load(Path(dump) / TRACE_FILE)
    return StepTrace(**saved.pop("trace")), saved


if __name__ == "__main__":
    main(sys.argv[1:])
