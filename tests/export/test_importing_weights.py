"""Every export read back into flame (flame.weights.foreign): bitwise the trained weights, by
`load_model` and by a new run's checkpoint.initial_load_path (flame.weights.load), and clear
errors for weights that do not fit the model."""

from __future__ import annotations

import pytest
import torch

from flame.train.checkpoint import CheckpointError
from flame.train.trainer import Trainer
from flame.weights import WeightsError, load_model, read_exported
from tests.export.helpers import (
    FAMILIES,
    FORMATS,
    assert_same_weights,
    out_path,
    reference,
    run_config,
    sample_ids,
)

ROUND_TRIPS = [(family, fmt) for family in FAMILIES for fmt in FORMATS[family]]


@pytest.mark.parametrize("family,fmt", ROUND_TRIPS)
def test_export_then_import_is_bitwise_equal(runs, family, fmt, tmp_path):
    out = out_path(runs["root"], family, fmt)
    trained = runs[family].model.state_dict()
    _, state, _ = read_exported(out, family)
    assert_same_weights(trained, state, f"{family} {fmt} read")
    cfg = run_config(family, tmp_path / "continued", runs["tokenizer"],
                     checkpoint={"enable": False, "initial_load_path": str(out)})
    continued = Trainer(cfg, dataloader=[])
    assert continued.state.step == 0
    assert_same_weights(trained, continued.model.state_dict(), f"{family} {fmt} trainer import")


def test_import_shape_mismatch_names_the_tensor_and_both_shapes(runs, tmp_path):
    cfg = run_config("rwkv7", tmp_path / "wider", runs["tokenizer"], model={"gate_low_rank_dim": 48},
                     checkpoint={"enable": False, "initial_load_path": str(out_path(runs["root"], "rwkv7", "fla"))})
    with pytest.raises(WeightsError) as err:
        Trainer(cfg, dataloader=[])
    message = str(err.value)
    assert "\n" not in message
    assert "layers.0.attn.g1 has shape (64, 32)" in message and "(64, 48) in the model" in message


def test_import_of_a_pth_missing_a_tensor_names_it(runs, tmp_path):
    weights = torch.load(out_path(runs["root"], "rwkv7", "rwkv"), weights_only=True)
    del weights["blocks.1.att.w0"]
    torch.save(weights, tmp_path / "partial.pth")
    cfg = run_config("rwkv7", tmp_path / "run", runs["tokenizer"],
                     checkpoint={"enable": False, "initial_load_path": str(tmp_path / "partial.pth")})
    with pytest.raises(WeightsError, match=r"partial.pth: no tensor layers.1.attn.w0 \(shape \(64,\) in the model\)$"):
        Trainer(cfg, dataloader=[])


def test_import_of_another_familys_pth_is_refused(runs, tmp_path):
    cfg = run_config("rwkv6", tmp_path / "other", runs["tokenizer"],
                     checkpoint={"enable": False, "initial_load_path": str(out_path(runs["root"], "rwkv7", "rwkv"))})
    with pytest.raises(WeightsError, match=r"^checkpoint.initial_load_path: the .pth holds an RWKV7 model .*not rwkv6$"):
        Trainer(cfg, dataloader=[])


def test_import_needs_model_only(runs, tmp_path):
    cfg = run_config("gsa", tmp_path / "full", runs["tokenizer"],
                     checkpoint={"enable": False, "initial_load_model_only": False,
                                 "initial_load_path": str(out_path(runs["root"], "gsa", "hf"))})
    with pytest.raises(CheckpointError, match="holds model weights only.*initial_load_model_only = true"):
        Trainer(cfg, dataloader=[])


def test_load_model_reads_every_export(runs):
    ids = sample_ids()
    for family, fmt in ROUND_TRIPS:
        model, args, tokenizer = load_model(out_path(runs["root"], family, fmt))
        assert args.family == family and (tokenizer is None) == (fmt == "rwkv")
        with torch.no_grad():
            torch.testing.assert_close(model(ids), reference(runs, family, fmt)(ids), rtol=1e-5, atol=1e-6)


def test_other_pth_is_a_clear_error(tmp_path):
    weights = {"emb.weight": torch.zeros(4, 8), "blocks.0.att.time_first": torch.zeros(8)}
    torch.save(weights, tmp_path / "rwkv5.pth")
    with pytest.raises(WeightsError, match="RWKV-4/5"):
        read_exported(tmp_path / "rwkv5.pth")
