"""The Hugging Face export's generate decodes through flame's recurrent state (FlameCache): the
prompt once, then one token per forward, with the tokens of flame.generate; padded batches,
beam search and use_cache=False agree."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flame.inference.generation import generate
from tests.models.helpers import FAMILIES, tiny_args
from tests.models.test_decoding import trained_like

transformers = pytest.importorskip("transformers")


def hf_twin(family: str):
    """(flame model, the same weights as a FlameForCausalLM)."""
    from flame.export.hf import FlameConfig, FlameForCausalLM

    model = trained_like(family).eval()
    args = tiny_args(family, num_layers=2, vocab_size=256)
    config = FlameConfig(**dataclasses.asdict(args), pad_token_id=0, eos_token_id=None, bos_token_id=None)
    hf = FlameForCausalLM(config).eval()
    hf.model.load_state_dict(model.state_dict())
    return model, hf


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_hf_generate_runs_the_cache_and_equals_flame_generate(family, monkeypatch):
    from flame.export.hf import FlameCache

    model, hf = hf_twin(family)
    lengths = []
    advance = FlameCache.advance
    monkeypatch.setattr(FlameCache, "advance",
                        lambda self, m, ids, mask: lengths.append(ids.shape[1]) or advance(self, m, ids, mask))
    prompt = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(1))
    out = hf.generate(prompt, max_new_tokens=40, min_new_tokens=40, do_sample=False)
    assert lengths == [7] + [1] * 39  # the prompt once, then one token per step
    assert torch.equal(out[:, 7:], generate(model, prompt, max_new_tokens=40, temperature=0))
    uncached = hf.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False, use_cache=False)
    assert torch.equal(uncached, out[:, :19]) and len(lengths) == 40


@torch.no_grad()
def test_hf_left_padded_batch_and_beam_search():
    model, hf = hf_twin("rwkv7")
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 256, (n,), generator=generator) for n in (9, 3, 6)]
    padded = torch.zeros(3, 9, dtype=torch.long)
    mask = torch.zeros(3, 9, dtype=torch.long)
    for row, ids in enumerate(prompts):
        padded[row, 9 - ids.numel():] = ids
        mask[row, 9 - ids.numel():] = 1
    out = hf.generate(padded, attention_mask=mask, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert torch.equal(out[:, 9:], generate(model, [p.tolist() for p in prompts], max_new_tokens=16, temperature=0))
    beams = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, num_beams=3)
    cached = hf.generate(padded[:2], attention_mask=mask[:2], **beams)
    assert torch.equal(cached, hf.generate(padded[:2], attention_mask=mask[:2], use_cache=False, **beams))
