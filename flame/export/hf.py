"""The Hugging Face face of a flame model: `FlameConfig` and `FlameForCausalLM`.

An exported `hf` folder holds flame's own parameter names under `model.` and a config.json whose
`auto_map` points at a one-line modeling file that imports these classes, so
`AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` runs flame's own model
classes (and kernels) in any Python that has flame installed. `transformers` is needed only here.

`generate` keeps flame's recurrent state in a `FlameCache` (a transformers `Cache`): the prompt
runs once through the chunked kernels (padded rows packed without their padding), then every new
token is one decoding step over static buffers, a CUDA graph on CUDA (flame.inference.decoder).
With use_cache=False every step recomputes the whole prefix instead.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
import torch.nn.functional as F
from transformers import Cache, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from flame.config import Model
from flame.config.job import TRAINING_MEMORY_FIELDS
from flame.inference.decoder import decoder_for, prefill
from flame.models import build_model
from flame.ops.linear_cross_entropy import IGNORE_INDEX
from flame.weights.foreign import HF_MODEL_TYPE as MODEL_TYPE

MODELING_FILE = "modeling_flame.py"
AUTO_MAP = {
    "AutoConfig": "modeling_flame.FlameConfig",
    "AutoModelForCausalLM": "modeling_flame.FlameForCausalLM",
}
CACHE_FIELD = ("cache" if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
               else "past_key_values")
"""The name transformers gives the cache in model outputs (CausalLMOutputWithPast) and generation
kwargs: `cache` since transformers 5 renamed `past_key_values`."""


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
        kwargs.setdefault("use_cache", True)
        super().__init__(tie_word_embeddings=bool(values["tie_word_embeddings"]), **kwargs)
        for name, value in values.items():
            setattr(self, name, value)

    def model_args(self):
        """The `flame.config.Model` these fields describe."""
        return Model(**{name: getattr(self, name) for name in model_fields()})


class FlameCache(Cache):
    """flame's recurrent state of a batch behind transformers' `Cache`: a `Decoder`'s static
    buffers (flame.inference.decoder), filled by the prompt's prefill and moved on one token per
    forward. It cannot be cropped (a recurrent state forgets), so transformers' assisted decoding
    is refused (`_is_stateful`)."""

    is_compileable = False

    def __init__(self):
        try:
            super().__init__(layers=[])
        except TypeError:  # transformers 4, whose Cache takes no arguments
            super().__init__()
        self.decoder = None
        self.seen_tokens = 0

    @property
    def is_linear(self) -> list[bool]:
        return [True]  # transformers slices no inputs by the cache's length: prepare_inputs does

    @property
    def is_croppable(self) -> bool:
        return False

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1  # no limit: the state's size does not grow

    def advance(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Logits [B, n, V] of the n tokens of input_ids [B, n] that continue the cache. The first
        call prefills the prompts (its attention_mask's padding left out: each row's own tokens,
        packed) and gives each row's last logits, [B, 1, V]."""
        if self.decoder is None:
            if attention_mask is None or bool(attention_mask.bool().all()):
                prompts = input_ids
            else:
                keep = attention_mask.bool().to(input_ids.device)
                prompts = [row[mask] for row, mask in zip(input_ids, keep)]
                if any(p.numel() == 0 for p in prompts):
                    raise ValueError("attention_mask masks out every token of a row")
            logits, state = prefill(model, prompts)
            self.decoder = decoder_for(model, input_ids.shape[0])
            self.decoder.load(state)
            self.seen_tokens = input_ids.shape[1]
            return logits[:, None]
        steps = []
        for t in range(input_ids.shape[1]):
            self.decoder.tokens.copy_(input_ids[:, t])
            steps.append(self.decoder.step().clone())  # the decoder's buffer: the next step overwrites it
        self.seen_tokens += input_ids.shape[1]
        return torch.stack(steps, dim=1)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i of the state becomes row beam_idx[i]."""
        for layer in self.decoder.state:
            for field in ("attn_shift", "ffn_shift"):
                buffer = getattr(layer, field)
                if buffer is not None:
                    buffer.copy_(buffer.index_select(0, beam_idx.to(buffer.device)))
            for buffer in layer.recurrent if isinstance(layer.recurrent, tuple) else (layer.recurrent,):
                buffer.copy_(buffer.index_select(0, beam_idx.to(buffer.device)))


class FlameForCausalLM(PreTrainedModel, GenerationMixin):
    """flame's `CausalLM` (as `self.model`) behind the Hugging Face causal-LM interface:
    `forward(input_ids, attention_mask=None, labels=None, cache=None) -> CausalLMOutputWithPast` and
    `generate`."""

    config_class = FlameConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _tied_weights_keys = {"model.lm_head.weight": "model.embeddings.weight"}
    _supports_cache_class = False  # transformers builds no cache of its own: prepare_inputs makes a FlameCache
    _is_stateful = True  # a recurrent model: transformers refuses assisted decoding, which crops caches

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False

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
                labels: torch.Tensor | None = None, return_dict: bool | None = None, cache: FlameCache | None = None,
                past_key_values: FlameCache | None = None, use_cache: bool | None = None,
                **kwargs) -> CausalLMOutputWithPast:
        """Logits of every position (and the loss with labels); with a `FlameCache` (or use_cache),
        the logits of input_ids continuing the cache's state instead (`FlameCache.advance`)."""
        if input_ids is None:
            raise ValueError("FlameForCausalLM needs input_ids (inputs_embeds are not supported)")
        cache = cache if cache is not None else past_key_values
        if cache is None and use_cache and labels is None:
            cache = FlameCache()
        if cache is not None:
            if not isinstance(cache, FlameCache):
                raise TypeError(f"FlameForCausalLM keeps its recurrent state in a FlameCache, got "
                                f"{type(cache).__name__}")
            if labels is not None:
                raise ValueError("labels with a cache: the loss needs the logits of every position (pass no cache)")
            with torch.no_grad():
                logits = cache.advance(self.model, input_ids, attention_mask)
            return CausalLMOutputWithPast(logits=logits, **{CACHE_FIELD: cache})
        logits = self.logits(input_ids, attention_mask)
        loss = None
        if labels is not None:
            shifted = labels[:, 1:].to(logits.device)
            if attention_mask is not None:
                shifted = shifted.masked_fill(~attention_mask[:, 1:].bool().to(logits.device), IGNORE_INDEX)
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), shifted.flatten(),
                                   ignore_index=IGNORE_INDEX)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                                      cache: FlameCache | None = None, past_key_values: FlameCache | None = None,
                                      use_cache: bool | None = None, **kwargs) -> dict:
        """With the cache (use_cache, the default): the first step passes the prompt and a new
        FlameCache, every later one only the tokens the cache has not seen. Without: the whole
        sequence so far at every step."""
        if use_cache is False:
            return {"input_ids": input_ids, "attention_mask": attention_mask}
        cache = cache if cache is not None else past_key_values
        if cache is None:
            cache = FlameCache()
        return {"input_ids": input_ids[:, cache.get_seq_length():], "attention_mask": attention_mask, "cache": cache}


__all__ = ["AUTO_MAP", "FlameCache", "FlameConfig", "FlameForCausalLM", "MODELING_FILE", "MODEL_TYPE",
           "model_fields"]
