"""flame <-> the official RWKV-LM `.pth` state dict (RWKV6 "x060" and RWKV7 "x070").

RWKV-LM names the model `emb`, `blocks.{i}.{ln0,ln1,ln2,att,ffn}`, `ln_out`, `head`, and stores
every per-channel vector of the time and channel mixes as [1, 1, C] (flame: [C]). Its LoRA
matrices are applied as `x @ W`, like flame's, so they keep their layout. Per family:

- RWKV7: token-shift mixes `x_r, x_w, x_k, x_v, x_a, x_g`; LoRAs `w0/w1/w2`, `a0/a1/a2`,
  `v0/v1/v2`, `g1/g2`; `k_k`, `k_a`, `r_k` [H, N]; `receptance/key/value/output`; `ln_x`;
  channel mix `x_k`, `key`, `value`. Layer 0 stores v0/v1/v2 too, unused (it defines v_first):
  they are written as zeros and ignored when read.
- RWKV6: `time_maa_x/w/k/v/r/g`, `time_maa_w1` [C, 5r], `time_maa_w2` [5, r, C], `time_decay`,
  `time_decay_w1/w2`, `time_faaaa` [H, N] (the bonus), `receptance/key/value/gate/output`,
  `ln_x`; channel mix `time_maa_k`, `time_maa_r`, `key`, `receptance`, `value`.

RWKV-LM has no weight tying: a tied flame model writes its embedding as `head.weight` too.

The format has no config: RWKV-LM and the rwkv package hard-code the LayerNorm eps (1e-5) and the
attention output's GroupNorm eps (64e-5), `OFFICIAL_EPS`; a read `.pth` computes with them, and
flame.export refuses to write a model that does not.
"""

from __future__ import annotations

import torch

from flame.config import Model
from flame.weights.errors import WeightsError
from flame.weights.state_dicts import num_layers

RWKV_FAMILIES = ("rwkv6", "rwkv7")
OFFICIAL_EPS = {"norm_eps": 1e-5, "group_norm_eps": 64e-5}
"""The `Model` eps fields and the values RWKV-LM and the rwkv package hard-code for them."""
FAMILY_MARKERS = {"rwkv7": "blocks.0.att.w0", "rwkv6": "blocks.0.att.time_maa_x"}
"""A tensor that only this family's RWKV-LM state dict holds."""
OLDER_MARKERS = ("blocks.0.att.time_first", "blocks.0.att.time_mix_k")
"""Tensors of RWKV-4/5 state dicts."""

ROW = "row"  # flame [C] <-> RWKV-LM [1, 1, C]
SAME = "same"

