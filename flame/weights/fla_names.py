"""flame <-> fla (flash-linear-attention 0.6): the parameter names, and flame's model from fla's
config.json (flame.export.fla writes that config).

fla's models (`RWKV6ForCausalLM`, `RWKV7ForCausalLM`, `GSAForCausalLM`, config model types
"rwkv6", "rwkv7", "gsa") compute the same functions as flame's with differently named and laid
out parameters:

- everything but the head sits under `model.`;
- LoRAs are `nn.Sequential(Linear, act, Linear)` modules, so flame's `x @ W1` / `@ W2` matrices
  are stored transposed (`lora.0.weight` = W1^T, `lora.2.weight` = W2^T) and the bias vector
  (RWKV7 w0/a0/v0, RWKV6 time_decay) is the second Linear's bias;
- RWKV7's static token-shift mixes are [1, 1, C] (`x_r` ...); its channel mix's is [C];
- RWKV6's five data-dependent mix branches run in the order r, w, k, v, g (flame and RWKV-LM:
  w, k, v, r, g), their biases stacked in `x_bias` [5, C], and the second mix matrix is one
  Linear [C, 5 r] instead of [5, r, C].

fla's config has one eps, `norm_eps`, for the block norms and the attention output's GroupNorm:
its RWKV7 GroupNorm uses `head_dim * norm_eps`, its RWKV6 GroupNorm `norm_eps` itself (GSA's
output RMSNorm uses `norm_eps`, as flame's does), `fla_group_norm_eps`. A read fla config gives
flame's `group_norm_eps` the value fla computes with.
"""

from __future__ import annotations

from typing import Callable

import torch

from flame.config import Model
from flame.weights.errors import WeightsError
from flame.weights.state_dicts import num_layers

FLA_MODEL_TYPES = {"rwkv6": "rwkv6", "rwkv7": "rwkv7", "gsa": "gsa"}

RWKV6_FLAME_BRANCHES = ("w", "k", "v", "r", "g")
RWKV6_FLA_BRANCHES = ("r", "w", "k", "v", "g")
FLA_BRANCH_SOURCE = [RWKV6_FLAME_BRANCHES.index(b) for b in RWKV6_FLA_BRANCHES]
"""fla branch j holds flame branch FLA_BRANCH_SOURCE[j]."""
FLAME_BRANCH_SOURCE = [RWKV6_FLA_BRANCHES.index(b) for b in RWKV6_FLAME_BRANCHES]
"""flame branch i holds fla branch FLAME_BRANCH_SOURCE[i]."""


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _transpose(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous()


def _as_row(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1, 1, -1)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1)


Rule = tuple[str, str, Callable, Callable]
"""(flame name, fla name, flame -> fla, fla -> flame), names relative to a layer."""

FLA_NORMS = [(f"{n}.{p}", f"{n}.{p}", _same, _same)
         for n in ("pre_norm", "attn_norm", "ffn_norm") for p in ("weight", "bias")]

RWKV7_RULES: list[Rule] = FLA_NORMS + [
    *[(f"attn.mu_{c}", f"attn.x_{c}", _as_row, _flat) for c in "rwkvag"],
    ("attn.receptance.weight", "attn.r_proj.weight", _same, _same),
    ("attn.key.weight", "attn.k_proj.weight", _same, _same),
    ("attn.value.weight", "attn.v_proj.weight", _same, _same),
    ("attn.output.weight", "attn.o_proj.weight", _same, _same),
    *[rule for lora in "wav" for rule in (
        (f"attn.{lora}1", f"attn.{lora}_lora.lora.0.weight", _transpose, _transpose),
        (f"attn.{lora}2", f"attn.{lora}_lora.lora.2.weight", _transpose, _transpose),
        (f"attn.{lora}0", f"attn.{lora}_lora.lora.2.bias", _same, _same),
    )],
    ("attn.g1", "attn.g_lora.lora.0.weight", _transpose, _transpose),
    ("attn.g2", "attn.g_lora.lora.2.weight", _transpose, _transpose),
    ("attn.k_k", "attn.k_k", _same, _same),
    ("attn.k_a", "attn.k_a", _same, _same),
    ("attn.r_k", "attn.r_k", _same, _same),
    ("attn.ln_x.weight", "attn.g_norm.weight", _same, _same),
    ("attn.ln_x.bias", "attn.g_norm.bias", _same, _same),
    ("ffn.mu_k", "ffn.x_k", _same, _same),
    ("ffn.key.weight", "ffn.key.weight", _same, _same),
    ("ffn.value.weight", "ffn.value.weight", _same, _same),
]

