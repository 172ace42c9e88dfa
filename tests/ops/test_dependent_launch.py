"""flame.ops.utils.dependent_launch: which launches become programmatic dependents."""

import torch

from flame.ops.utils import dependent_launch as dl


def test_only_hopper_gpus_outside_the_interpreter_unless_switched_off(monkeypatch):
    monkeypatch.setattr(dl, "triton_interpreter_enabled", lambda: False)
    monkeypatch.setattr(dl, "_supported", lambda device: device.index != 1)  # cuda:1 stands for a pre-Hopper GPU
    monkeypatch.delenv(dl.ENV_SWITCH, raising=False)
    assert dl.dependent_launch(torch.device("cuda", 0))
    assert not dl.dependent_launch(torch.device("cuda", 1))
    assert not dl.dependent_launch(torch.device("cpu"))
    monkeypatch.setenv(dl.ENV_SWITCH, "0")
    assert not dl.dependent_launch(torch.device("cuda", 0))
    monkeypatch.setenv(dl.ENV_SWITCH, "1")
    monkeypatch.setattr(dl, "triton_interpreter_enabled", lambda: True)
    assert not dl.dependent_launch(torch.device("cuda", 0))


def test_launch_options_name_the_launch_flag_only_when_on():
    assert dl.launch_options(True) == {"launch_pdl": True}
    assert dl.launch_options(False) == {}