RWKV7_LAYER: list[tuple[str, str, str]] = [  # (flame, RWKV-LM, layout)
    *[(f"attn.mu_{c}", f"att.x_{c}", ROW) for c in "rwkvag"],
    ("attn.w0", "att.w0", ROW), ("attn.w1", "att.w1", SAME), ("attn.w2", "att.w2", SAME),
    ("attn.a0", "att.a0", ROW), ("attn.a1", "att.a1", SAME), ("attn.a2", "att.a2", SAME),
    ("attn.v0", "att.v0", ROW), ("attn.v1", "att.v1", SAME), ("attn.v2", "att.v2", SAME),
    ("attn.g1", "att.g1", SAME), ("attn.g2", "att.g2", SAME),
    ("attn.k_k", "att.k_k", ROW), ("attn.k_a", "att.k_a", ROW), ("attn.r_k", "att.r_k", SAME),
    ("attn.receptance.weight", "att.receptance.weight", SAME),
    ("attn.key.weight", "att.key.weight", SAME),
    ("attn.value.weight", "att.value.weight", SAME),
    ("attn.output.weight", "att.output.weight", SAME),
    ("attn.ln_x.weight", "att.ln_x.weight", SAME), ("attn.ln_x.bias", "att.ln_x.bias", SAME),
    ("ffn.mu_k", "ffn.x_k", ROW),
    ("ffn.key.weight", "ffn.key.weight", SAME), ("ffn.value.weight", "ffn.value.weight", SAME),
]
RWKV6_LAYER: list[tuple[str, str, str]] = [
    *[(f"attn.mu_{c}", f"att.time_maa_{c}", ROW) for c in "xwkvrg"],
    ("attn.mix_w1", "att.time_maa_w1", SAME), ("attn.mix_w2", "att.time_maa_w2", SAME),
    ("attn.time_decay", "att.time_decay", ROW),
    ("attn.decay_w1", "att.time_decay_w1", SAME), ("attn.decay_w2", "att.time_decay_w2", SAME),
    ("attn.bonus", "att.time_faaaa", SAME),
    *[(f"attn.{p}.weight", f"att.{p}.weight", SAME) for p in ("receptance", "key", "value", "gate", "output")],
    ("attn.ln_x.weight", "att.ln_x.weight", SAME), ("attn.ln_x.bias", "att.ln_x.bias", SAME),
    ("ffn.mu_k", "ffn.time_maa_k", ROW), ("ffn.mu_r", "ffn.time_maa_r", ROW),
    *[(f"ffn.{p}.weight", f"ffn.{p}.weight", SAME) for p in ("key", "receptance", "value")],
]
RWKV_NORMS = [(f"{flame}.{p}", f"{rwkv}.{p}", SAME) for flame, rwkv in
         (("pre_norm", "ln0"), ("attn_norm", "ln1"), ("ffn_norm", "ln2")) for p in ("weight", "bias")]
LAYERS = {"rwkv6": RWKV6_LAYER, "rwkv7": RWKV7_LAYER}
TOP = [("embeddings.weight", "emb.weight"), ("norm.weight", "ln_out.weight"), ("norm.bias", "ln_out.bias"),
       ("lm_head.weight", "head.weight")]
UNUSED_LAYER0 = ("att.v0", "att.v1", "att.v2")
"""RWKV7 layer 0's value-residual LoRA: stored by RWKV-LM, never used."""


def detect_family(state_dict: dict) -> str:
    """"rwkv6" or "rwkv7" for an RWKV-LM state dict; WeightsError for anything else."""
    for family, marker in FAMILY_MARKERS.items():
        if marker in state_dict:
            return family
    if any(marker in state_dict for marker in OLDER_MARKERS):
        raise WeightsError("the .pth is an RWKV-4/5 state dict; flame reads RWKV6 and RWKV7 only")
    raise WeightsError(f"the .pth is not an RWKV-LM RWKV6 or RWKV7 state dict (it has neither "
                      f"{' nor '.join(FAMILY_MARKERS.values())})")


def to_rwkv(state_dict: dict[str, torch.Tensor], family: str, tie_word_embeddings: bool) -> dict[str, torch.Tensor]:
    """flame's state dict -> RWKV-LM's."""
    if family not in RWKV_FAMILIES:
        raise WeightsError(f"the RWKV-LM format holds RWKV6 and RWKV7 models only; this model is {family}")
    out: dict[str, torch.Tensor] = {}
    for flame_name, rwkv_name in TOP:
        if flame_name in state_dict:
            out[rwkv_name] = state_dict[flame_name]
    if tie_word_embeddings or "head.weight" not in out:
        out["head.weight"] = state_dict["embeddings.weight"].clone()
    for i in range(num_layers(state_dict, "layers.")):
        for flame_name, rwkv_name, layout in RWKV_NORMS + LAYERS[family]:
            source = state_dict.get(f"layers.{i}.{flame_name}")
            if source is None:
                continue
            out[f"blocks.{i}.{rwkv_name}"] = source.reshape(1, 1, -1) if layout == ROW else source
        if family == "rwkv7" and i == 0:
            C = state_dict["embeddings.weight"].shape[1]
            rank = state_dict["layers.1.attn.v1"].shape[1] if "layers.1.attn.v1" in state_dict else 32
            like = state_dict["layers.0.attn.w0"]
            out["blocks.0.att.v0"] = like.new_zeros(1, 1, C)
            out["blocks.0.att.v1"] = like.new_zeros(C, rank)
            out["blocks.0.att.v2"] = like.new_zeros(rank, C)
    unknown = sorted(set(state_dict) - {f for f, _ in TOP} - {
        f"layers.{i}.{f}" for i in range(num_layers(state_dict, "layers.")) for f, _, _ in RWKV_NORMS + LAYERS[family]})
    if unknown:
        raise WeightsError(f"flame {family} weights hold a tensor with no RWKV-LM counterpart: {unknown[0]}")
    return out


