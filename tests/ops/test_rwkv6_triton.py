"""RWKV6 Triton kernels (chunked and fused recurrent) against the fp64 step-by-step oracle naive_rwkv6.

CPU runs use the Triton interpreter (set by conftest), with small shapes; the hazards are those of
docs/kernels.md#hazard-tests that apply to RWKV6, and the known failures of docs/known-failures.md on state
tiles when K != V, NaN gradients from large log-decays, and chunked and recurrent kernels
disagreeing.
GPU-only tests (bf16, T up to 4096, realistic sizes) are marked `gpu`: `pytest -m gpu tests/ops`.

A note on dw. By identity I2, dw is a difference of sums of O(1) terms (r * dr' and k * dk'). When
every decay underflows (w = -50, -1e3, -1e4) the true dw is ~0 (exactly 0 in fp64 for -1e3) and
what is left is the fp32 rounding of those sums: a relative error is then meaningless. dw is
compared with the relative metric when it is not tiny, and otherwise with an absolute bound
relative to the size of the terms of the identity (`_assert_dw_close`).
"""

import pytest
import torch

from flame.ops.rwkv6.chunk import chunk_rwkv6
from flame.ops.rwkv6.fused_recurrent import fused_recurrent_rwkv6
from flame.ops.rwkv6.naive import naive_rwkv6
from tests.ops.assertions import assert_close, assert_finite, rel_rms_error
from tests.ops.inputs import (assert_inputs_unchanged, grad_leaves, loss_of, make_cu_seqlens, make_rwkv6_inputs,
                              random_like, to_reference, varlen_state)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RATIO = {torch.float32: 5e-3, torch.float16: 5e-3, torch.bfloat16: 1e-2}


def chunk_triton(**kw):
    return chunk_rwkv6(**kw, backend="triton")


def recurrent_triton(**kw):
    return fused_recurrent_rwkv6(**kw, backend="triton")


OPS = {"chunk": chunk_triton, "recurrent": recurrent_triton}


def _run(op, inputs, scale, cu_seqlens=None, with_do=True, with_dht=True, seed=7):
    """Forward + backward of op; returns (o, final_state, {name: grad})."""
    o, fs = op(**inputs, scale=scale, output_final_state=True, cu_seqlens=cu_seqlens)
    do = random_like(o, seed) if with_do else torch.zeros_like(o)
    dht = random_like(fs, seed + 1) if with_dht else None
    leaves = grad_leaves(inputs)
    grads = torch.autograd.grad(loss_of(o, fs, do, dht), list(leaves.values()), allow_unused=True)
    return o, fs, dict(zip(leaves, grads))


def _assert_dw_close(ref: dict, out: dict, inputs: dict, ratio: float) -> None:
    dw_ref, dw = ref["w"], out["w"]
    assert_finite("dw", dw)
    terms = (inputs["r"].detach().double() * ref["r"]).pow(2).mean().sqrt() + \
        (inputs["k"].detach().double() * ref["k"]).pow(2).mean().sqrt()
    if dw_ref.pow(2).mean().sqrt() > 1e-2 * terms:
        assert_close("dw", dw_ref, dw, ratio)
    else:
        err = (dw_ref - dw.double()).abs().max().item()
        assert err <= ratio * terms.item(), f"dw: max abs error {err:.3e} > {ratio:.0e} x {terms.item():.3e}"


def check_against_naive(op, inputs, scale=1.0, cu_seqlens=None, with_do=True, with_dht=True, ratio=None):
    """op vs naive_rwkv6 in fp64 on the same values: o, final state and every gradient, all finite."""
    dtype = inputs["r"].dtype
    ratio = ratio or RATIO[dtype]
    ref_inputs = to_reference(inputs)
    o, fs, grads = _run(op, inputs, scale, cu_seqlens, with_do, with_dht)
    ro, rfs, rgrads = _run(naive_rwkv6, ref_inputs, scale, cu_seqlens, with_do, with_dht)
    assert o.dtype == dtype and fs.dtype == torch.float32
    if with_do:
        assert_close("o", ro, o, ratio)
    assert_close("final_state", rfs, fs, ratio)
    for name, g in grads.items():
        assert g is not None, f"no gradient for {name}"
        assert g.dtype == inputs[name].dtype, f"d{name}: dtype {g.dtype} != {inputs[name].dtype}"
        if name == "w":
            _assert_dw_close(rgrads, grads, inputs, ratio)
        else:
            assert_close(f"d{name}", rgrads[name], g, ratio)
    return grads


def _inputs(B=1, T=64, H=1, K=16, V=16, dtype=torch.float32, decay="normal", seed=0, initial_state=True):
    return make_rwkv6_inputs(B, T, H, K, V, dtype=dtype, device=DEVICE, decay=decay, seed=seed,
                             initial_state=initial_state, requires_grad=True)


# --- extreme log-decays (#extreme-log-decays, #nan-gradients-from-large-log-decays)

