"""GSA Triton kernels (chunked and fused recurrent) against the fp64 step-by-step oracle naive_gsa.

CPU runs use the Triton interpreter (set by conftest); the hazards are those of
docs/kernels.md#hazard-tests that apply to GSA. GPU-only tests (bf16, T = 4096) are marked `gpu`.
"""

import pytest
import torch

from flame.ops import chunk_gsa, fused_recurrent_gsa
from flame.ops.gsa.chunk_triton import chunk_gsa_triton
from flame.ops.gsa.fused_recurrent_triton import fused_recurrent_gsa_fwd
from flame.ops.gsa.naive import naive_gsa
from tests.ops.assertions import assert_close, assert_finite
from tests.ops.inputs import (grad_leaves, loss_of, make_cu_seqlens, make_gsa_inputs, random_like,
                              to_reference, varlen_state)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RATIO = {torch.float32: 5e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _run(op, inputs, scale, cu_seqlens=None, with_dht=True, seed=7, **kw):
    """Forward + backward of op on inputs; returns (o, final_state, {name: grad})."""
    o, fs = op(**inputs, scale=scale, output_final_state=True, cu_seqlens=cu_seqlens, **kw)
    do = random_like(o, seed)
    dht = random_like(fs, seed + 1) if with_dht else None
    leaves = grad_leaves(inputs)
    grads = torch.autograd.grad(loss_of(o, fs, do, dht), list(leaves.values()), allow_unused=True)
    return o, fs, dict(zip(leaves, grads))


def check_against_naive(op, inputs, scale=None, cu_seqlens=None, with_dht=True, ratio=None, **kw):
    """Compare o, final states and every gradient of op with naive_gsa in float64; all finite."""
    dtype = inputs["q"].dtype
    ratio = ratio or RATIO[dtype]
    scale = inputs["q"].shape[-1] ** -0.5 if scale is None else scale
    o, fs, grads = _run(op, inputs, scale, cu_seqlens, with_dht, **kw)
    ref_inputs = to_reference(inputs)
    ro, rfs, rgrads = _run(naive_gsa, ref_inputs, scale, cu_seqlens, with_dht)
    assert o.dtype == dtype and fs[0].dtype == torch.float32 and fs[1].dtype == torch.float32
    assert_close("o", ro, o, ratio)
    assert_close("hk_final", rfs[0], fs[0], ratio)
    assert_close("hv_final", rfs[1], fs[1], ratio)
    assert set(grads) == set(rgrads)
    for name, grad in grads.items():
        assert grad is not None, f"d{name} was not produced"
        assert_finite(f"d{name}", grad)
        assert_close(f"d{name}", rgrads[name], grad, ratio, atol=_atol(name, ref_inputs, rgrads, dtype))
    return o, fs, grads


def _atol(name, ref_inputs, rgrads, dtype):
    """Absolute floor of the comparison. dg comes from identity I2
    (docs/kernels.md#gate-gradients-by-reverse-cumsum-i2), a reverse sum of
    the differences z dz + p dp - s ds whose terms cancel exactly when every gate underflows (the
    true dg is then 0 in fp64), so its fp32 rounding floor is relative to the size of the terms:
    max|s * ds|, itself checked against the oracle."""
    if name != "g":
        return 1e-6
    terms = (ref_inputs["s"] * rgrads["s"]).abs().max().item()
    return (1e-5 if dtype == torch.float32 else 1e-4) * terms


def gsa_inputs(B=1, T=40, H=1, K=16, V=16, M=16, dtype=torch.float32, **kw):
    return make_gsa_inputs(B, T, H, K, V, M, dtype=dtype, device=DEVICE, requires_grad=True, **kw)


def _triton(public_op):
    def op(**kw):
        return public_op(**kw, backend="triton")
    return op


# the public ops with the Triton backend (validation + dispatch + kernels)
OPS = {"chunk": _triton(chunk_gsa), "fused_recurrent": _triton(fused_recurrent_gsa)}


@pytest.fixture(params=list(OPS))
def op(request):
    return OPS[request.param]


# ------------------------------------------------------------------------------------ hazards

@pytest.mark.parametrize("decay,dtype", [
    ("extreme", torch.float32), ("extreme", torch.bfloat16), ("wide", torch.float32), ("wide", torch.bfloat16),
    (-1e3, torch.float32), (-1e4, torch.bfloat16)])
def test_extreme_log_decays(op, decay, dtype):
    """Extreme log-decays: log-forget gates down to -150 per step, and constants that underflow exp."""
    check_against_naive(op, gsa_inputs(T=70, decay=decay, dtype=dtype))


def test_forget_logits_of_minus_60_stay_finite_and_match_fp64(op):
    """docs/known-failures.md#nan-gradients-from-large-log-decays: forget logits of -60 and below must
    give finite, fp64-matching outputs
    and gradients in fp32 and bf16 (the exclusive-reference exp(+|g|) overflow)."""
    for dtype in (torch.float32, torch.bfloat16):
        inputs = gsa_inputs(T=80, decay=-60.0, dtype=dtype)
        with torch.no_grad():  # mix a strong constant with extreme random gates, still <= -60
            inputs["g"].copy_(inputs["g"] - 40 * torch.rand_like(inputs["g"]))
        check_against_naive(op, inputs)


@pytest.mark.parametrize("decay", ["zero", "half_zero"])
def test_zero_decay(op, decay):
    """Zero decay: g == 0 (decay 1) everywhere or on half the entries; long-range accumulation.
    s is drawn independently of g here, otherwise s = 1 - exp(g) would be 0 wherever g is."""
    inputs = gsa_inputs(T=100, decay=decay)
    with torch.no_grad():
        inputs["s"].copy_(torch.rand_like(inputs["s"]) * 0.1)
    check_against_naive(op, inputs)


@pytest.mark.parametrize("T", [1, 15, 63, 65, 130])
def test_partial_chunks_strong_gates(op, T):
    """Partial last chunk: T not a multiple of the chunk size, with g = -50 so that a padding row loaded
    with gate 0 instead of a select would overflow in the backward contractions."""
    check_against_naive(op, gsa_inputs(T=T, decay=-50.0))


@pytest.mark.parametrize("K,V", [(64, 128), (128, 64), (32, 256), (60, 100)])
def test_initial_state_k_ne_v(op, K, V):
    """Non-square states (the known failure of state tiles when K and V differ): K != V with a random
    initial state pair and its gradient."""
    check_against_naive(op, gsa_inputs(T=20, H=1, K=K, V=V, M=32))


@pytest.mark.parametrize("with_dht", [True, False])
def test_state_gradients(op, with_dht):
    """Final-state gradient, initial-state gradient: random final-state gradients, and dh0 with and without them."""
    check_against_naive(op, gsa_inputs(B=2, T=40, H=2), with_dht=with_dht)


def test_zero_initial_state_gets_gradient(op):
    """Initial-state gradient: h0 = 0 with requires_grad still receives its (non-zero) gradient."""
    inputs = gsa_inputs(T=30)
    with torch.no_grad():
        for h in inputs["initial_state"]:
            h.zero_()
    _, _, grads = check_against_naive(op, inputs)
    assert grads["initial_state.0"].abs().max() > 0 and grads["initial_state.1"].abs().max() > 0


def test_no_initial_state(op):
    check_against_naive(op, gsa_inputs(B=2, T=33, initial_state=False))


def test_varlen_matches_per_sequence(op):
    """Varlen equivalence: packed sequences of lengths {1, 15, 64, 65, 100} with per-sequence states equal
    the oracle run sequence by sequence (naive_gsa restarts at every boundary)."""
    lengths = [1, 15, 64, 65, 100]
    cu = make_cu_seqlens(lengths, device=DEVICE)
    inputs = varlen_state(gsa_inputs(T=sum(lengths)), len(lengths))
    check_against_naive(op, inputs, cu_seqlens=cu)


@pytest.mark.parametrize("case", ["varlen", "k_ne_v_partial", "no_final_state_gradient"])
def test_walk_states(walk_states, case):
    """The walk over chunks (the state passes at training batch sizes; the other tests take the split
    pass) on varlen, K != V with partial chunks and initial states, and without a final-state gradient."""
    op = OPS["chunk"]
    if case == "varlen":
        lengths = [1, 15, 64, 65, 100]
        cu = make_cu_seqlens(lengths, device=DEVICE)
        check_against_naive(op, varlen_state(gsa_inputs(T=sum(lengths)), len(lengths)), cu_seqlens=cu)
    elif case == "k_ne_v_partial":
        check_against_naive(op, gsa_inputs(B=2, T=130, K=60, V=100, M=32))
    else:
        check_against_naive(op, gsa_inputs(B=2, T=70, H=2), with_dht=False)


def test_varlen_length_one_sequence(op):
    """A length-1 sequence first, in the middle and last of a packed batch."""
    lengths = [1, 20, 1, 9, 1]
    cu = make_cu_seqlens(lengths, device=DEVICE)
    inputs = varlen_state(gsa_inputs(T=sum(lengths), HQ=2), len(lengths))
    check_against_naive(op, inputs, cu_seqlens=cu)


def test_single_token(op):
    """Chunk-size invariance: exactly one token (decode)."""
    check_against_naive(op, gsa_inputs(B=3, T=1))


def test_softmax_large_spread(op):
    """GSA softmax: scale 1 and |q|, |k| up to ~10, so slot scores spread over hundreds; the softmax
    must be max-stabilised in fp32 and its gradient dz = p (dp - <p, dp>) must match autograd."""
    inputs = gsa_inputs(T=40, K=32, M=32, decay="weak")
    with torch.no_grad():
        inputs["q"].mul_(4)
        inputs["k"].mul_(4)
    check_against_naive(op, inputs, scale=1.0)


def test_softmax_probabilities_sum_to_one():
    """GSA softmax: the fp32 slot probabilities saved by the forward equal the fp64 softmax and sum to 1."""
    inputs = make_gsa_inputs(1, 40, 2, 32, 16, 32, device=DEVICE, decay="weak")
    q, k, v, s, g = (inputs[n] * (8 if n in "qk" else 1) for n in "qkvsg")
    hk0, hv0 = inputs["initial_state"]
    _, p, _, _ = fused_recurrent_gsa_fwd(q, k, v, s, g, 1.0, hk0, hv0, False, None)
    assert p.dtype == torch.float32
    sums = p.double().sum(-1)
    assert (sums - 1).abs().max() < 1e-5
    # reference slot scores z_t, recomputed step by step in float64
    hk = hk0[0].double().clone()
    zs = []
    for t in range(q.shape[1]):
        hk = hk * g[0, t].double().exp()[:, None, :] + k[0, t].double()[:, :, None] * s[0, t].double()[:, None, :]
        zs.append(torch.einsum("hk,hkm->hm", q[0, t].double(), hk))
    z = torch.stack(zs)
    assert z.max() - z.min() > 200, "the test needs a large score spread"
    assert_close("p", z.softmax(-1), p[0], 1e-5)


@pytest.mark.parametrize("M", [5, 64])
def test_slot_softmax_backward_kernel_matches_autograd_in_fp64(M):
    """The backward's softmax kernel: dz = p (dp - <p, dp>) over the M slots of every row, on a row count
    that is not a multiple of the kernel's row block and an M that is not a power of two."""
    from flame.ops.gsa.chunk_triton import softmax_bwd

    gen = torch.Generator().manual_seed(3)
    z = (4 * torch.randn(3, 37, 2, M, generator=gen, dtype=torch.float64)).requires_grad_()
    dp = torch.randn(z.shape, generator=gen, dtype=torch.float64)
    p = z.softmax(-1)
    (dz_ref,) = torch.autograd.grad(p, z, dp)
    dz = softmax_bwd(p.detach().float().to(DEVICE), dp.float().to(DEVICE))
    assert dz.dtype == torch.float32
    assert_close("dz", dz_ref, dz.cpu(), 1e-5)


@pytest.mark.parametrize("K,V,M", [(60, 100, 32), (8, 8, 8), (16, 24, 5), (16, 32, 64), (32, 16, 128)])
def test_head_dims(op, K, V, M):
    """Odd head dims: non-power-of-two head dims, dims below 16 (padded with masks), M up to 128. Up to
    64 slots the softmax's backward runs in the dq/dk/dg kernel's epilogue (masked slot columns at
    M = 5); at 128 in its own kernel."""
    check_against_naive(op, gsa_inputs(T=24, H=1, K=K, V=V, M=M))


def test_grouped_queries(op):
    """GQA: HQ = 2 H; gradients of k, v, s, g and the states sum over each query group."""
    check_against_naive(op, gsa_inputs(T=37, H=2, HQ=4, decay="strong"))


def test_deterministic_backward(op):
    """Determinism: two runs give bitwise-equal gradients."""
    inputs = gsa_inputs(T=40, HQ=2, V=40)
    scale = 0.25
    _, _, g1 = _run(op, inputs, scale)
    _, _, g2 = _run(op, inputs, scale)
    for name in g1:
        assert torch.equal(g1[name], g2[name]), f"d{name} differs between two runs"


def test_inputs_not_modified(op):
    """Chunked and recurrent kernels disagreeing (a known failure), first half: neither forward nor backward
    modifies any input."""
    inputs = gsa_inputs(T=40, HQ=2)
    before = {n: t.detach().clone() for n, t in grad_leaves(inputs).items()}
    _run(op, inputs, 0.5)
    for name, t in grad_leaves(inputs).items():
        assert torch.equal(t.detach(), before[name]), f"{name} was modified"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(op, dtype):
    """16-bit inputs at CPU size: 16-bit inputs, fp32 internals, fp32 final states."""
    check_against_naive(op, gsa_inputs(T=64, HQ=2, dtype=dtype))


# ------------------------------------------------------------------------------ chunk specific

@pytest.mark.parametrize("chunk_size", [16, 32, 64])
def test_chunk_size_invariance(chunk_size):
    """Chunk-size invariance: chunk sizes 16, 32 and 64 all match the oracle (T = 70: partial last chunks)."""
    check_against_naive(chunk_gsa_triton, gsa_inputs(T=70, decay="strong"), chunk_size=chunk_size)


def test_recompute_levels_agree():
    """Saving the cumsum and states (level 0) or recomputing them (1, 2) gives bitwise-equal results."""
    inputs = gsa_inputs(T=70, HQ=2)
    runs = [_run(chunk_gsa_triton, inputs, 0.5, recompute_level=level) for level in (0, 1, 2)]
    for o, fs, grads in runs[1:]:
        assert torch.equal(o, runs[0][0])
        for name in grads:
            assert torch.equal(grads[name], runs[0][2][name]), f"d{name} depends on the recompute level"


def test_chunk_and_recurrent_agree_with_each_other_and_fp64():
    """docs/known-failures.md#chunked-and-recurrent-kernels-disagree: chunked and recurrent kernels agree
    with each other (and each with fp64,
    above), outputs, final states and every gradient including the states'; inputs untouched."""
    inputs = gsa_inputs(T=70, HQ=2, K=32, V=48, M=32, decay="strong")
    before = {n: t.detach().clone() for n, t in grad_leaves(inputs).items()}
    oc, fc, gc = _run(OPS["chunk"], inputs, 0.5)
    orr, fr, gr = _run(OPS["fused_recurrent"], inputs, 0.5)
    for name, t in grad_leaves(inputs).items():
        assert torch.equal(t.detach(), before[name]), f"{name} was modified"
    assert_close("o", orr, oc, 1e-4)
    assert_close("hk_final", fr[0], fc[0], 1e-4)
    assert_close("hv_final", fr[1], fc[1], 1e-4)
    for name in gr:
        assert_close(f"d{name}", gr[name], gc[name], 1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------- GPU only

@pytest.mark.gpu
@pytest.mark.parametrize("decay", ["strong", "weak"])
@pytest.mark.parametrize("name", list(OPS))
def test_gpu_bf16_long(name, decay):
    """16-bit inputs on the GPU: bf16 inputs at T = 4096 with strong and weak gates, fp32 internals,
    against naive_gsa in float64 on the same values (ratio 1e-2, docs/kernels.md#test-metric)."""
    check_against_naive(OPS[name], gsa_inputs(B=1, T=4096, H=2, K=64, V=128, M=64, dtype=torch.bfloat16,
                                              decay=decay), ratio=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("decay", ["strong", "weak", "extreme"])
def test_gpu_chunk_vs_recurrent_bf16(decay):
    """Chunk against fused recurrent in bf16 at realistic size (B2 T4096 H4 K=V=256 M64), GQA off.
    Each is within 1e-2 of the fp64 oracle (test_gpu_bf16_long; at this head shape
    test_gpu_gsa_340M_head_shape_bf16_long); their difference within 2e-2."""
    inputs = gsa_inputs(B=2, T=4096, H=4, K=256, V=256, M=64, dtype=torch.bfloat16, decay=decay)
    oc, fc, gc = _run(OPS["chunk"], inputs, 1.0)
    orr, fr, gr = _run(OPS["fused_recurrent"], inputs, 1.0)
    assert_close("o", orr, oc, 2e-2)
    assert_close("hk_final", fr[0], fc[0], 2e-2)
    assert_close("hv_final", fr[1], fc[1], 2e-2)
    for name in gr:
        assert_close(f"d{name}", gr[name], gc[name], 2e-2)


def test_chunk_at_the_gsa_340M_head_shape_bf16():
    """The chunk kernel at gsa_340M's head shape (K = V = 256, M = 64) in bf16 against naive_gsa in
    float64, at CPU size (T = 70: a whole chunk and a partial one; the GPU test below runs both
    kernels at T = 2048)."""
    check_against_naive(OPS["chunk"], gsa_inputs(T=70, K=256, V=256, M=64, dtype=torch.bfloat16, decay="strong"))


@pytest.mark.gpu
@pytest.mark.parametrize("decay", ["strong", "weak", "extreme"])
@pytest.mark.parametrize("name", list(OPS))
def test_gpu_gsa_340M_head_shape_bf16_long(name, decay):
    """gsa_340M's head shape (K = V = 256, M = 64) in bf16 at T = 2048, H = 4, against naive_gsa in
    float64 (test_gpu_chunk_vs_recurrent_bf16 compares the two kernels at this shape with each
    other only)."""
    check_against_naive(OPS[name], gsa_inputs(B=1, T=2048, H=4, K=256, V=256, M=64, dtype=torch.bfloat16,
                                              decay=decay), ratio=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("decay", ["strong", "weak"])
def test_gpu_walk_bf16_long(walk_states, decay):
    """The state passes as a training batch runs them (the walk over chunks, state in registers) in
    bf16 at T = 4096 (B2 H4 K = V = 128 M64, with initial states) against fp64."""
    check_against_naive(OPS["chunk"], gsa_inputs(B=2, T=4096, H=4, K=128, V=128, M=64, dtype=torch.bfloat16,
                                                 decay=decay), ratio=1e-2)


@pytest.mark.gpu
def test_gpu_varlen_gqa_fp32():
    """fp32, GQA and packed sequences (a length-1 one included) at GPU size against the oracle."""
    lengths = [1, 700, 64, 1235]
    cu = make_cu_seqlens(lengths, device=DEVICE)
    inputs = varlen_state(gsa_inputs(T=sum(lengths), H=2, HQ=4, K=64, V=96, M=32, decay="strong"), len(lengths))
    for op in OPS.values():
        check_against_naive(op, inputs, cu_seqlens=cu)


def assert_same_forward(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Bitwise under the interpreter (the same numpy operations); on the GPU the kernel compiled
    without the z store is another binary, whose compiler may contract multiply-adds differently,
    so there the two agree to fp32 rounding."""
    if DEVICE == "cpu":
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_inference_stores_no_slot_scores():
    """Without autograd (eval, prefill) the fixed-length custom op returns an empty z (only the
    backward reads the slot scores), and the output and final states equal the training forward's
    (bitwise on CPU, to fp32 rounding on the GPU), on the custom op and on the varlen path."""
    inputs = gsa_inputs(B=2, T=40)
    args = dict(scale=0.5, output_final_state=True)
    o, (hk, hv) = chunk_gsa_triton(**inputs, **args)
    with torch.no_grad():
        o_ng, (hk_ng, hv_ng) = chunk_gsa_triton(**inputs, **args)
        q, k, v, s, g = (inputs[n] for n in "qkvsg")
        hk0, hv0 = inputs["initial_state"]
        outs = torch.ops.flame.chunk_gsa_fwd(q, k, v, s, g, hk0, hv0, 0.5, True, 64, False)
        assert outs[3].numel() == 0 and outs[4].shape == (*q.shape[:3], s.shape[-1])
    for got, expected in ((o_ng, o), (hk_ng, hk), (hv_ng, hv)):
        assert_same_forward(got, expected.detach())

    lengths = [7, 33]
    cu = make_cu_seqlens(lengths, device=DEVICE)
    packed = varlen_state(gsa_inputs(T=sum(lengths)), len(lengths))
    o, (hk, hv) = chunk_gsa_triton(**packed, **args, cu_seqlens=cu)
    with torch.no_grad():
        o_ng, (hk_ng, hv_ng) = chunk_gsa_triton(**packed, **args, cu_seqlens=cu)
    for got, expected in ((o_ng, o), (hk_ng, hk), (hv_ng, hv)):
        assert_same_forward(got, expected.detach())
