"""Each family: forward/backward of a tiny model is finite, every parameter gets a gradient, and
the loss falls within a few optimizer steps on a fixed batch. Plus build-time errors, the FLOP
formula and the parameter names the optimizer relies on."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flame.models import GSAForCausalLM, RWKV6ForCausalLM, RWKV7ForCausalLM, build_model, l2wrap
from tests.models.helpers import FAMILIES, build_seeded, tiny_args


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_model_trains_on_a_fixed_batch(family):
    args = tiny_args(family, num_layers=2)
    model = build_seeded(args, seed=1)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, args.vocab_size, (2, 25), generator=gen)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    valid = torch.ones_like(labels, dtype=torch.bool)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99))
    losses = []
    for step in range(6):
        logits = model(inputs)
        assert logits.shape == (*inputs.shape, args.vocab_size) and torch.isfinite(logits).all()
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        if family != "gsa":  # the RWKV families' training loss (model.l2wrap)
            loss = l2wrap(loss, logits, valid, labels.numel())
        optimizer.zero_grad()
        loss.backward()
        for name, p in model.named_parameters():
            assert p.grad is not None, f"{name} gets no gradient (unused parameter)"
            assert torch.isfinite(p.grad).all(), f"{name}: non-finite gradient at step {step}"
        optimizer.step()
        losses.append(loss.item())
    uniform = torch.log(torch.tensor(float(args.vocab_size))).item()
    assert losses[0] < 1.1 * uniform, f"{family}: initial loss {losses[0]:.3f} far above ln(vocab) = {uniform:.3f}"
    assert losses[-1] < losses[0] - 0.5, f"{family}: loss did not fall: {losses}"


def test_build_model_picks_the_family_and_rejects_bad_args():
    assert isinstance(build_seeded(tiny_args("rwkv6", num_layers=1)), RWKV6ForCausalLM)
    assert isinstance(build_seeded(tiny_args("rwkv7", num_layers=1)), RWKV7ForCausalLM)
    assert isinstance(build_seeded(tiny_args("gsa", num_layers=1)), GSAForCausalLM)
    with pytest.raises(ValueError, match="unknown model family 'mamba'"):
        build_model(tiny_args("mamba"))
    with pytest.raises(ValueError, match="multiple of head_dim"):
        build_model(tiny_args("rwkv7", head_dim=24))
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        build_model(tiny_args("gsa", num_heads=4, num_kv_heads=3))
    model = build_seeded(tiny_args("rwkv7", num_layers=1))
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.zeros(2, 3, 4, dtype=torch.long))


def test_gsa_grouped_queries_build_and_run():
    args = tiny_args("gsa", num_heads=4, num_kv_heads=2, num_layers=1)
    model = build_seeded(args)
    att = model.layers[0].attn
    assert att.k_proj.weight.shape == (2 * 16, 64) and att.f_proj.weight.shape == (2 * 8, 64)
    assert torch.isfinite(model(torch.randint(0, 97, (1, 9)))).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_num_flops_per_token_counted_by_hand(family):
    """tiny_args(family, num_layers=2) counted by hand (docs/architecture.md, "FLOPs per token and
    MFU"): C = 64, vocab 97; RWKV: H = 4 heads of K = V = 16; GSA: H = HQ = 2 heads of d = 32, M = 8
    slots. F = 6 x (non-embedding parameters) + the state terms."""
    C, head = 64, 97 * 64  # head: the LM head's matmul, counted tied or not
    params, state = {
        # per layer: r, k, v, g, output 5 C^2; ffn receptance C^2, key and value 2 x 224 C (width 3.5 C);
        # mix LoRA C x 160 + 5 x 32 x C; decay LoRA C x 64 + 64 x C; vectors: attn_norm 2, mu 6,
        # time_decay 1, bonus H K = 1, ln_x 2, ffn_norm 2, ffn mu 2 = 16 C. Once: pre_norm 2 C, final
        # norm 2 C. State: o = S^T r 2KV, e^w * S KV, + k v^T 2KV = 5 K V per head, x 3.
        "rwkv6": (2 * (6 * C * C + (160 + 160 + 64 + 64 + 2 * 224) * C + 16 * C) + 4 * C + head,
                  2 * 3 * 5 * 4 * 16 * 16),
        # per layer: r, k, v, output 4 C^2; ffn 2 x 256 C (width 4 C); LoRAs w, a, g 3 x 2 x 32 C; vectors:
        # attn_norm 2, mu 6, w0 a0 k_k k_a 4, r_k 1, ln_x 2, ffn_norm 2, ffn mu 1 = 18 C. Layer 1 only:
        # the v LoRA 2 x 32 C and v0 C. Once: pre_norm 2 C, final norm 2 C.
        # State: a^T S 2KV, e^w * S KV, + b p 2KV, + k v^T 2KV, S^T q 2KV = 9 K V per head, x 3.
        "rwkv7": (2 * (4 * C * C + 512 * C + 192 * C + 18 * C) + 64 * C + C + 4 * C + head,
                  2 * 3 * 9 * 4 * 16 * 16),
        # per layer: q, k, v, o 4 C^2; f_proj H M x C = 16 C; SwiGLU 3 x 256 C; attn_norm, g_norm, mlp_norm
        # 3 C. Once: final norm C. State: per key/value head two updates 3 d M + 3 M d, per query head
        # two reads 2 d M + 2 M d, x 3.
        "gsa": (2 * (4 * C * C + 16 * C + 768 * C + 3 * C) + C + head,
                2 * 3 * (2 * 6 * 32 * 8 + 2 * 4 * 32 * 8)),
    }[family]
    model = build_seeded(tiny_args(family, num_layers=2))
    assert model.num_params(exclude_embeddings=True) == params  # the hand count's parameters are the model's
    assert model.num_flops_per_token() == 6 * params + state
    tied = build_seeded(tiny_args(family, num_layers=2, tie_word_embeddings=True))
    assert tied.num_flops_per_token() == 6 * params + state  # the tied head still costs its matmul


FREE_PARAMETERS = {
    "rwkv6": {"mu_x", "mu_w", "mu_v", "mu_g", "mix_w1", "mix_w2", "time_decay", "decay_w1", "decay_w2", "bonus"},
    # v0, v1, v2 exist from layer 1 on
    "rwkv7": {"mu_w", "mu_v", "mu_a", "mu_g", "w0", "w1", "w2", "a0", "a1", "a2", "v0", "v1", "v2", "g1", "g2",
              "k_k", "k_a", "r_k"},
}
LINEARS_PER_LAYER = {"rwkv6": 5 + 3, "rwkv7": 4 + 2}


def test_optimizer_facing_names_and_module_types():
    """Decay bias names (time_decay / w0) exist per layer; LoRA matrices and mixing vectors are
    free parameters, so only the big projections are nn.Linear (weight-decayed)."""
    for family, bias_name in (("rwkv6", "time_decay"), ("rwkv7", "w0")):
        model = build_seeded(tiny_args(family))
        names = [n for n, _ in model.named_parameters() if n.rsplit(".", 1)[-1] == bias_name]
        assert len(names) == len(model.layers)
        linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
        free = [(n, p) for n, p in model.named_parameters()
                if n.rsplit(".", 1)[-1] in FREE_PARAMETERS[family]]
        assert len(free) == len(FREE_PARAMETERS[family]) * len(model.layers) - (family == "rwkv7") * 3
        for name, p in free:
            assert id(p) not in linear, f"{name} must not be an nn.Linear weight"
        assert len(linear) == LINEARS_PER_LAYER[family] * len(model.layers) + 1  # + lm_head
        assert id(model.embeddings.weight) not in linear
