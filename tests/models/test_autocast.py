"""The models train under plain `torch.autocast` with fp32 parameters, as a user's own loop or a
fine-tuning script runs them: the ops compute in the autocast dtype instead of refusing the mix of
bf16 matmul outputs and fp32 elementwise results."""

import pytest
import torch

from tests.models.helpers import FAMILIES, build_seeded, tiny_args

CASES = [("cpu", "torch", False), ("cuda", "triton", True)]  # the cast precedes the backend choice


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("device, backend, gpu", [
    pytest.param(d, b, g, marks=[pytest.mark.gpu] if g else [], id=f"{d}-{b}") for d, b, g in CASES])
def test_model_trains_under_autocast_with_fp32_parameters(family, device, backend, gpu):
    if gpu and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    size = dict(hidden_size=256, head_dim=64, num_heads=4, num_slots=32) if gpu else {}
    model = build_seeded(tiny_args(family, backend=backend, **size)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 97, (2, 64 if gpu else 24), device=device, generator=None)
    losses = []
    for _ in range(3):
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        assert all(p.grad is None or (p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all())
                   for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
