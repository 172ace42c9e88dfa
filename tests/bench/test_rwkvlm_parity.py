"""One training step of flame against RWKV-LM's own trainer step (bench/rwkvlm.py), for RWKV7 (its
x070 trainer, configs/rwkv7_rwkvlm_demo.toml) and RWKV6 (its x060 trainer,
configs/rwkv6_rwkvlm_demo.toml): the same weights (RWKV-LM's generate_init_weight), the same batch,
the demo recipe's hyperparameters; RWKV-LM's wkv6 kernel beside flame's chunk_rwkv6; its RWKV7
kernels and flame's chunk_rwkv7 against the fp64 recurrence. Needs a GPU, an RWKV-LM checkout
(.rwkvlm/RWKV-LM or FLAME_RWKVLM_DIR), pytorch_lightning and the rwkv package; skips without them.
docs/rwkv-lm.md explains the bounds."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from bench import rwkvlm

REPO = Path(__file__).resolve().parents[2]
CONFIGS = {family: str(REPO / "configs" / f"{family}_rwkvlm_demo.toml") for family in rwkvlm.GENERATIONS}
# The embedded corpus through the World tokenizer, so that the test needs no prepared shards.
DATA = ["--data.shard_dir", "", "--data.dataset", "embedded", "--data.data_files", "[]"]
# Tensors RWKV-LM's model holds that flame's has no place for (flame.weights.rwkv_names).
NOT_COMPARED = {"rwkv7": {"blocks.0.att.v0", "blocks.0.att.v1", "blocks.0.att.v2"}, "rwkv6": set()}


def needs_rwkvlm(family: str):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    for module in ("pytorch_lightning", "rwkv"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module}")
    try:
        rwkvlm.rwkvlm_dir(family)
    except rwkvlm.RwkvLmMissing as err:
        pytest.skip(str(err))


@pytest.mark.gpu
@pytest.mark.parametrize("family", rwkvlm.GENERATIONS)
def test_one_step_of_flame_equals_rwkvlms_trainer(tmp_path, family):
    needs_rwkvlm(family)
    cfg = rwkvlm.job_config(CONFIGS[family], DATA)
    batch = rwkvlm.first_batch(cfg)
    init = tmp_path / "init.pth"
    rwkvlm.write_init(cfg, 0, init)
    result = rwkvlm.one_step_parity(cfg, init, batch["input_ids"], batch["labels"])
    print(rwkvlm.parity_table(result))
    assert result["loss"]["relative"] <= 2e-3, result["loss"]
    worst = max(result["grad"], key=result["grad"].get)
    assert result["grad"][worst] <= 2e-2, (worst, result["grad"][worst])
    # The optimizer alone (RWKV-LM's gradients through flame's groups, LR, clipping and AdamW):
    # equal up to fp32 rounding.
    worst = max(result["optimizer"], key=result["optimizer"].get)
    assert result["optimizer"][worst] <= 1e-5, (worst, result["optimizer"][worst])
    # After one update from each trainer's own gradients. A tensor that starts at zero holds
    # -lr x sign(gradient) after AdamW's first update, so there the two trainers differ where a
    # near-zero gradient's sign differs: bounded as a fraction of elements (docs/rwkv-lm.md).
    nonzero_start = {n: v for n, v in result["step"].items() if n not in result["zero_start_sign_flips"]}
    worst = max(nonzero_start, key=nonzero_start.get)
    assert nonzero_start[worst] <= 2e-2, (worst, nonzero_start[worst])
    flips = result["zero_start_sign_flips"]
    worst = max(flips, key=flips.get)
    assert flips[worst] <= 1e-2, (worst, flips[worst])
    assert set(result["not_compared"]) <= NOT_COMPARED[family]


@pytest.mark.gpu
def test_rwkvlms_wkv6_kernel_equals_chunk_rwkv6():
    """RWKV-LM's x060 attention (RUN_CUDA_RWKV6: bf16 r, k, v, w, u; decay exp(-exp(w)) in fp32
    inside) and flame's chunk_rwkv6 on the same values (log-decay -exp(w) in fp32), at the demo's
    head size and ctx_len: output and the five gradients within the bf16 bound of the step's
    gradients (2e-2 relative RMS). The one-step test cannot see this kernel: at RWKV-LM's init the
    zero output projections give every tensor before them a zero gradient."""
    needs_rwkvlm("rwkv6")
    from flame.ops import chunk_rwkv6

    B, T, H, N = 4, 512, 12, 64
    model_module, _ = rwkvlm.import_rwkvlm("rwkv6", N, T)
    generator = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, device="cuda", generator=generator) * scale + shift).bfloat16()

    # w spans RWKV-LM's time_decay init, -6 to -1, plus a LoRA's spread.
    r, k, v = randn(B, T, H * N), randn(B, T, H * N, scale=0.1), randn(B, T, H * N)
    w, u = randn(B, T, H * N, scale=1.0, shift=-3.5), randn(H, N, scale=0.3)
    grad_out = randn(B, T, H * N)
    theirs_in = [t.clone().requires_grad_() for t in (r, k, v, w, u)]
    theirs = model_module.RUN_CUDA_RWKV6(*theirs_in)
    theirs.backward(grad_out)

    ours_in = [t.float().requires_grad_() for t in (r, k, v, w, u)]
    rr, kk, vv, ww = (t.view(B, T, H, N) for t in ours_in[:4])
    ours, _ = chunk_rwkv6(rr, kk, vv, -torch.exp(ww), ours_in[4], scale=1.0)
    ours = ours.reshape(B, T, H * N)
    ours.backward(grad_out.float())

    errors = {"o": rwkvlm.relative_rms(theirs.float(), ours.detach())}
    for name, a, b in zip("rkvwu", theirs_in, ours_in):
        errors[f"d{name}"] = rwkvlm.relative_rms(a.grad.float(), b.grad)
    print(errors)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 2e-2, (worst, errors)


@pytest.mark.gpu
@pytest.mark.parametrize("lib", ["rwkvlm", "rwkvlm_h100"])
def test_rwkvlms_rwkv7_kernels_and_chunk_rwkv7_match_the_fp64_recurrence(lib):
    """RWKV-LM's RWKV7 kernels as bench.ops times them (bench/rwkvlm_kernels.py: the decay's logit
    in, exp(-exp(-0.5) sigmoid) inside) and flame's chunk_rwkv7 on the layer's log-decay, both from
    the same bf16 values, against the fp64 step-by-step recurrence: the output and all six gradients
    (through the logit) within bf16 level, 2e-2 relative RMS. A kernel row of bench.ops compares
    two implementations of the same function only if this holds."""
    needs_rwkvlm("rwkv7")
    from bench.ops import RWKV7_LOG_DECAY_BOUND, _rwkv7_logit_inputs
    from bench.rwkvlm_kernels import attention
    from flame.ops.rwkv7.chunk import chunk_rwkv7
    from flame.ops.rwkv7.naive import naive_rwkv7

    x = _rwkv7_logit_inputs(torch.bfloat16, "cuda", B=2, T=256, H=4, K=64, V=64)
    names = ["r", "w", "k", "v", "a", "b"]
    do = torch.randn(2, 256, 4, 64, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))

    def run(fn, dtype):
        leaves = [x[n].detach().to(dtype).requires_grad_() for n in names]
        o = fn(*leaves)
        o.backward(do.to(o.dtype))
        return [o.detach().double()] + [t.grad.double() for t in leaves]

    def logit_to_decay(fn, **options):
        return lambda r, w, *rest: fn(r, RWKV7_LOG_DECAY_BOUND * torch.sigmoid(w), *rest, scale=1.0, **options)[0]

    reference = run(logit_to_decay(naive_rwkv7), torch.float64)
    theirs = run(attention(lib), torch.bfloat16)
    ours = run(logit_to_decay(chunk_rwkv7, backend="triton", gate_lower_bound=RWKV7_LOG_DECAY_BOUND), torch.bfloat16)
    labels = ["o"] + [f"d{n}" for n in names]
    errors = {who: {label: rwkvlm.relative_rms(got, want) for label, got, want in zip(labels, result, reference)}
              for who, result in (("rwkvlm", theirs), ("flame", ours))}
    print(lib, errors)
    for who, per_tensor in errors.items():
        worst = max(per_tensor, key=per_tensor.get)
        assert per_tensor[worst] <= 2e-2, (who, worst, per_tensor)
