"""Recurrent decoding (`CausalLM.forward_with_state`) gives the chunked forward's logits: a prompt
prefilled through the chunked kernels, then one token at a time through the fused recurrent ones,
for every family; on CPU in fp32 (PyTorch backend), on CUDA in bf16 (Triton kernels)."""

from __future__ import annotations

import pytest
import torch

from flame.models import LayerState
from flame.ops.utils.backend import triton_interpreter_enabled
from tests.models.helpers import FAMILIES, build_seeded, tiny_args

SEQ = 40


def trained_like(family: str, device="cpu", **overrides):
    """A tiny model whose zero-initialised projections (RWKV outputs, LoRA firsts) are perturbed,
    so that every path of the attention reaches the logits."""
    model = build_seeded(tiny_args(family, **{"num_layers": 2, "vocab_size": 256, **overrides})).to(device)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator).to(device))
    return model


def decode_step_by_step(model, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits at every position: the first `prefill` tokens in one call, then one call per token."""
    logits, state = model.forward_with_state(ids[:, :prefill])
    outputs = [logits]
    for t in range(prefill, ids.shape[1]):
        logits, state = model.forward_with_state(ids[:, t:t + 1], state)
        outputs.append(logits)
    return torch.cat(outputs, dim=1)


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_recurrent_decoding_equals_the_chunked_forward(family):
    model = trained_like(family)
    ids = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(0))
    expected = model(ids)
    for prefill in (1, 17):
        got = decode_step_by_step(model, ids, prefill)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"{family} p={prefill}: {m}")


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_prefill_in_several_chunked_calls_equals_one_forward(family):
    model = trained_like(family)
    ids = torch.randint(0, 256, (3, SEQ), generator=torch.Generator().manual_seed(2))
    expected = model(ids)
    state, outputs = None, []
    for start, end in ((0, 5), (5, 23), (23, 24), (24, SEQ)):
        logits, state = model.forward_with_state(ids[:, start:end], state)
        outputs.append(logits)
    torch.testing.assert_close(torch.cat(outputs, 1), expected, rtol=1e-5, atol=1e-5)
    last, _ = model.forward_with_state(ids, last_only=True)
    torch.testing.assert_close(last, expected[:, -1:], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not triton_interpreter_enabled(), reason="Triton kernels on CPU need TRITON_INTERPRET=1")
@torch.no_grad()
def test_recurrent_decoding_on_the_triton_kernels_under_the_interpreter():
    """The Triton path of decoding (chunked prefill from a state, fused recurrent steps) on CPU."""
    model = trained_like("rwkv7", backend="triton")
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(decode_step_by_step(model, ids, 19), model(ids), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_state_structure_and_the_given_state_stays_valid():
    model = trained_like("gsa")
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))
    _, state = model.forward_with_state(ids[:, :8])
    assert len(state) == 2 and all(isinstance(s, LayerState) for s in state)
    hk, hv = state[0].recurrent
    assert hk.dtype == hv.dtype == torch.float32 and hk.shape[0] == 2
    first, after = model.forward_with_state(ids[:, 8:], state)
    again, _ = model.forward_with_state(ids[:, 8:], state)  # the same state, reused
    assert torch.equal(first, again) and after[0] is not state[0]

    rwkv = trained_like("rwkv7")
    _, state = rwkv.forward_with_state(ids)
    assert state[1].recurrent.shape == (2, 4, 16, 16) and state[1].recurrent.dtype == torch.float32
    assert state[1].attn_shift.shape == state[1].ffn_shift.shape == (2, 64)
    with pytest.raises(ValueError, match="2 layer states for a model of 3"):
        build_seeded(tiny_args("rwkv7", vocab_size=256)).forward_with_state(ids, state)


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_recurrent_decoding_on_cuda_in_bf16_follows_the_chunked_forward(family):
    """The fused recurrent Triton kernels against the chunked ones, both in bf16: bf16 tolerance."""
    model = trained_like(family, device="cuda", hidden_size=256, head_dim=64, num_heads=4, num_slots=32,
                         backend="triton").to(torch.bfloat16)
    ids = torch.randint(0, 256, (2, 160), generator=torch.Generator().manual_seed(0)).cuda()
    expected = model(ids).double()
    got = decode_step_by_step(model, ids, 100).double()
    err = ((got - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt()).item()
    assert err < 2e-2, f"{family}: relative RMS error {err:.2e} between recurrent and chunked decoding"
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.8  # bf16 near-ties may flip
