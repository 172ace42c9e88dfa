"""flame.weights reads a run's checkpoint (flame.weights.layout, flame.weights.dcp_reader): the
step folder a path names, the run's config, the model's tensors whatever the number of saving
ranks, and one-line errors for what is missing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flame.weights import find_step_dir, load_model, read_exported, read_model_state_dict
from tests.export.helpers import (
    FAMILIES,
    FLA_EPS,
    STEPS,
    assert_same_weights,
    batches,
    export,
    leftovers,
    run_config,
    run_export,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("family", FAMILIES)
def test_reader_gives_the_trained_weights_and_the_run_config(runs, family):
    step_dir = find_step_dir(runs["root"] / family)
    assert step_dir.name == f"step-{STEPS}"
    assert find_step_dir(step_dir.parent) == step_dir == find_step_dir(step_dir)
    state = read_model_state_dict(step_dir)
    assert_same_weights(runs[family].model.state_dict(), state, family)
    model, args, tokenizer = load_model(runs["root"] / family)
    assert args.family == family and args.vocab_size == 256 and tokenizer == str(runs["tokenizer"])
    assert_same_weights(runs[family].model.state_dict(), model.state_dict(), family)


def test_checkpoint_without_complete_marker(runs, tmp_path, capsys):
    dump = tmp_path / "dump"
    shutil.copytree(runs["root"] / "rwkv7", dump)
    (dump / "checkpoint" / f"step-{STEPS}" / "COMPLETE").unlink()
    for source in (dump, dump / "checkpoint" / f"step-{STEPS}"):
        code, err = run_export(capsys, source, tmp_path / "out")
        assert code == 1 and "\n" not in err and "COMPLETE" in err, err
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_missing_step(runs, tmp_path, capsys):
    code, err = run_export(capsys, runs["root"] / "rwkv7", tmp_path / "new" / "out", "--step", "7")
    assert code == 1 and "\n" not in err and "no checkpoint of step 7" in err and f"[{STEPS}]" in err
    assert list(tmp_path.iterdir()) == []


def test_command_line_error_is_one_line_without_traceback(runs, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-m", "flame.export", "--checkpoint", str(tmp_path / "nowhere"),
                             "--out", str(tmp_path / "out")], capture_output=True, text=True, env=env, cwd=REPO)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [f"flame.export: error: checkpoint path {tmp_path / 'nowhere'} does not exist"]


def two_rank_run(rank: int, root: str, tokenizer: str) -> None:
    """2 FSDP ranks train on the rows of the 1-process run and save step 3; rank 0 exports it;
    both then start a new run from that export (a sharded import) and save its step 0."""
    import torch.distributed as dist

    from flame.export.writer import export_checkpoint
    from flame.train.trainer import Trainer
    from tests.train.test_distributed import full_params

    root = Path(root)
    trainer = Trainer(run_config("rwkv7", root / "ranks2", Path(tokenizer)),
                      dataloader=batches(rows=slice(rank, rank + 1)))
    trainer.train()
    trained = full_params(trainer.model)
    if rank == 0:
        torch.save(trained, root / "ranks2.pt")
        export_checkpoint(root / "ranks2", root / "ranks2-hf")
    dist.barrier()
    cfg = run_config("rwkv7", root / "ranks2-continued", Path(tokenizer), model={"group_norm_eps": FLA_EPS["rwkv7"]},
                     checkpoint={"initial_load_path": str(root / "ranks2-hf")})
    continued = Trainer(cfg, dataloader=[])
    imported = full_params(continued.model)
    assert imported.keys() == trained.keys()
    for name, value in trained.items():
        assert torch.equal(imported[name], value), name
    continued.save_checkpoint()


def test_two_process_checkpoint_exports_the_same_weights(runs, tmp_path):
    """The export of a 2-rank checkpoint holds the weights the ranks held (every shard in its
    place); the same weights saved by 2 ranks and by 1 rank export bitwise equal (as fla folders:
    the continued runs compute with fla's GroupNorm eps)."""
    from flame.train.trainer import Trainer
    from tests.train.test_distributed import spawn

    spawn(two_rank_run, str(tmp_path), str(runs["tokenizer"]))
    gathered = torch.load(tmp_path / "ranks2.pt")
    _, exported, _ = read_exported(tmp_path / "ranks2-hf")
    assert_same_weights(gathered, exported, "2-rank export")
    cfg = run_config("rwkv7", tmp_path / "ranks1-continued", runs["tokenizer"],
                     model={"group_norm_eps": FLA_EPS["rwkv7"]},
                     checkpoint={"initial_load_path": str(tmp_path / "ranks2-hf")})
    Trainer(cfg, dataloader=[]).save_checkpoint()
    for ranks in (1, 2):
        out = tmp_path / f"ranks{ranks}-step0"
        assert export(tmp_path / f"ranks{ranks}-continued", out, "--step", "0", "--format", "fla") == 0
        _, weights, _ = read_exported(out)
        assert_same_weights(gathered, weights, f"{ranks}-rank checkpoint")
