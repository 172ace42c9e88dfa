"""An fla folder's config.json (fla 0.6's RWKV6, RWKV7 and GSA configs) for a flame model.

The tensors are renamed by flame.weights.fla_names. fla derives the RWKV attention output's
GroupNorm eps from its one `norm_eps` (flame.weights.fla_names.fla_group_norm_eps); a model whose
`group_norm_eps` is not that value would compute another function in fla, and `check_fla_eps`
refuses it (the RWKV defaults, 64e-5 with norm_eps 1e-5, fit fla's RWKV7 at head_dim 64 only).
"""

from __future__ import annotations

import math

import torch

from flame.export.errors import ExportError
from flame.weights.fla_names import FLA_MODEL_TYPES, fla_group_norm_eps

FLA_ARCHITECTURES = {"rwkv6": "RWKV6ForCausalLM", "rwkv7": "RWKV7ForCausalLM", "gsa": "GSAForCausalLM"}


def check_fla_eps(model_args) -> None:
    """ExportError when fla's model would compute the attention output's GroupNorm with another
    eps than `model_args.group_norm_eps` (fla derives it from norm_eps)."""
    family = model_args.family
    fla_eps = fla_group_norm_eps(family, model_args.head_dim, model_args.norm_eps)
    if fla_eps is None or math.isclose(model_args.group_norm_eps, fla_eps, rel_tol=1e-9):
        return
    rule = "head_dim x norm_eps" if family == "rwkv7" else "norm_eps"
    raise ExportError(f"the fla format cannot hold model.group_norm_eps = {model_args.group_norm_eps:g}: fla's "
                      f"{family} computes that GroupNorm with {rule} = {fla_eps:g}, so the export would compute "
                      f"another function; export as hf, or train with model.group_norm_eps = {fla_eps:g}")


def fla_config(model_args, state_dict: dict[str, torch.Tensor], token_ids: dict) -> dict:
    """fla's config.json for flame's `model_args`; LoRA ranks and widths are read from
    `state_dict` (flame names), where flame's "0 = the official formula" is already resolved."""
    family = model_args.family
    C, L = model_args.hidden_size, model_args.num_layers
    common = {
        "model_type": FLA_MODEL_TYPES[family], "architectures": [FLA_ARCHITECTURES[family]],
        "hidden_size": C, "num_hidden_layers": L, "vocab_size": model_args.vocab_size,
        "norm_eps": model_args.norm_eps, "tie_word_embeddings": bool(model_args.tie_word_embeddings),
        "attn": None, "use_cache": True, "fuse_norm": True, "fuse_cross_entropy": True, **token_ids,
    }
    if family == "rwkv7":
        v_layer = 1 if L > 1 else None
        v_rank = (state_dict[f"layers.{v_layer}.attn.v1"].shape[1] if v_layer is not None
                  else model_args.v_low_rank_dim or 32)
        return {**common, "attn_mode": "chunk", "head_dim": model_args.head_dim, "num_heads": C // model_args.head_dim,
                "decay_low_rank_dim": state_dict["layers.0.attn.w1"].shape[1],
                "a_low_rank_dim": state_dict["layers.0.attn.a1"].shape[1],
                "v_low_rank_dim": v_rank,
                "gate_low_rank_dim": state_dict["layers.0.attn.g1"].shape[1],
                "intermediate_size": state_dict["layers.0.ffn.key.weight"].shape[0],
                "hidden_act": "sqrelu", "norm_first": True, "norm_bias": True,
                "value_dim": [C] * L, "use_l2warp": bool(model_args.l2wrap)}
    if family == "rwkv6":
        return {**common, "attn_mode": "chunk", "expand_k": 1.0, "expand_v": 1.0,
                "num_heads": C // model_args.head_dim,
                "proj_low_rank_dim": state_dict["layers.0.attn.mix_w2"].shape[1],
                "gate_low_rank_dim": state_dict["layers.0.attn.decay_w1"].shape[1],
                "intermediate_size": state_dict["layers.0.ffn.key.weight"].shape[0],
                "hidden_act": "sqrelu", "norm_first": True, "norm_bias": True,
                "use_l2warp": bool(model_args.l2wrap)}
    return {**common, "num_heads": model_args.num_heads,
            "num_kv_heads": model_args.num_kv_heads or model_args.num_heads,
            "num_slots": model_args.num_slots, "gate_logit_normalizer": model_args.gate_logit_normalizer,
            "intermediate_size": state_dict["layers.0.mlp.gate_proj.weight"].shape[0],
            "hidden_act": "swish", "feature_map": "swish", "use_output_gate": False, "use_norm": True,
            "use_short_conv": False, "exapnd_k": 1, "exapnd_v": 1, "elementwise_affine": True,
            "clamp_min": None, "clamp_max": None, "fuse_swiglu": True, "use_l2warp": False}


__all__ = ["FLA_ARCHITECTURES", "check_fla_eps", "fla_config"]
