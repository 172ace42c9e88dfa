"""Checkpoints: exact resume, a save interrupted mid-write, corrupt checkpoints, model-only loads."""

import json
import shutil

import pytest
import torch

from flame.train.trainer import Trainer
from flame.weights import WeightsError
from tests.train.helpers import params, tiny_config


def run_config(dump, **checkpoint):
    return tiny_config(
        dump,
        training={"steps": 8, "batch_size": 2, "seq_len": 32, "gradient_accumulation_steps": 2},
        checkpoint={"enable": True, "interval": 4, "keep_latest_k": 0, **checkpoint},
        lr_scheduler={"warmup_steps": 2, "decay_type": "cosine", "lr_min": 1e-4},
    )


def losses(dump) -> dict[int, float]:
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.fixture(scope="module")
def straight_and_resumed(tmp_path_factory):
    """One run of 8 steps straight; one of 4 steps, a 'kill', and a resume to 8 (async saves)."""
    root = tmp_path_factory.mktemp("resume")
    straight = Trainer(run_config(root / "straight"))
    straight.train()
    first = Trainer(run_config(root / "resumed", async_mode="async"))
    first.train(stop_at_step=4)
    # a later save that died mid-write: shards begun, never marked complete
    partial = root / "resumed" / "checkpoint" / "step-6"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"\x00" * 100)
    resumed = Trainer(run_config(root / "resumed", async_mode="async"))
    start_step = resumed.state.step
    resumed.train()
    return root, straight, resumed, start_step


def copy_of_straight_run(straight_and_resumed, dump):
    """A copy of the 8-step run's dump folder (checkpoints at 4 and 8), for a test to damage."""
    root, *_ = straight_and_resumed
    shutil.copytree(root / "straight", dump)
    return dump


def test_resume_reproduces_steps_5_to_8_bitwise(straight_and_resumed):
    root, straight, resumed, start_step = straight_and_resumed
    assert start_step == 4  # the interrupted step-6 save was ignored
    a, b = losses(root / "straight"), losses(root / "resumed")
    assert sorted(b) == list(range(1, 9))
    assert [a[s] for s in range(5, 9)] == [b[s] for s in range(5, 9)]
    for name, value in params(straight.model).items():
        assert torch.equal(value, params(resumed.model)[name]), name
    assert resumed.state.tokens == straight.state.tokens
    assert resumed.lr_scheduler.last_epoch == straight.lr_scheduler.last_epoch == 8


def test_a_save_of_the_same_step_replaces_the_partial_one(straight_and_resumed):
    root, *_ = straight_and_resumed
    complete = sorted(p.name for p in (root / "resumed" / "checkpoint").iterdir()
                      if (p / "COMPLETE").is_file())
    assert complete == ["step-4", "step-8"]


def test_corrupt_checkpoint_gives_a_clear_error(straight_and_resumed, tmp_path):
    dump = copy_of_straight_run(straight_and_resumed, tmp_path / "corrupt")
    shard = next((dump / "checkpoint" / "step-8").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])  # truncated
    with pytest.raises(WeightsError, match=r"step-8 could not be loaded, it is corrupt"):
        Trainer(run_config(dump))


def test_checkpoint_without_metadata_gives_a_clear_error(straight_and_resumed, tmp_path):
    dump = copy_of_straight_run(straight_and_resumed, tmp_path / "partial")
    (dump / "checkpoint" / "step-8" / ".metadata").unlink()
    with pytest.raises(WeightsError, match=r"step-8 is incomplete: its DCP metadata"):
        Trainer(run_config(dump))


def test_missing_load_step_is_named(straight_and_resumed, tmp_path):
    dump = copy_of_straight_run(straight_and_resumed, tmp_path / "copy")
    with pytest.raises(WeightsError, match=r"load_step=6: no complete checkpoint.*\[4, 8\]"):
        Trainer(run_config(dump, load_step=6))


def test_keep_latest_k_keeps_the_newest(straight_and_resumed, tmp_path):
    trainer = Trainer(run_config(tmp_path / "keep", interval=2, keep_latest_k=2))
    trainer.train(stop_at_step=6)
    assert trainer.checkpointer.complete_steps() == [4, 6]


def test_initial_load_model_only_starts_a_new_run(straight_and_resumed, tmp_path):
    root, straight, *_ = straight_and_resumed
    cfg = run_config(tmp_path / "finetune",
                     initial_load_path=str(root / "straight" / "checkpoint" / "step-8"))
    trainer = Trainer(cfg)
    assert trainer.state.step == 0 and trainer.lr_scheduler.last_epoch == 0
    for name, value in params(straight.model).items():
        assert torch.equal(value, params(trainer.model)[name]), name


