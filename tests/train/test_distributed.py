"""Two CPU processes (gloo; replicated, and sharded by FSDP2) against one: the loss normalisation
across ranks (docs/known-failures.md#loss-scaled-by-gradient-accumulation), and resume.

Each test spawns 2 ranks with torch.multiprocessing; the ranks write what they saw to files that
the test (the parent process) compares with a single-process run.
"""

from __future__ import annotations

import json
import os
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from flame.train import accumulation
from flame.train.checkpoint import CheckpointError
from flame.train.fsdp import fsdp_modules
from flame.train.trainer import Trainer
from tests.train.helpers import params, random_batches, split_rows, tiny_config
from tests.train.ranks import rank_environment, rendezvous_store
from tests.train.step_check import full

WORLD = 2
SEQ = 16
STEPS = 3


def spawn(fn, *args, world: int = WORLD) -> None:
    store = rendezvous_store(world)  # held until the ranks are done
    environments = [rank_environment(store, rank, world) for rank in range(world)]
    mp.start_processes(_rank_main, args=(fn, environments, *args), nprocs=world, join=True,
                       start_method="spawn")


def _rank_main(rank: int, fn, environments: list[dict[str, str]], *args) -> None:
    os.environ.update(environments[rank])
    torch.set_num_threads(1)
    try:
        fn(rank, *args)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def full_params(model) -> dict[str, torch.Tensor]:
    return {name: full(p.detach()).clone() for name, p in model.named_parameters()}


def gathered_weight_addresses(model) -> list[int]:
    """Where each FSDP parameter's gathered weight lives between steps (0: freed)."""
    out = []
    for module in fsdp_modules(model):
        for param in module._get_fsdp_state()._fsdp_param_group.fsdp_params:
            storage = param._unsharded_param.untyped_storage()
            out.append(storage.data_ptr() if storage.size() else 0)
    return out


# ---- loss normalisation across ranks: 2 processes x GA 2 == 1 process x GA 4 -------------------

def global_batches():
    """Three steps of 8 rows; micro-batches of 2 rows with 32, 20, 9 and 1 valid labels."""
    data = []
    for step in range(STEPS):
        input_ids, labels = random_batches(8, SEQ, seed=200 + step)
        labels[2, 4:] = -100
        labels[4:6, 3:] = -100
        labels[6, 1:] = -100
        labels[7, :] = -100
        data.append((input_ids, labels))
    return data


def ga_config(dump, ga):
    return tiny_config(dump, training={"batch_size": 2, "gradient_accumulation_steps": ga,
                                       "seq_len": SEQ, "steps": STEPS})


def two_rank_ga_run(rank: int, dump: str) -> None:
    # FSDP (2 shards) with its weights held gathered over the step and with them freed after use,
    # then replicas (the default on CPUs: the one-rank step and an all-reduce of the gradients in
    # buckets, here two), same data
    accumulation.BUCKET_ELEMENTS = 8_000  # several buckets: reductions start during the backward
    for name, shard in (("fsdp", 2), ("fsdp_freed", 2), ("replicate", -1)):
        cfg = ga_config(os.path.join(dump, name), ga=2)
        cfg.parallel.data_parallel_shard_degree = shard
        cfg.parallel.fsdp_hold_weights = name == "fsdp"
        trainer = Trainer(cfg, dataloader=())
        assert trainer.parallel.dp_world_size == 2
        assert trainer.parallel.fsdp == name.startswith("fsdp")
        if name == "replicate":
            assert trainer.parallel.replica_group is not None
            assert len(trainer.pipeline.accumulator.buckets) >= 4
        results, addresses = [], []
        for input_ids, labels in global_batches():
            rows = slice(4 * rank, 4 * rank + 4)  # rank r: rows 4r..4r+3, as 2 micro-batches
            results.append(trainer.train_step(split_rows(input_ids[rows], labels[rows], 2)))
            if trainer.parallel.fsdp:
                addresses.append(gathered_weight_addresses(trainer.model))
        if name == "fsdp":  # every step gathers into the same buffers (CUDA graphs read them)
            assert addresses[0] and all(0 not in a for a in addresses), addresses
            assert addresses == [addresses[0]] * STEPS
        elif name == "fsdp_freed":  # freed at each step's end
            assert all(set(a) == {0} for a in addresses), addresses
        final = full_params(trainer.model)
        if rank == 0:
            torch.save({"losses": [r.loss for r in results],
                        "norms": [r.grad_norm for r in results], "params": final},
                       os.path.join(dump, f"{name}.pt"))


