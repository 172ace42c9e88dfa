"""AdamW with the RWKV parameter groups.

Weight decay applies exactly to the `.weight` of `nn.Linear` modules (docs/architecture.md), and
to the input embedding with `decay_embeddings` (RWKV-LM decays it: docs/rwkv-lm.md); never to
norms, biases or free parameters (mixing vectors, decay bias, bonus, LoRA matrices). The
RWKV decay bias (`time_decay` in RWKV6, `w0` in RWKV7) gets `decay_lr_multiplier` times the LR.
A tied head shares its weight with the embedding, so that weight is decayed only with
`decay_embeddings`.
"""

from __future__ import annotations

import torch
from torch import nn

DECAY_BIAS_NAMES = ("time_decay", "w0")


def split_param_groups(model: nn.Module, decay_embeddings: bool = False
                       ) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Named trainable parameters split into "decay", "no_decay" and "decay_bias" groups."""
    embedding_weights = {
        id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)
    }
    linear_weights = {
        id(m.weight)
        for m in model.modules()
        if isinstance(m, nn.Linear) and id(m.weight) not in embedding_weights
    }
    if decay_embeddings:
        linear_weights |= embedding_weights
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {
        "decay": [], "no_decay": [], "decay_bias": []
    }
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if name.rsplit(".", 1)[-1] in DECAY_BIAS_NAMES:
            groups["decay_bias"].append((name, param))
        elif id(param) in linear_weights:
            groups["decay"].append((name, param))
        else:
            groups["no_decay"].append((name, param))
    return groups


def build_optimizer(model: nn.Module, cfg) -> torch.optim.AdamW:
    """AdamW over `model` from the `[optimizer]` config section (whose name is "AdamW", the one
    choice the config loader accepts).

    Each param group records `name` and `lr_multiplier`; its `lr` is cfg.lr x lr_multiplier, and
    the LR schedule multiplies every group's initial LR by the same factor.
    """
    settings = {
        "decay": (cfg.weight_decay, 1.0),
        "no_decay": (0.0, 1.0),
        "decay_bias": (0.0, cfg.decay_lr_multiplier),
    }
    param_groups = []
    for group_name, named in split_param_groups(model, cfg.decay_embeddings).items():
        if not named:
            continue
        weight_decay, multiplier = settings[group_name]
        param_groups.append({
            "params": [p for _, p in named],
            "param_names": [n for n, _ in named],
            "name": group_name,
            "weight_decay": weight_decay,
            "lr_multiplier": multiplier,
            "lr": cfg.lr * multiplier,
        })
    return torch.optim.AdamW(
        param_groups,
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        fused=cfg.implementation == "fused",
        foreach=cfg.implementation == "foreach",
    )
