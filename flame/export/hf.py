"""The Hugging Face face of a flame model: `FlameConfig` and `FlameForCausalLM`.

An exported `hf` folder holds flame's own parameter names under `model.` and a config.json whose
`auto_map` points at a one-line modeling file that imports these classes, so
`AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` runs flame's own model
classes (and kernels) in any Python that has flame installed. `transformers` is needed only here.

Generation recomputes the whole prefix for every new token (the model keeps no recurrent cache
between calls): correct for any sampling method, quadratic in the generated length.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from flame.config import Model
from flame.config.job import TRAINING_MEMORY_FIELDS
from flame.models import build_model
from flame.weights.foreign import HF_MODEL_TYPE as MODEL_TYPE

MODELING_FILE = "modeling_flame.py"
AUTO_MAP = {
    "AutoConfig": "modeling_flame.FlameConfig",
    "AutoModelForCausalLM": "modeling_flame.FlameForCausalLM",
}
IGNORE_INDEX = -100


def model_fields() -> dict[str, object]:
    """flame's model-config fields (`flame.config.Model`) and their defaults."""
    defaults = Model()
    return {f.name: getattr(defaults, f.name) for f in dataclasses.fields(Model)}


class FlameConfig(PretrainedConfig):
    """A flame model's config: every field of `flame.config.Model` (`family` picks RWKV6, RWKV7
    or GSA), plus the usual Hugging Face fields. It is itself a valid argument of
    `flame.models.build_model`."""

    model_type = MODEL_TYPE
    attribute_map = {"num_hidden_layers": "num_layers"}

    def __init__(self, **kwargs):
        values = {name: kwargs.pop(name, default) for name, default in model_fields().items()}
        values["backend"] = "auto"  # the exporting run's kernels may not exist where it is loaded
        values.update(dict.fromkeys(TRAINING_MEMORY_FIELDS, False))
        kwargs.setdefault("use_cache", False)
        super().__init__(tie_word_embeddings=bool(values["tie_word_embeddings"]), **kwargs)
        for name, value in values.items():
            setattr(self, name, value)

    def model_args(self):
        """The `flame.config.Model` these fields describe."""
        return Model(**{name: getattr(self, name) for name in model_fields()})


class FlameForCausalLM(PreTrainedModel, GenerationMixin):
    """flame's `CausalLM` (as `self.model`) behind the Hugging Face causal-LM interface:
    `forward(input_ids, attention_mask=None, labels=None) -> CausalLMOutput` and `generate`."""

    config_class = FlameConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _tied_weights_keys = {"model.lm_head.weight": "model.embeddings.weight"}
    _supports_cache_class = False
    _is_stateful = True  # a recurrent model: transformers refuses assisted decoding, which crops caches

    def __init__(self, config: FlameConfig):
        super().__init__(config)
        self.model = build_model(config)
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        """flame's models initialise themselves (`CausalLM.init_weights`); an exported folder
        supplies every weight, so nothing is left for transformers to initialise."""

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embeddings

    def set_input_embeddings(self, value: torch.nn.Module) -> None:
        self.model.embeddings = value

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.model.lm_head

    def set_output_embeddings(self, value: torch.nn.Module) -> None:
        self.model.lm_head = value

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Logits [B, T, V]. Masked-out positions (padding, left or right) are removed from each
        row before the forward, since a recurrent model would otherwise read them into its state;
        their logits are zero."""
        if attention_mask is None or bool(attention_mask.bool().all()):
            return self.model(input_ids)
        keep = attention_mask.bool()
        out = None
        for row in range(input_ids.shape[0]):
            tokens = input_ids[row, keep[row]]
            if tokens.numel() == 0:
                continue
            row_logits = self.model(tokens[None])[0]
            if out is None:
                out = row_logits.new_zeros(*input_ids.shape, row_logits.shape[-1])
            out[row, keep[row]] = row_logits
        if out is None:
            raise ValueError("attention_mask masks out every token")
        return out

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, return_dict: bool | None = None, **kwargs) -> CausalLMOutput:
        if input_ids is None:
            raise ValueError("FlameForCausalLM needs input_ids (inputs_embeds are not supported)")
        logits = self.logits(input_ids, attention_mask)
        loss = None
        if labels is not None:
            shifted = labels[:, 1:].to(logits.device)
            if attention_mask is not None:
                shifted = shifted.masked_fill(~attention_mask[:, 1:].bool().to(logits.device), IGNORE_INDEX)
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), shifted.flatten(),
                                   ignore_index=IGNORE_INDEX)
        return CausalLMOutput(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                                      **kwargs) -> dict:
        """Every step sees the whole sequence so far (no cache)."""
        return {"input_ids": input_ids, "attention_mask": attention_mask}


__all__ = ["AUTO_MAP", "FlameConfig", "FlameForCausalLM", "MODELING_FILE", "MODEL_TYPE", "model_fields"]