def test_two_ranks_ga2_equal_one_rank_ga4(tmp_path):
    spawn(two_rank_ga_run, str(tmp_path / "ranks2"))

    one = Trainer(ga_config(tmp_path / "ranks1", ga=4), dataloader=())
    results = [one.train_step(split_rows(i, l, 2)) for i, l in global_batches()]
    reference = params(one.model)
    for name in ("fsdp", "fsdp_freed", "replicate"):
        two = torch.load(tmp_path / "ranks2" / f"{name}.pt")
        assert two["losses"] == pytest.approx([r.loss for r in results], rel=1e-6), name
        # the gradient norm (before clipping) shows any averaging over ranks: Adam hides it
        assert two["norms"] == pytest.approx([r.grad_norm for r in results], rel=1e-5), name
        assert two["params"].keys() == reference.keys()
        for key, value in reference.items():
            torch.testing.assert_close(two["params"][key], value, rtol=1e-5, atol=3e-5,
                                       msg=lambda m: f"{name} {key}: {m}")


def four_rank_hsdp_run(rank: int, dump: str) -> None:
    cfg = ga_config(dump, ga=1)
    cfg.parallel.data_parallel_replicate_degree = 2  # 2 replicas x 2 shards
    trainer = Trainer(cfg, dataloader=())
    assert trainer.parallel.dp_world_size == 4
    mesh = trainer.model.embeddings.weight.device_mesh
    assert mesh.mesh_dim_names == ("dp_replicate", "fsdp") and tuple(mesh.shape) == (2, 2)
    results = []
    for input_ids, labels in global_batches():
        rows = slice(2 * rank, 2 * rank + 2)  # rank r: rows 2r, 2r+1
        results.append(trainer.train_step([{"input_ids": input_ids[rows],
                                            "labels": labels[rows]}]))
    final = full_params(trainer.model)
    if rank == 0:
        torch.save({"losses": [r.loss for r in results], "norms": [r.grad_norm for r in results],
                    "params": final}, os.path.join(dump, "hsdp.pt"))


def test_hsdp_four_ranks_equal_one_rank_ga4(tmp_path):
    spawn(four_rank_hsdp_run, str(tmp_path), world=4)
    hsdp = torch.load(tmp_path / "hsdp.pt")
    one = Trainer(ga_config(tmp_path / "ranks1", ga=4), dataloader=())
    results = [one.train_step(split_rows(i, l, 2)) for i, l in global_batches()]
    assert hsdp["losses"] == pytest.approx([r.loss for r in results], rel=1e-6)
    assert hsdp["norms"] == pytest.approx([r.grad_norm for r in results], rel=1e-5)
    for key, value in params(one.model).items():
        torch.testing.assert_close(hsdp["params"][key], value, rtol=1e-5, atol=3e-5,
                                   msg=lambda m: f"{key}: {m}")


# ---- resume with 2 processes ------------------------------------------------------------------

def resume_config(dump):
    # fused AdamW: the loop queues each step before it reads the previous one's numbers
    return tiny_config(
        dump,
        training={"steps": 6, "batch_size": 2, "seq_len": 32, "gradient_accumulation_steps": 1},
        checkpoint={"enable": True, "interval": 3, "keep_latest_k": 0},
        optimizer={"lr": 3e-3, "implementation": "fused"},
    )


def two_rank_resume_run(rank: int, root: str) -> None:
    Trainer(resume_config(os.path.join(root, "straight"))).train()
    Trainer(resume_config(os.path.join(root, "resumed"))).train(stop_at_step=3)
    resumed = Trainer(resume_config(os.path.join(root, "resumed")))
    assert resumed.state.step == 3
    resumed.train()


def losses(dump) -> dict[int, float]:
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def test_two_rank_resume_matches_and_dp_size_is_checked(tmp_path):
    spawn(two_rank_resume_run, str(tmp_path))
    straight, resumed = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert sorted(resumed) == list(range(1, 7))
    # bitwise: the same two ranks sum the same gradients (a + b, the same on either rank)
    assert [resumed[s] for s in (4, 5, 6)] == [straight[s] for s in (4, 5, 6)]

    # one process cannot resume a 2-rank run ...
    with pytest.raises(CheckpointError, match="data-parallel size 2, this run has 1"):
        Trainer(resume_config(tmp_path / "resumed"))
    # ... but can start a new run from its weights
    cfg = resume_config(tmp_path / "new")
    cfg.checkpoint.initial_load_path = str(tmp_path / "resumed" / "checkpoint" / "step-6")
    trainer = Trainer(cfg)
    assert trainer.state.step == 0
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