RWKV6_RULES: list[Rule] = FLA_NORMS + [
    ("attn.mu_x", "attn.x_proj.0.mu", _same, _same),
    ("attn.time_decay", "attn.w_proj.linear.lora.2.bias", _same, _same),
    ("attn.decay_w1", "attn.w_proj.linear.lora.0.weight", _transpose, _transpose),
    ("attn.decay_w2", "attn.w_proj.linear.lora.2.weight", _transpose, _transpose),
    ("attn.bonus", "attn.bonus", _same, _same),
    ("attn.receptance.weight", "attn.r_proj.linear.weight", _same, _same),
    ("attn.key.weight", "attn.k_proj.linear.weight", _same, _same),
    ("attn.value.weight", "attn.v_proj.linear.weight", _same, _same),
    ("attn.gate.weight", "attn.g_proj.linear.weight", _same, _same),
    ("attn.output.weight", "attn.o_proj.weight", _same, _same),
    ("attn.ln_x.weight", "attn.g_norm.weight", _same, _same),
    ("attn.ln_x.bias", "attn.g_norm.bias", _same, _same),
    ("ffn.mu_k", "ffn.key.mu", _same, _same),
    ("ffn.key.weight", "ffn.key.linear.weight", _same, _same),
    ("ffn.mu_r", "ffn.receptance.mu", _same, _same),
    ("ffn.receptance.weight", "ffn.receptance.linear.weight", _same, _same),
    ("ffn.value.weight", "ffn.value.weight", _same, _same),
]
RWKV6_MIX = {  # handled together: the branch order differs
    "mu": [f"attn.mu_{b}" for b in RWKV6_FLAME_BRANCHES],
    "w1": "attn.mix_w1", "w2": "attn.mix_w2",
    "fla_bias": "attn.x_bias", "fla_w1": "attn.x_proj.0.linear.weight", "fla_w2": "attn.x_proj.2.weight",
}

GSA_RULES: list[Rule] = [
    (f"{module}.{p}", f"{module}.{p}", _same, _same)
    for module, params in (
        ("attn_norm", ("weight",)), ("mlp_norm", ("weight",)),
        *[(f"attn.{proj}", ("weight",)) for proj in ("q_proj", "k_proj", "v_proj", "f_proj", "g_norm", "o_proj")],
        *[(f"mlp.{proj}", ("weight",)) for proj in ("gate_proj", "up_proj", "down_proj")],
    )
    for p in params
]

LAYER_RULES = {"rwkv6": RWKV6_RULES, "rwkv7": RWKV7_RULES, "gsa": GSA_RULES}
TOP_RULES: list[Rule] = [
    ("embeddings.weight", "model.embeddings.weight", _same, _same),
    ("norm.weight", "model.norm.weight", _same, _same),
    ("norm.bias", "model.norm.bias", _same, _same),
    ("lm_head.weight", "lm_head.weight", _same, _same),
]


def _convert(state_dict: dict[str, torch.Tensor], family: str, to_fla: bool) -> dict[str, torch.Tensor]:
    """Rename (and reshape) every tensor; a tensor no rule names is an error."""
    if family not in LAYER_RULES:
        raise WeightsError(f"unknown model family {family!r}")
    source_layers = "layers." if to_fla else "model.layers."
    layers = num_layers(state_dict, source_layers)
    rules = list(TOP_RULES)
    for i in range(layers):
        rules += [(f"layers.{i}.{a}", f"model.layers.{i}.{b}", f, g) for a, b, f, g in LAYER_RULES[family]]
    out: dict[str, torch.Tensor] = {}
    used = set()
    for flame_name, fla_name, forward, backward in rules:
        src, dst, fn = (flame_name, fla_name, forward) if to_fla else (fla_name, flame_name, backward)
        if src in state_dict:
            out[dst] = fn(state_dict[src])
            used.add(src)
    if family == "rwkv6":
        for i in range(layers):
            used |= _convert_rwkv6_mix(state_dict, out, f"layers.{i}.", f"model.layers.{i}.", to_fla)
    unknown = [k for k in state_dict if k not in used]
    if unknown:
        kind = "flame" if to_fla else "fla"
        raise WeightsError(f"{kind} {family} weights hold a tensor with no counterpart: {unknown[0]}")
    return out


def _convert_rwkv6_mix(state_dict, out, flame_prefix: str, fla_prefix: str, to_fla: bool) -> set[str]:
    """RWKV6's data-dependent token-shift mix: flame's (mu_w..mu_g, mix_w1 [C, 5r], mix_w2
    [5, r, C]) <-> fla's (x_bias [5, C], x_proj.0.linear.weight [5r, C], x_proj.2.weight [C, 5r])."""
    mus = [flame_prefix + name for name in RWKV6_MIX["mu"]]
    w1, w2 = flame_prefix + RWKV6_MIX["w1"], flame_prefix + RWKV6_MIX["w2"]
    bias = fla_prefix + RWKV6_MIX["fla_bias"]
    fw1, fw2 = fla_prefix + RWKV6_MIX["fla_w1"], fla_prefix + RWKV6_MIX["fla_w2"]
    if to_fla:
        if w2 not in state_dict:
            return set()
        branches, rank, C = state_dict[w2].shape
        out[bias] = torch.stack([state_dict[mus[i]] for i in FLA_BRANCH_SOURCE])
        out[fw1] = state_dict[w1].view(C, branches, rank)[:, FLA_BRANCH_SOURCE].reshape(C, -1).t().contiguous()
        out[fw2] = state_dict[w2][FLA_BRANCH_SOURCE].permute(2, 0, 1).reshape(C, -1).contiguous()
        return set(mus) | {w1, w2}
    if fw2 not in state_dict:
        return set()
    C = state_dict[fw2].shape[0]
    branches = state_dict[bias].shape[0]
    rank = state_dict[fw2].shape[1] // branches
    for i, name in enumerate(mus):
        out[name] = state_dict[bias][FLAME_BRANCH_SOURCE[i]].clone()
    out[w1] = state_dict[fw1].t().reshape(C, branches, rank)[:, FLAME_BRANCH_SOURCE].reshape(C, -1).contiguous()
    out[w2] = state_dict[fw2].view(C, branches, rank).permute(1, 2, 0)[FLAME_BRANCH_SOURCE].contiguous()
    return {bias, fw1, fw2}


