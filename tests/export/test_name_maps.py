"""The fla and RWKV-LM name maps (flame.weights.fla_names, flame.weights.rwkv_names) on the
exported tensors: fla's formulas on fla's layout give flame's values (fla itself runs in
test_target_code.py, on GPU), and RWKV-LM's layout of vectors and of layer 0 (the official rwkv
package runs the .pth in test_target_code.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flame.weights.foreign import read_safetensors
from tests.export.helpers import out_path


def fla_weights(runs, family: str) -> dict:
    return read_safetensors(out_path(runs["root"], family, "fla"))


def lora(weights: dict, prefix: str, x: torch.Tensor, activation) -> torch.Tensor:
    """fla's LoRA module: Linear -> activation -> Linear (with its bias when it has one)."""
    hidden = activation(F.linear(x, weights[prefix + "lora.0.weight"]))
    return F.linear(hidden, weights[prefix + "lora.2.weight"], weights.get(prefix + "lora.2.bias"))


def test_fla_rwkv6_layout_gives_flames_token_mixes_and_decay(runs):
    """fla's data-dependent lerp (branches r, w, k, v, g; x_proj.2 read as [C, 5, r]) and its
    decay LoRA on the exported tensors equal flame's on flame's."""
    ours = runs["rwkv6"].model.layers[1].attn
    theirs = fla_weights(runs, "rwkv6")
    p = "model.layers.1.attn."
    x, previous = torch.randn(3, 64), torch.randn(3, 64)
    delta = previous - x
    with torch.no_grad():
        hidden = torch.tanh(F.linear(x + delta * theirs[p + "x_proj.0.mu"], theirs[p + "x_proj.0.linear.weight"]))
        rank = hidden.shape[-1] // 5
        mixes = torch.einsum("bnr,hnr->bnh", hidden.view(3, 5, rank), theirs[p + "x_proj.2.weight"].view(64, 5, rank))
        mixes = mixes + theirs[p + "x_bias"]
        xi = torch.tanh((x + delta * ours.mu_x) @ ours.mix_w1).view(3, 5, rank)
        for j, branch in enumerate("rwkvg"):
            flame_index = "wkvrg".index(branch)
            want = x + delta * (getattr(ours, f"mu_{branch}") + xi[:, flame_index] @ ours.mix_w2[flame_index])
            torch.testing.assert_close(x + delta * mixes[:, j], want, rtol=1e-5, atol=1e-6, msg=branch)
        xw = torch.randn(3, 64)
        torch.testing.assert_close(lora(theirs, p + "w_proj.linear.", xw, torch.tanh),
                                   ours.time_decay + torch.tanh(xw @ ours.decay_w1) @ ours.decay_w2)


def test_fla_rwkv7_layout_gives_flames_loras(runs):
    ours = runs["rwkv7"].model.layers[1].attn
    theirs = fla_weights(runs, "rwkv7")
    p = "model.layers.1.attn."
    x = torch.randn(3, 64)
    identity = torch.nn.Identity()
    with torch.no_grad():
        cases = {
            "w": (torch.tanh, ours.w0 + torch.tanh(x @ ours.w1) @ ours.w2),
            "a": (identity, ours.a0 + (x @ ours.a1) @ ours.a2),
            "v": (identity, ours.v0 + (x @ ours.v1) @ ours.v2),
            "g": (torch.sigmoid, torch.sigmoid(x @ ours.g1) @ ours.g2),
        }
        for name, (activation, want) in cases.items():
            torch.testing.assert_close(lora(theirs, p + f"{name}_lora.", x, activation), want, msg=name)
    assert theirs[p + "x_r"].shape == (1, 1, 64) and theirs["model.layers.1.ffn.x_k"].shape == (64,)
    assert "model.layers.0.attn.v_lora.lora.0.weight" not in theirs  # layer 0 has no value residual
    assert theirs[p + "g_norm.weight"].shape == (64,) and "lm_head.weight" in theirs


def test_rwkv_lm_layout_of_vectors_and_layer0_value_lora(runs):
    weights = torch.load(out_path(runs["root"], "rwkv7", "rwkv"), weights_only=True)
    assert weights["blocks.0.att.x_r"].shape == (1, 1, 64) and weights["blocks.1.ffn.x_k"].shape == (1, 1, 64)
    assert weights["blocks.0.att.w1"].shape == (64, 32) and weights["blocks.0.att.r_k"].shape == (2, 32)
    assert not weights["blocks.0.att.v1"].any()  # unused by RWKV-LM at layer 0, written as zeros


def test_fla_config_carries_rwkv6_l2wrap_both_ways():
    """fla's RWKV6 has `use_l2warp` (default False) as its RWKV7 does: the export writes flame's
    `model.l2wrap`, and reading the config back gives it again."""
    from flame.export.fla import fla_config
    from flame.models import build_model
    from flame.weights.fla_names import model_args_from_fla_config
    from tests.models.helpers import tiny_args

    for l2wrap in (True, False):
        args = tiny_args("rwkv6", l2wrap=l2wrap, group_norm_eps=1e-5)
        config = fla_config(args, build_model(args).state_dict(), {})
        assert config["use_l2warp"] is l2wrap
        assert model_args_from_fla_config(config).l2wrap is l2wrap
    config.pop("use_l2warp")
    assert model_args_from_fla_config(config).l2wrap is False  # fla's RWKV6Config default