# ---- a NaN on one rank: every rank skips, the diagnosis names that rank -----------------------

def two_rank_nan_run(rank: int, dump: str) -> None:
    for implementation in ("for-loop", "fused"):
        cfg = ga_config(os.path.join(dump, implementation), ga=1)
        cfg.optimizer.implementation = implementation
        one_nan_step(rank, cfg, os.path.join(dump, f"{implementation}-rank{rank}.json"))


def one_nan_step(rank: int, cfg, out: str) -> None:
    import math

    trainer = Trainer(cfg, dataloader=())
    batches = global_batches()
    rows = slice(2 * rank, 2 * rank + 2)
    first = trainer.train_step([{"input_ids": batches[0][0][rows], "labels": batches[0][1][rows]}])
    before = full_params(trainer.model)
    hook = None
    if rank == 1:  # a NaN born in layer 1's feed-forward, on rank 1 only
        hook = trainer.model.layers[1].ffn.register_forward_hook(lambda m, i, out: out * math.nan)
    nan = trainer.train_step([{"input_ids": batches[1][0][rows], "labels": batches[1][1][rows]}])
    if hook is not None:
        hook.remove()
    unchanged = all(torch.equal(before[k], v) for k, v in full_params(trainer.model).items())
    after = trainer.train_step([{"input_ids": batches[2][0][rows], "labels": batches[2][1][rows]}])
    with open(out, "w") as f:
        json.dump({"first": first.skipped, "skipped": nan.skipped, "module": nan.first_nonfinite_module,
                   "unchanged": unchanged, "after": after.skipped, "nan_skips": trainer.state.nan_skips,
                   "step": trainer.state.step}, f)


def test_a_nan_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    spawn(two_rank_nan_run, str(tmp_path))
    seen = [(f"{implementation} rank {r}", json.loads((tmp_path / f"{implementation}-rank{r}.json").read_text()))
            for implementation in ("for-loop", "fused") for r in range(WORLD)]
    for r, record in seen:
        assert record["first"] is False and record["skipped"] is True and record["after"] is False, r
        assert record["unchanged"], f"rank {r} changed its parameters on the skipped step"
        assert (record["nan_skips"], record["step"]) == (1, 3), r
        assert record["module"] is not None and record["module"].startswith("layers.1.ffn ("), record
        assert record["module"].endswith("on rank 1"), record


# ---- one process under torchrun: nothing to shard, no FSDP --------------------------------------

def one_rank_run(rank: int, dump: str) -> None:
    cfg = ga_config(dump, ga=4)
    cfg.optimizer.implementation = "fused"
    cfg.training.steps = STEPS
    batches = [batch for input_ids, labels in global_batches() for batch in split_rows(input_ids, labels, 2)]
    trainer = Trainer(cfg, dataloader=batches)
    assert trainer.parallel.distributed and not trainer.parallel.fsdp
    trainer.train()
    torch.save({"losses": losses(trainer.dump_folder), "params": full_params(trainer.model)},
               os.path.join(dump, "one_rank.pt"))


def test_one_rank_under_torchrun_equals_plain_training(tmp_path):
    """One data-parallel rank leaves the model unsharded, and the loop queues steps ahead: the
    same training as one process without torch.distributed."""
    spawn(one_rank_run, str(tmp_path / "fsdp"), world=1)
    fsdp = torch.load(tmp_path / "fsdp" / "one_rank.pt")
    cfg = ga_config(tmp_path / "plain", ga=4)
    cfg.optimizer.implementation = "fused"
    batches = [batch for input_ids, labels in global_batches() for batch in split_rows(input_ids, labels, 2)]
    plain = Trainer(cfg, dataloader=batches)
    plain.train()
    plain_losses = losses(plain.dump_folder)
    assert sorted(fsdp["losses"]) == sorted(plain_losses) == [1, 2, 3]
    assert [fsdp["losses"][s] for s in (1, 2, 3)] == pytest.approx([plain_losses[s] for s in (1, 2, 3)], rel=1e-6)
    for key, value in params(plain.model).items():
        torch.testing.assert_close(fsdp["params"][key], value, rtol=1e-5, atol=3e-5, msg=lambda m: f"{key}: {m}")