def to_fla(state_dict: dict[str, torch.Tensor], family: str) -> dict[str, torch.Tensor]:
    """flame's state dict (flame names) -> fla's names and layouts."""
    return _convert(state_dict, family, to_fla=True)


def from_fla(state_dict: dict[str, torch.Tensor], family: str) -> dict[str, torch.Tensor]:
    """fla's state dict -> flame's names and layouts."""
    return _convert(state_dict, family, to_fla=False)


# ---- config.json -> flame's Model ---------------------------------------------------------------

def fla_group_norm_eps(family: str, head_dim: int, norm_eps: float) -> float | None:
    """The eps of fla's GroupNorm on the attention output of `family` (None: GSA has none)."""
    return {"rwkv7": head_dim * norm_eps, "rwkv6": norm_eps}.get(family)


def _require(config: dict, key: str, allowed, family: str) -> None:
    value = config.get(key, allowed[0])
    if value not in allowed:
        raise WeightsError(f"fla {family} config has {key} = {value!r}, which flame's {family} does not "
                          f"support (supported: {', '.join(map(repr, allowed))})")


def model_args_from_fla_config(config: dict):
    """flame's `Model` for an fla config.json (its model_type one of FLA_MODEL_TYPES)."""
    family = {v: k for k, v in FLA_MODEL_TYPES.items()}.get(config.get("model_type"))
    if family is None:
        raise WeightsError(f"config.json has model_type {config.get('model_type')!r}, not one of fla's "
                          f"{', '.join(FLA_MODEL_TYPES.values())}")
    _require(config, "attn", (None,), family)
    C = config["hidden_size"]
    common = dict(family=family, vocab_size=config["vocab_size"], hidden_size=C,
                  num_layers=config["num_hidden_layers"], norm_eps=config.get("norm_eps", 1e-5),
                  tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                  ffn_hidden_size=config.get("intermediate_size") or 0)
    if family == "rwkv7":
        _require(config, "hidden_act", ("sqrelu",), family)
        _require(config, "norm_bias", (True,), family)
        value_dim = config.get("value_dim")
        if value_dim not in (None, C, [C] * config["num_hidden_layers"]):
            raise WeightsError(f"fla rwkv7 config has value_dim = {value_dim!r}; flame's rwkv7 needs value_dim = hidden_size")
        head_dim = config.get("head_dim") or C // config["num_heads"]
        return Model(**common, head_dim=head_dim,
                     group_norm_eps=fla_group_norm_eps(family, head_dim, common["norm_eps"]),
                     decay_low_rank_dim=config["decay_low_rank_dim"],
                     a_low_rank_dim=config["a_low_rank_dim"], v_low_rank_dim=config["v_low_rank_dim"],
                     gate_low_rank_dim=config["gate_low_rank_dim"], l2wrap=bool(config.get("use_l2warp", True)))
    if family == "rwkv6":
        _require(config, "hidden_act", ("sqrelu",), family)
        _require(config, "expand_k", (1, 1.0), family)
        _require(config, "expand_v", (1, 1.0), family)
        head_dim = C // config["num_heads"]
        return Model(**common, head_dim=head_dim, mix_low_rank_dim=config["proj_low_rank_dim"],
                     group_norm_eps=fla_group_norm_eps(family, head_dim, common["norm_eps"]),
                     decay_low_rank_dim=config["gate_low_rank_dim"], l2wrap=bool(config.get("use_l2warp", False)))
    for key, allowed in (("use_short_conv", (False,)), ("use_output_gate", (False,)), ("feature_map", ("swish",)),
                         ("hidden_act", ("swish", "silu")), ("exapnd_k", (1, 1.0)), ("exapnd_v", (1, 1.0)),
                         ("clamp_min", (None,)), ("clamp_max", (None,))):
        _require(config, key, allowed, family)
    return Model(**common, num_heads=config["num_heads"], num_kv_heads=config.get("num_kv_heads") or 0,
                 num_slots=config["num_slots"], gate_logit_normalizer=float(config["gate_logit_normalizer"]))


__all__ = ["FLA_MODEL_TYPES", "fla_group_norm_eps", "from_fla", "model_args_from_fla_config", "to_fla"]
