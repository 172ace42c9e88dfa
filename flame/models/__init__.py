"""flame.models: the RWKV6, RWKV7 and GSA causal language models.

`build_model(args)` takes any object with the attributes of `flame.config.job.Model` (duck
typing: this package never imports flame.config) and returns the family's `CausalLM`.
"""

from flame.models.causal_lm import CausalLM
from flame.models.gsa import GSAForCausalLM
from flame.models.l2wrap import l2wrap
from flame.models.rwkv6 import RWKV6ForCausalLM
from flame.models.rwkv7 import RWKV7ForCausalLM
from flame.models.state import LayerState

MODEL_CLASSES = {"rwkv6": RWKV6ForCausalLM, "rwkv7": RWKV7ForCausalLM, "gsa": GSAForCausalLM}


def build_model(args) -> CausalLM:
    """The model of `args.family`, initialised (or left uninitialised on the meta device: call
    `to_empty(device=...)` then `init_weights()`)."""
    family = getattr(args, "family", None)
    if family not in MODEL_CLASSES:
        raise ValueError(f"unknown model family {family!r}; expected one of {', '.join(MODEL_CLASSES)}")
    return MODEL_CLASSES[family](args)


__all__ = [
    "CausalLM",
    "GSAForCausalLM",
    "LayerState",
    "MODEL_CLASSES",
    "RWKV6ForCausalLM",
    "RWKV7ForCausalLM",
    "build_model",
    "l2wrap",
]
