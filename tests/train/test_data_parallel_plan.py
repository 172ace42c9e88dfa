"""How the data-parallel ranks split the model (flame.train.parallel.plan_data_parallel): replicas
when the training state fits in a share of one GPU, FSDP when it does not, and the user's choice
when the config makes one."""

from types import SimpleNamespace

import torch

from flame.train import parallel


def par(shard=-1, replicate=1):
    return SimpleNamespace(data_parallel_shard_degree=shard, data_parallel_replicate_degree=replicate)


def fake_gpu(monkeypatch, gib: float):
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(total_memory=int(gib * 2**30)))
    return torch.device("cuda", 0)


def test_a_model_whose_state_fits_is_replicated_and_one_that_does_not_is_sharded(monkeypatch):
    gpu = fake_gpu(monkeypatch, 80)
    fits = parallel.plan_data_parallel(par(), 8, gpu, num_params=385_000_000)  # 6.5 GiB of 80
    assert (fits.replicate, fits.shard) == (8, 1) and "fits in 40%" in fits.reason
    limit = int(parallel.REPLICATE_MEMORY_FRACTION * 80 * 2**30 / parallel.TRAINING_BYTES_PER_PARAMETER)
    assert parallel.plan_data_parallel(par(), 8, gpu, num_params=limit).shard == 1
    too_big = parallel.plan_data_parallel(par(), 8, gpu, num_params=limit + 1)
    assert (too_big.replicate, too_big.shard) == (1, -1) and "does not fit" in too_big.reason


def test_the_config_forces_either_path_and_a_replicate_degree_keeps_hsdp(monkeypatch):
    gpu = fake_gpu(monkeypatch, 80)
    small = 1_000_000
    def split(plan):
        return plan.replicate, plan.shard

    assert split(parallel.plan_data_parallel(par(shard=4), 8, gpu, small)) == (1, 4)   # FSDP over 4
    assert split(parallel.plan_data_parallel(par(shard=1), 8, gpu, 10**11)) == (8, 1)  # replicas anyway
    assert split(parallel.plan_data_parallel(par(replicate=2), 8, gpu, small)) == (2, -1)  # HSDP 2 x 4


def test_cpus_replicate():
    plan = parallel.plan_data_parallel(par(), 2, torch.device("cpu"), 10**11)
    assert (plan.replicate, plan.shard) == (2, 1) and "on CPUs" in plan.reason


def test_held_fsdp_weights_that_do_not_fit_get_a_warning_naming_the_key(monkeypatch):
    gpu = fake_gpu(monkeypatch, 80)
    assert parallel.check_held_weights_fit(1_400_000_000, 2, gpu) is None  # 1B on 2 GPUs: 16.9 GiB
    warning = parallel.check_held_weights_fit(13_000_000_000, 8, gpu)  # 13B on 8: 90.8 GiB
    assert warning is not None and "parallel.fsdp_hold_weights = false" in warning and "13000M" in warning
    assert parallel.check_held_weights_fit(13_000_000_000, 8, torch.device("cpu")) is None
