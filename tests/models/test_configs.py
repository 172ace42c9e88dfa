"""Every config in configs/ loads, builds on the meta device, and has the parameter count of an
analytic formula written out here from the config numbers (independently of flame.models)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flame.config import load_config
from flame.models import build_model

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.toml"))

# Official RWKV7 LoRA ranks (decay, a, v, gate) by width: docs/kernels.md#rwkv7-lora-ranks table, plus C = 128
# (2.5*sqrt(128)/32 = 0.88 -> 1, 1.7*sqrt(128)/32 = 0.60 -> 1, 5*sqrt(128)/32 = 1.77 -> 2) and C = 768
# (2.5*sqrt(768)/32 = 2.17 -> 2, 1.7*sqrt(768)/32 = 1.47 -> 1, 5*sqrt(768)/32 = 4.33 -> 4).
RWKV7_RANKS = {128: (32, 32, 32, 64), 768: (64, 64, 32, 128), 1024: (64, 64, 64, 160),
               2048: (128, 128, 64, 224), 2560: (128, 128, 96, 256), 4096: (160, 160, 96, 320)}
RWKV6_FFN = {768: 2688, 1024: 3584, 2048: 7168, 2560: 8960}  # 3.5 C rounded down to 32
GSA_FFN = {1024: 2816, 2048: 5632}  # 8/3 C rounded up to 256
SIZES = {"340M": (1024, 24), "1B": (2048, 24), "3B": (2560, 32), "7B": (4096, 32)}
"""(hidden size, layers) of each size in the shipped configs' names; 3B and 7B are the shapes of
the published RWKV-7 2.9B and 7.2B and RWKV-6 Finch 3B models."""
PARAMETERS = {"rwkv7_3B": 2_781_109_760, "rwkv7_7B": 6_899_249_152, "rwkv6_3B": 2_928_158_720}
"""The parameter counts that the large configs' guides state."""


def rwkv7_count(m) -> int:
    C, L, V = m.hidden_size, m.num_layers, m.vocab_size
    Dw, Da, Dv, Dg = RWKV7_RANKS[C]
    F = m.ffn_hidden_size or 4 * C
    attention = 4 * C * C + 6 * C + (C + 2 * C * Dw) + (C + 2 * C * Da) + 2 * C * Dg + 3 * C + 2 * C
    value_residual = C + 2 * C * Dv  # layers 1..L-1 only
    ffn = C + 2 * C * F
    return 2 * V * C + 2 * C + 2 * C + L * (4 * C + attention + ffn) + (L - 1) * value_residual


def rwkv6_count(m) -> int:
    C, L, V = m.hidden_size, m.num_layers, m.vocab_size
    F = m.ffn_hidden_size or RWKV6_FFN[C]
    rank_mix, rank_decay = m.mix_low_rank_dim, m.decay_low_rank_dim or 64
    attention = 5 * C * C + 6 * C + 2 * 5 * rank_mix * C + C + 2 * C * rank_decay + C + 2 * C
    ffn = 2 * C + 2 * C * F + C * C
    return 2 * V * C + 2 * C + 2 * C + L * (4 * C + attention + ffn)


def gsa_count(m) -> int:
    C, L, V = m.hidden_size, m.num_layers, m.vocab_size
    heads, kv_heads, M = m.num_heads, m.num_kv_heads or m.num_heads, m.num_slots
    d = C // heads
    F = m.ffn_hidden_size or GSA_FFN[C]
    attention = C * heads * d + 2 * C * kv_heads * d + C * kv_heads * M + heads * d + heads * d * C
    return 2 * V * C + C + L * (2 * C + attention + 3 * C * F)


COUNTS = {"rwkv7": rwkv7_count, "rwkv6": rwkv6_count, "gsa": gsa_count}