def test_a_resume_reads_a_threaded_save_and_skips_the_initialisation(straight_and_resumed, tmp_path,
                                                                       monkeypatch):
    """checkpoint.io_threads files per rank come back whole (ParallelFileReader), and a run that
    resumes does not initialise the weights its checkpoint replaces."""
    from flame.models.causal_lm import CausalLM

    root, straight, *_ = straight_and_resumed
    dump = copy_of_straight_run(straight_and_resumed, tmp_path / "copy")
    assert len(list((dump / "checkpoint" / "step-8").glob("__0_*.distcp"))) > 1
    shutil.rmtree(dump / "checkpoint" / "step-8")  # resume from step 4, as a preempted run would
    calls = []
    init = CausalLM.init_weights
    monkeypatch.setattr(CausalLM, "init_weights", lambda model: (calls.append(model), init(model)))
    resumed = Trainer(run_config(dump))
    assert resumed.state.step == 4 and calls == []
    resumed.train()
    assert losses(dump)[8] == losses(root / "straight")[8]
    for name, value in params(straight.model).items():
        assert torch.equal(value, params(resumed.model)[name]), name
    Trainer(run_config(tmp_path / "new"))  # a new run initialises
    assert len(calls) == 1


def test_an_optimizer_state_held_on_the_host_reaches_the_first_update(straight_and_resumed, tmp_path,
                                                                       monkeypatch):
    """A resume under CUDA graphs reads the optimizer's state into host memory and hands it to the
    optimizer before the first update (OptimizerStateOnHost): forced here on the CPU, the run
    continues bitwise as the straight one, moments included."""
    root, straight, *_ = straight_and_resumed
    dump = copy_of_straight_run(straight_and_resumed, tmp_path / "copy")
    shutil.rmtree(dump / "checkpoint" / "step-8")
    load = Trainer.load_full_checkpoint
    monkeypatch.setattr(Trainer, "load_full_checkpoint",
                        lambda self, path, optimizer_on_host=False: load(self, path, optimizer_on_host=True))
    resumed = Trainer(run_config(dump))
    assert resumed.state.step == 4 and resumed.optimizer_on_host is not None
    assert not resumed.optimizer.state  # nothing of it on the optimizer's device yet
    resumed.train()
    assert resumed.optimizer_on_host is None
    assert losses(dump)[8] == losses(root / "straight")[8]
    for name, value in params(straight.model).items():
        assert torch.equal(value, params(resumed.model)[name]), name
    for mine, theirs in zip(resumed.optimizer.state.values(), straight.optimizer.state.values()):
        assert torch.equal(mine["exp_avg_sq"], theirs["exp_avg_sq"])


@pytest.mark.gpu
def test_a_resume_under_cuda_graphs_peaks_no_higher_than_a_new_run(tmp_path):
    """A new run of two steps saves at step 2; a new process resumes it for a third. Its first
    step captures the CUDA graphs with AdamW's moments still on the host (OptimizerStateOnHost),
    so that its peak of allocated memory is the new run's, not the moments' 8 bytes per
    parameter above it."""
    from flame.config import to_toml
    from tests.train.faults import run

    cfg = tiny_config(tmp_path / "run",
                      model={"family": "rwkv7", "hidden_size": 512, "num_layers": 4, "head_dim": 64,
                             "backend": "auto"},
                      training={"device": "cuda", "compile": True, "batch_size": 4, "seq_len": 2048,
                                "gradient_accumulation_steps": 2, "steps": 2},
                      checkpoint={"enable": True, "interval": 2, "keep_latest_k": 0},
                      optimizer={"implementation": "fused"})
    config = tmp_path / "run.toml"
    config.write_text(to_toml(cfg))
    new = run(config, tmp_path / "run", timeout=600)
    assert new.returncode == 0, new.output[-3000:]
    resumed = run(config, tmp_path / "run", "--training.steps", "3", timeout=600)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert "waits in host memory" in resumed.output
    records = {r["step"]: r for r in (json.loads(line) for line in
                                      (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
               if "memory_gib" in r}
    with torch.device("meta"):
        from flame.models import build_model

        moments_gib = 8 * sum(p.numel() for p in build_model(cfg.model).parameters()) / 2**30
    # each record holds its process's peak so far: the new run's over steps 1-2, the resume's
    # over its load and step 3
    excess = records[3]["memory_gib"] - records[2]["memory_gib"]
    assert excess < 0.25 * moments_gib, (records[2]["memory_gib"], records[3]["memory_gib"], moments_gib)