@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("decay", ["extreme", "wide", -1e3, -1e4])
def test_extreme_log_decays(op, decay):
    check_against_naive(OPS[op], _inputs(T=64, decay=decay))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extreme_log_decay_gives_finite_matching_gradients(dtype):
    """NaN gradients from large log-decays (a known failure): exp(+|w|) at the first row of a sub-chunk
    overflowed for |w| >~ 12-20.
    Log-decays -60 and below (and a column of -1e4) must give finite values that match fp64."""
    inputs = _inputs(T=80, K=16, V=32, dtype=dtype, decay="extreme", seed=3)
    with torch.no_grad():
        inputs["w"].mul_(6.0)   # mean about -48 per step, tail far below -60
        inputs["w"][..., 0] = -1e4
    check_against_naive(chunk_triton, inputs, scale=0.5)


# --- zero decay (#zero-decay) ---------------------------------------------------------------------------

@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("decay", ["zero", "half_zero"])
def test_zero_decay(op, decay):
    check_against_naive(OPS[op], _inputs(T=100 if op == "chunk" else 40, decay=decay, seed=1))


# --- partial last chunk with strong decay; masks by select (#partial-last-chunk, #masks-by-select) --------------

@pytest.mark.parametrize("T", [1, 15, 63, 65, 130])
def test_partial_last_chunk_strong_decay(T):
    check_against_naive(chunk_triton, _inputs(T=T, decay=-50.0, seed=T))


def test_masks_by_select_with_large_positive_upper_exponents():
    """w = -30: upper-triangle pairs would have exponents of about +30 * 64; no NaN may leak."""
    inputs = _inputs(B=2, T=64, H=2, K=16, V=16, decay=-30.0, seed=4)
    check_against_naive(chunk_triton, inputs)


# --- initial state with K != V (#non-square-states, #state-tiles-when-k-and-v-differ) -----------------------------

@pytest.mark.parametrize("K,V", [(64, 128), (128, 64), (32, 256), (60, 100)])
def test_initial_state_with_k_ne_v(K, V):
    """State tiles when K and V differ (a known failure): a [BV, BK] pointer tile against a [BK, BV] mask
    when K != V."""
    inputs = _inputs(T=20, K=K, V=V, seed=K + V)
    for op in OPS.values():
        grads = check_against_naive(op, inputs)
        assert grads["initial_state"].shape == (1, 1, K, V)


# --- final-state gradient, initial-state gradient (#final-state-gradient, #initial-state-gradient)

@pytest.mark.parametrize("op", OPS)
def test_final_state_gradient_alone(op):
    """do = 0: every gradient comes from dht through the states (fla's recurrent kernel drops it)."""
    check_against_naive(OPS[op], _inputs(T=70, K=16, V=32, seed=5), with_do=False)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("with_dht", [True, False])
def test_initial_state_gradient(op, with_dht):
    check_against_naive(OPS[op], _inputs(T=40, K=32, V=16, seed=6), with_dht=with_dht)


@pytest.mark.parametrize("op", OPS)
def test_zero_initial_state_still_gets_gradient(op):
    inputs = _inputs(T=30, seed=8)
    with torch.no_grad():
        inputs["initial_state"].zero_()
    grads = check_against_naive(OPS[op], inputs)
    assert grads["initial_state"].abs().sum() > 0


@pytest.mark.parametrize("op", OPS)
def test_without_initial_state(op):
    check_against_naive(OPS[op], _inputs(B=2, T=33, K=16, V=16, initial_state=False, seed=9))


# --- varlen (#varlen-equivalence) ------------------------------------------------------------------------------

@pytest.mark.parametrize("op", OPS)
def test_varlen_matches_per_sequence(op):
    lengths = [1, 15, 64, 65, 30]
    cu = make_cu_seqlens(lengths, device=DEVICE)
    inputs = varlen_state(_inputs(T=sum(lengths), K=16, V=32, decay="strong", seed=10), len(lengths))
    check_against_naive(OPS[op], inputs, scale=0.7, cu_seqlens=cu)


# --- the walk over chunks (the state passes at training batch sizes) on the hazards it touches ----------

@pytest.mark.parametrize("case", ["varlen", "k_ne_v_partial", "final_state_gradient_alone"])
def test_walk_states(walk_states, case):
    if case == "varlen":
        lengths = [1, 15, 64, 65, 30]
        cu = make_cu_seqlens(lengths, device=DEVICE)
        inputs = varlen_state(_inputs(T=sum(lengths), H=2, K=16, V=32, decay="strong", seed=21), len(lengths))
        check_against_naive(chunk_triton, inputs, scale=0.7, cu_seqlens=cu)
    elif case == "k_ne_v_partial":
        check_against_naive(chunk_triton, _inputs(B=2, T=130, K=60, V=100, seed=22), scale=60 ** -0.5)
    else:
        check_against_naive(chunk_triton, _inputs(T=70, K=16, V=32, seed=23), with_do=False)