def test_every_expected_config_exists():
    names = {p.stem for p in CONFIGS}
    expected = {"tiny", "rwkv7_3B", "rwkv7_7B", "rwkv6_3B"} | {
        f"{f}_{s}" for f in ("rwkv6", "rwkv7", "gsa") for s in ("340M", "1B")}
    assert expected <= names, f"missing configs: {sorted(expected - names)}"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_builds_on_meta_with_analytic_param_count(path):
    cfg = load_config(["--config", str(path)])
    m = cfg.model
    with torch.device("meta"):
        model = build_model(m)
    assert all(p.is_meta for p in model.parameters())
    expected = COUNTS[m.family](m)
    assert model.num_params() == expected, f"{path.name}: {model.num_params():,} != analytic {expected:,}"
    assert model.num_params(exclude_embeddings=True) == expected - m.vocab_size * m.hidden_size


def test_config_sizes_match_the_issue():
    for path in CONFIGS:
        cfg = load_config(["--config", str(path)])
        m, t = cfg.model, cfg.training
        if path.stem == "rwkv7_rwkvlm_demo":
            # RWKV-LM's demo shape; its trainer counts 191,084,544 parameters, layer 0's unused
            # value-residual LoRA (C + 2 x C x 32) included
            assert (m.family, m.vocab_size, m.hidden_size, m.num_layers, m.head_dim) == ("rwkv7", 65536, 768, 12, 64)
            assert COUNTS["rwkv7"](m) == 191_084_544 - (768 + 2 * 768 * 32)
            assert (t.seq_len, t.batch_size, t.activation_checkpoint) == (512, 16, "none")
            continue
        if path.stem == "rwkv6_rwkvlm_demo":
            # RWKV-LM's x060 demo shape (RWKV-v5/demo-training-run.sh with MODEL_TYPE x060)
            assert (m.family, m.vocab_size, m.hidden_size, m.num_layers, m.head_dim) == ("rwkv6", 65536, 768, 12, 64)
            assert (t.seq_len, t.batch_size, t.activation_checkpoint) == (512, 16, "none")
            continue
        if path.stem == "tiny":
            assert m.family == "rwkv7" and m.vocab_size == 8192 and cfg.data.dataset == "embedded"
            assert 1e6 <= COUNTS["rwkv7"](m) <= 1e7, "tiny should have a few million parameters"
            assert cfg.job.dump_folder == "outputs/tiny" and t.device == "auto"
            continue
        family, size = path.stem.split("_")
        assert m.family == family and m.vocab_size == 32000 and t.seq_len == 2048
        assert (m.hidden_size, m.num_layers) == SIZES[size]
        if family == "gsa":
            assert (m.num_heads, m.num_slots) == (4, 64)
        else:
            assert m.head_dim == 64
        assert t.mixed_precision_param == "bfloat16" and t.max_norm == 1.0 and cfg.metrics.log_freq == 10


@pytest.mark.parametrize("name", sorted(PARAMETERS))
def test_the_large_configs_state_their_parameter_count(name):
    """The guide's count is the model's, built on the meta device from the config."""
    path = Path(__file__).resolve().parents[2] / "configs" / f"{name}.toml"
    with torch.device("meta"):
        model = build_model(load_config(["--config", str(path)]).model)
    assert model.num_params() == PARAMETERS[name]
    assert f"{PARAMETERS[name]:,} parameters" in path.read_text().split("[job]")[0]


@pytest.mark.parametrize("overrides, expected", [({}, (False, False)), ({"cache_intermediates": True}, (True, False)),
                                                 ({"recompute_states": True}, (False, True))])
def test_rwkv7_kernel_memory_options_reach_the_op(monkeypatch, overrides, expected):
    """model.cache_intermediates and model.recompute_states are passed by every RWKV7 layer to
    chunk_rwkv7 (both default off)."""
    from flame import ops
    from tests.models.helpers import build_seeded, tiny_args

    seen = []
    real = ops.chunk_rwkv7

    def spy(*args, **kwargs):
        seen.append((kwargs.get("cache_intermediates"), kwargs.get("recompute_states")))
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "chunk_rwkv7", spy)
    args = tiny_args("rwkv7", **overrides)
    model = build_seeded(args)
    model(torch.randint(0, args.vocab_size, (1, 8)))
    assert seen == [expected] * args.num_layers