def from_rwkv(state_dict: dict[str, torch.Tensor], family: str | None = None) -> tuple[str, dict[str, torch.Tensor]]:
    """RWKV-LM's state dict -> (its family, flame's state dict). With `family`, a state dict of
    the other family is a WeightsError."""
    found = detect_family(state_dict)
    if family is not None and found != family:
        raise WeightsError(f"the .pth holds an {found.upper()} model (it has {FAMILY_MARKERS[found]}), "
                          f"not {family}")
    out: dict[str, torch.Tensor] = {}
    used = set()
    for flame_name, rwkv_name in TOP:
        if rwkv_name in state_dict:
            out[flame_name] = state_dict[rwkv_name]
            used.add(rwkv_name)
    for i in range(num_layers(state_dict, "blocks.")):
        for flame_name, rwkv_name, layout in RWKV_NORMS + LAYERS[found]:
            key = f"blocks.{i}.{rwkv_name}"
            if found == "rwkv7" and i == 0 and rwkv_name in UNUSED_LAYER0:
                used.add(key)
                continue
            if key in state_dict:
                value = state_dict[key]
                out[f"layers.{i}.{flame_name}"] = value.reshape(-1) if layout == ROW else value
                used.add(key)
    unknown = [k for k in state_dict if k not in used]
    if unknown:
        raise WeightsError(f"the .pth holds a tensor that flame's {found} has no place for: {unknown[0]}")
    return found, out


def model_args_from_rwkv(state_dict: dict[str, torch.Tensor]):
    """flame's `Model` for an RWKV-LM state dict, read from its tensor shapes."""
    family = detect_family(state_dict)
    vocab, C = state_dict["emb.weight"].shape
    common = dict(family=family, vocab_size=vocab, hidden_size=C, num_layers=num_layers(state_dict, "blocks."),
                  ffn_hidden_size=state_dict["blocks.0.ffn.key.weight"].shape[0], tie_word_embeddings=False,
                  **OFFICIAL_EPS)
    if family == "rwkv7":
        return Model(**common, head_dim=state_dict["blocks.0.att.r_k"].shape[1],
                     decay_low_rank_dim=state_dict["blocks.0.att.w1"].shape[1],
                     a_low_rank_dim=state_dict["blocks.0.att.a1"].shape[1],
                     v_low_rank_dim=state_dict["blocks.0.att.v1"].shape[1] if "blocks.0.att.v1" in state_dict
                     else state_dict.get("blocks.1.att.v1", torch.empty(0, 32)).shape[1],
                     gate_low_rank_dim=state_dict["blocks.0.att.g1"].shape[1])
    return Model(**common, head_dim=state_dict["blocks.0.att.time_faaaa"].shape[1],
                 mix_low_rank_dim=state_dict["blocks.0.att.time_maa_w2"].shape[1],
                 decay_low_rank_dim=state_dict["blocks.0.att.time_decay_w1"].shape[1])


__all__ = ["OFFICIAL_EPS", "RWKV_FAMILIES", "detect_family", "from_rwkv", "model_args_from_rwkv", "to_rwkv"]