# --- chunk-size invariance, single chunk, one token (#chunk-size-invariance) ----------------------------

@pytest.mark.parametrize("chunk_size", [16, 32, 64])
@pytest.mark.parametrize("T", [1, 64])
def test_chunk_sizes(chunk_size, T):
    from flame.ops.rwkv6.chunk_triton import chunk_rwkv6_triton

    def op(**kw):
        return chunk_rwkv6_triton(**kw, chunk_size=chunk_size)

    check_against_naive(op, _inputs(T=T, K=16, V=16, seed=11))


# --- head dims that are not powers of two, and small ones (#odd-head-dims) ---------------------

@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("K,V", [(60, 100), (8, 12), (4, 4)])
def test_head_dims(op, K, V):
    check_against_naive(OPS[op], _inputs(B=2, T=24, K=K, V=V, seed=K * V), scale=K ** -0.5)


# --- determinism (#determinism) --------------------------------------------------------------------------

@pytest.mark.parametrize("op", OPS)
def test_backward_is_bitwise_deterministic(op):
    inputs = _inputs(T=70 if op == "chunk" else 20, K=16, V=32, seed=12)
    first = _run(OPS[op], inputs, 1.0)[2]
    second = _run(OPS[op], inputs, 1.0)[2]
    for name in first:
        assert torch.equal(first[name], second[name]), f"d{name} differs between two identical runs"


# --- inputs never modified; chunk and recurrent agree (#chunked-and-recurrent-kernels-disagree) --------------------

@pytest.mark.parametrize("op", [chunk_rwkv6, fused_recurrent_rwkv6], ids=["chunk", "recurrent"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inputs_never_modified(op, dtype):
    """Chunked and recurrent kernels disagreeing (a known failure): one path modified w in place and the
    other read the damaged tensor."""
    inputs = _inputs(T=70, K=16, V=16, dtype=dtype, decay="half_zero", seed=13)
    assert_inputs_unchanged(op, inputs, backend="triton")


def test_chunk_matches_recurrent():
    inputs = _inputs(T=70, K=16, V=16, decay="strong", seed=13)
    o_c, s_c, g_c = _run(chunk_triton, inputs, 1.0)
    o_r, s_r, g_r = _run(recurrent_triton, inputs, 1.0)
    assert_close("o chunk vs recurrent", o_r, o_c, 1e-4)
    assert_close("state chunk vs recurrent", s_r, s_c, 1e-4)
    for name in g_c:
        assert_close(f"d{name} chunk vs recurrent", g_r[name], g_c[name], 1e-4)


# --- GPU: bf16, long sequences, realistic sizes ----------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("T", [1024, 4096])
def test_gpu_bf16_long_against_fp64(T):
    inputs = _inputs(B=2, T=T, H=4, K=64, V=64, dtype=torch.bfloat16, seed=20)
    grads = check_against_naive(chunk_triton, inputs, ratio=1e-2)
    ref = _run(naive_rwkv6, to_reference(inputs), 1.0)[2]
    assert rel_rms_error(ref["w"], grads["w"]) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("T", [2048, 4096])
def test_gpu_walk_bf16_against_fp64(walk_states, T):
    """The state passes as a training batch runs them (the walk over chunks, state in registers) in
    bf16 at T up to 4096, with states and a packed batch of four sequences, against fp64."""
    lengths = [1, T // 2 - 1, 700, T // 2 - 700]
    cu = make_cu_seqlens(lengths, device=DEVICE)
    inputs = varlen_state(_inputs(T=T, H=4, K=64, V=64, dtype=torch.bfloat16, seed=24), len(lengths))
    check_against_naive(chunk_triton, inputs, cu_seqlens=cu, ratio=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("decay", ["extreme", "wide", -1e3])
def test_gpu_bf16_extreme_decays(decay):
    check_against_naive(chunk_triton, _inputs(B=2, T=1000, H=3, K=64, V=128, dtype=torch.bfloat16, decay=decay,
                                              seed=21), ratio=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_chunk_matches_recurrent(dtype):
    inputs = _inputs(B=2, T=2048, H=4, K=64, V=64, dtype=dtype, seed=22)
    o_c, s_c, g_c = _run(chunk_triton, inputs, 1.0)
    o_r, s_r, g_r = _run(recurrent_triton, inputs, 1.0)
    assert_close("o", o_r, o_c, 5e-3)
    assert_close("state", s_r, s_c, 5e-3)
    for name in g_c:
        assert_close(f"d{name}", g_r[name], g_c[name], 5e-3)


@pytest.mark.gpu
def test_gpu_varlen_long():
    lengths = [1, 15, 64, 65, 1000, 2900]
    cu = make_cu_seqlens(lengths, device=DEVICE)
    inputs = varlen_state(_inputs(T=sum(lengths), H=4, K=64, V=64, dtype=torch.bfloat16, seed=23), len(lengths))
    check_against_naive(chunk_triton, inputs, cu_seqlens=cu, ratio=1e-2)
