"""RWKV7 Triton kernels (chunked DPLR and fused recurrent) against the fp64 step-by-step naive_rwkv7.

CPU runs use the Triton interpreter (set by conftest), with small shapes. The hazards are those of
docs/kernels.md#hazard-tests that apply to RWKV7, plus the named regressions of docs/known-failures.md
(#all-nan-rwkv7-outputs, #chunked-and-recurrent-kernels-disagree). GPU-only tests (bf16, T = 4096,
realistic sizes) are marked `gpu`.
"""

import math
from pathlib import Path

import pytest
import torch

from flame.ops.utils import checks
from flame.ops.rwkv7.chunk import chunk_rwkv7
from flame.ops.rwkv7.chunk_plan import centred_chunk_size
from flame.ops.rwkv7.chunk_triton import chunk_rwkv7_triton
from flame.ops.rwkv7.fused_recurrent import fused_recurrent_rwkv7
from flame.ops.rwkv7.fused_recurrent_triton import fused_recurrent_rwkv7_triton
from flame.ops.rwkv7.naive import naive_rwkv7
from flame.ops.rwkv7.wy_inverse_triton import unit_lower_inverse_triton
from tests.ops.assertions import assert_close, assert_finite, rel_rms_error
from tests.ops.inputs import (RWKV7_LOG_DECAY_BOUND, grad_leaves, loss_of, make_cu_seqlens, make_rwkv7_inputs,
                              random_like, rwkv7_a_b, to_reference, varlen_state)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RATIO = {torch.float32: 5e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}
LB = RWKV7_LOG_DECAY_BOUND
TRAINED_HEAD = Path(__file__).parent / "data" / "rwkv7_340M_layer1_head3_bf16.pt"


def chunk_exact(**kw):
    """The chunk kernels in the exact per-pair regime (no gate bound: C = 16)."""
    return chunk_rwkv7_triton(**kw)


def chunk_centred(**kw):
    """The chunk kernels in the centred tensor-core regime (the RWKV7 layer's bound: C = 32)."""
    return chunk_rwkv7_triton(**kw, gate_lower_bound=LB)


OPS = {"chunk_exact": chunk_exact, "chunk_centred": chunk_centred, "fused_recurrent": fused_recurrent_rwkv7_triton}


def _run(op, inputs, scale, cu_seqlens=None, with_dht=True, seed=7, **kw):
    """Forward + backward of op; returns (o, final_state, {name: grad})."""
    o, ht = op(**inputs, scale=scale, output_final_state=True, cu_seqlens=cu_seqlens, **kw)
    do = random_like(o, seed)
    dht = random_like(ht, seed + 1) if with_dht else None
    leaves = grad_leaves(inputs)
    grads = torch.autograd.grad(loss_of(o, ht, do, dht), list(leaves.values()), allow_unused=True)
    return o, ht, dict(zip(leaves, grads))


def check_against_naive(op, inputs, scale=1.0, cu_seqlens=None, with_dht=True, ratio=None, **kw):
    """o, the final state and every gradient of op against naive_rwkv7 in float64; all finite."""
    dtype = inputs["r"].dtype
    ratio = ratio or RATIO[dtype]
    o, ht, grads = _run(op, inputs, scale, cu_seqlens, with_dht, **kw)
    ref_inputs = to_reference(inputs)
    ro, rht, rgrads = _run(naive_rwkv7, ref_inputs, scale, cu_seqlens, with_dht)
    assert o.dtype == dtype and ht.dtype == torch.float32
    assert_close("o", ro, o, ratio)
    assert_close("final_state", rht, ht, ratio)
    assert set(grads) == set(rgrads)
    for name, grad in grads.items():
        assert grad is not None, f"d{name} was not produced"
        assert_finite(f"d{name}", grad)
        assert_close(f"d{name}", rgrads[name], grad, ratio, atol=_atol(name, ref_inputs, rgrads, dtype))
    return o, ht, grads


def _atol(name, ref_inputs, rgrads, dtype):
    """Absolute floor. dw comes from identity I2, a reverse sum of r dr + a da - k dk - b db whose terms
    cancel exactly when the gates underflow, so its rounding floor is relative to max|k dk|."""
    if name != "w":
        return 1e-6
    terms = (ref_inputs["k"] * rgrads["k"]).abs().max().item()
    return (1e-5 if dtype == torch.float32 else 1e-4) * terms


def rwkv7_inputs(B=1, T=40, H=1, K=16, V=16, dtype=torch.float32, **kw):
    return make_rwkv7_inputs(B, T, H, K, V, dtype=dtype, device=DEVICE, requires_grad=True, **kw)


@pytest.fixture(params=list(OPS))
def op(request):
    return OPS[request.param]


# ------------------------------------------------------------------------------------ basics

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_distribution(op, dtype):
    """The layer's gates, a = -kappa_hat, b = kappa_hat * alpha, partial last chunk, scale != 1."""
    check_against_naive(op, rwkv7_inputs(B=2, T=37, dtype=dtype), scale=0.5)


def test_public_ops_dispatch_to_triton():
    """chunk_rwkv7 / fused_recurrent_rwkv7 with backend='triton' run these kernels."""
    inputs = rwkv7_inputs(T=20)
    for public in (chunk_rwkv7, fused_recurrent_rwkv7):
        check_against_naive(public, inputs, backend="triton")
    check_against_naive(chunk_rwkv7, inputs, backend="triton", gate_lower_bound=LB)


# ------------------------------------------------------------------------------------ hazards

@pytest.mark.parametrize("decay", ["zero", "half_zero"])
def test_zero_decay(op, decay):
    """Zero decay: w == 0 (decay 1) everywhere or on half the entries: no 0*inf, long-range sums."""
    check_against_naive(op, rwkv7_inputs(T=70, decay=decay))


@pytest.mark.parametrize("T", [1, 15, 63, 65, 130])
def test_partial_chunks_strong_gates(T):
    """Partial last chunk: T not a multiple of the chunk size, with w = -50, so that a padding row loaded with
    gate 0 instead of a select would overflow in the backward contractions (exact regime: -50 is far
    outside any usable bound)."""
    check_against_naive(chunk_exact, rwkv7_inputs(T=T, decay=-50.0))
    if T <= 65:
        check_against_naive(fused_recurrent_rwkv7_triton, rwkv7_inputs(T=T, decay=-50.0))


@pytest.mark.parametrize("T", [1, 63, 65, 130])
def test_partial_chunks_centred(T):
    """Partial last chunk in the centred regime (C = 32) with the gate at the bound."""
    check_against_naive(chunk_centred, rwkv7_inputs(T=T, decay=LB))


@pytest.mark.parametrize("K,V", [(64, 128), (128, 64), (32, 256), (60, 100)])
def test_initial_state_k_ne_v(K, V):
    """Non-square states (the known failure of state tiles when K and V differ): random h0 and its gradient,
    several (K, V)."""
    check_against_naive(chunk_centred, rwkv7_inputs(T=20, K=K, V=V))
    check_against_naive(fused_recurrent_rwkv7_triton, rwkv7_inputs(T=9, K=K, V=V))


def test_initial_state_k_ne_v_exact():
    """Non-square states in the exact regime."""
    check_against_naive(chunk_exact, rwkv7_inputs(T=20, K=60, V=100))


@pytest.mark.parametrize("with_dht", [True, False])
def test_state_gradients(op, with_dht):
    """Final-state gradient, initial-state gradient: a random final-state gradient, and dh0 with and without it."""
    check_against_naive(op, rwkv7_inputs(B=2, T=30), with_dht=with_dht)


def test_zero_initial_state_gets_gradient(op):
    """Initial-state gradient: h0 = 0 that requires grad still receives its gradient."""
    inputs = rwkv7_inputs(T=20)
    with torch.no_grad():
        inputs["initial_state"].zero_()
    _, _, grads = check_against_naive(op, inputs)
    assert grads["initial_state"].abs().max() > 0


def test_no_initial_state(op):
    check_against_naive(op, rwkv7_inputs(T=20, initial_state=False))


@pytest.mark.parametrize("name", ["chunk_exact", "chunk_centred", "fused_recurrent"])
def test_varlen(name):
    """Varlen equivalence: lengths {1, 15, 64, 65, 30} packed into one batch, per-sequence h0 and final states."""
    lengths = [1, 15, 64, 65, 30] if name != "chunk_exact" else [1, 15, 17, 33]
    cu = make_cu_seqlens(lengths, device=DEVICE)
    inputs = varlen_state(rwkv7_inputs(T=sum(lengths)), len(lengths))
    check_against_naive(OPS[name], inputs, cu_seqlens=cu)


@pytest.mark.parametrize("bound,chunk", [(LB, 64), (-2.0, 64), (-3.0, 32), (-6.0, 16), (-10.0, None)])
def test_chunk_size_from_bound(bound, chunk):
    """Chunk-size invariance, RWKV7 gate bound: the chunk size of the centred regime is the largest whose
    factors stay within fp32
    headroom, |lb| (C/2 + 1) log2 e <= 124; past that (lb = -10) no centred chunk exists."""
    assert centred_chunk_size(bound) == chunk
    assert centred_chunk_size(None) is None
    for c in (16, 32, 64):
        if chunk is not None and c <= chunk:
            assert abs(bound) * (c / 2 + 1) / math.log(2) <= 124


# The centred products also fill the upper triangle, where e^{Γ_τ - Γ_j} with τ < j may overflow to inf
# (or inf - inf = nan) for bounds near the headroom limit; those entries are discarded by a select, so
# numpy's warnings from the interpreter's matmul are expected here (the results are checked below).
@pytest.mark.filterwarnings("ignore:overflow encountered in matmul:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")
@pytest.mark.parametrize("bound", [-3.0, -6.0, -10.0])
def test_chunk_size_invariance(bound):
    """Chunk-size invariance: C = 32, 16 (centred) and the exact fallback give the fp64 result, gates at the bound."""
    inputs = rwkv7_inputs(T=40, decay=bound)
    check_against_naive(chunk_rwkv7_triton, inputs, gate_lower_bound=bound)


def test_bf16_products_keep_the_gate_gradient():
    """bf16 inputs with the gate at the bound: the kernels' bf16 storage and operands (emulated, with
    round-to-nearest, under the interpreter) keep every gradient within the GPU tolerance of fp64. dw is
    the I2 sum, in which the q-k pair terms of q dq and k dk cancel; with bf16 operands on both sides of
    that pair dw is 1.8e-2 off here (2.1e-2 on an H100 at T = 4096)."""
    check_against_naive(chunk_centred, rwkv7_inputs(T=256, H=2, K=64, V=64, dtype=torch.bfloat16, decay=LB),
                        ratio=1e-2)


def test_trained_head_bf16_numerics():
    """The first 256 tokens of the trained RWKV7-340M head of test_rwkv7_bf16_trained_head.py (slow
    decays, |k| up to 8, outputs up to 1e4), bf16, centred regime: with the kernels' bf16 storage and
    operands (emulated under the interpreter) o and every gradient stay within 1e-2 of fp64. With bf16
    operands also in W, G, Q', E, C and in the backward's products, dw is 9e-2 and db 3e-2 off here."""
    data = torch.load(TRAINED_HEAD, map_location=DEVICE)
    inputs = {n: data[n][:, :256].contiguous().requires_grad_() for n in "rwkvab"}
    check_against_naive(chunk_centred, {**inputs, "initial_state": None}, ratio=1e-2)


def test_untrusted_bound_falls_back():
    """RWKV7 gate bound: a bound that the gates break (w = -5 with a claimed -0.6065, value checks off) must not
    overflow the centred factors: each chunk checks its own gates and falls back to the exact path."""
    inputs = rwkv7_inputs(T=70, decay=-5.0)
    with torch.no_grad():  # one chunk respects the claim, the other breaks it
        inputs["w"][:, :64].fill_(LB)
    check_against_naive(chunk_centred, inputs)


def test_bound_past_headroom_uses_exact_regime():
    """RWKV7 gate bound: lb = -10 fails the headroom rule at every chunk size, so the exact regime runs."""
    check_against_naive(chunk_rwkv7_triton, rwkv7_inputs(T=20, decay=-10.0), gate_lower_bound=-10.0)


# the inverse's products as the kernels run them: fp32 inputs 3xTF32; 16-bit inputs TF32 merges and a
# Newton step whose residual is a bf16x3 product (TF32 = 2 and bf16x3 emulated under the interpreter)
INVERSE_PRECISIONS = pytest.mark.parametrize("precision, tf32", [("tf32x3", 0), ("bf16x3", 2 if DEVICE ==
"cpu" else 1)],
                                             ids=["fp32_inputs", "16bit_inputs"])
ALIGNED_INVERSE_TOL = {"tf32x3": 5e-6, "bf16x3": 2e-5}  # the bf16x3 Newton residual: 1.1e-5


@INVERSE_PRECISIONS
@pytest.mark.parametrize("alpha", ["random", "near_one", "one"])
def test_wy_inverse_accuracy(alpha, precision, tf32):
    """WY inverse accuracy: ||Tm (I - M^ab) - I|| < 1e-4 in fp32 for C = 64, ||a|| = 1, alpha -> 1 and alpha = 1,
    with the products of fp32 inputs (3xTF32) and of 16-bit inputs (TF32 and a Newton step)."""
    C, K = 64, 32
    gen = torch.Generator().manual_seed(3)
    a, b = rwkv7_a_b(gen, (4, C, K), "delta")  # b = kappa_hat: alpha = 1
    if alpha == "random":
        b = b * torch.rand(4, C, K, generator=gen, dtype=torch.float64)
    elif alpha == "near_one":
        b = b * (1 - 1e-3 * torch.rand(4, C, K, generator=gen, dtype=torch.float64))
    w = LB * torch.rand(4, C, K, generator=gen, dtype=torch.float64)
    G = w.cumsum(1)
    Gb = G - w
    M = torch.einsum("ntk,njk->ntj", a * Gb.exp(), b * (-G).exp()).tril(-1)  # M^ab in fp64
    Tm = unit_lower_inverse_triton(M.float().to(DEVICE), precision=precision, tf32=tf32).double().cpu()
    eye = torch.eye(C, dtype=torch.float64)
    err = (Tm @ (eye - M) - eye).abs().max().item()
    assert err < 1e-4, f"inverse residual {err:.2e}"


@INVERSE_PRECISIONS
def test_wy_inverse_of_aligned_trained_chunks(precision, tf32):
    """The M^ab of the trained head's chunks (C = 32, kappa aligned over many tokens, |M^ab| up to 0.82):
    the powers of M^ab grow binomially there (|L^8| up to 6e2 on a 16-row block) while the inverse stays
    <= 1, so the nilpotent product (I+L)(I+L^2)(I+L^4)(I+L^8) that this kernel used before lost 1.5e-5
    relative in 3xTF32 and 25% with TF32 products. Block merges from 1x1 up keep every factor <= 1:
    the inverse stays within 5e-6 relative (Frobenius, per chunk) of fp64 with 3xTF32 products (fp32
    inputs), 2e-5 with the TF32 merges and bf16x3 Newton residual of 16-bit inputs."""
    data = torch.load(TRAINED_HEAD)
    w, a, b = (data[n][0, :1024, 0].double() for n in "wab")
    C = 32
    w, a, b = (x.reshape(-1, C, x.shape[-1]) for x in (w, a, b))
    G = w.cumsum(1)
    M = torch.einsum("ntk,njk,ntjk->ntj", a, b, (G - w)[:, :, None, :].sub(G[:, None, :, :]).exp()).tril(-1)
    M = M.float().double()  # the kernel's input is fp32: compare with the exact inverse of that
    exact = torch.linalg.inv(torch.eye(C, dtype=torch.float64) - M)
    Tm = unit_lower_inverse_triton(M.float().to(DEVICE), precision=precision, tf32=tf32).double().cpu()
    err = ((Tm - exact).norm(dim=(1, 2)) / exact.norm(dim=(1, 2))).max().item()
    assert err < ALIGNED_INVERSE_TOL[precision], f"inverse relative error {err:.2e}"


def test_reduces_to_gla_when_b_is_zero(op):
    """RWKV7 closed forms: b = 0 gives inclusive gated linear attention, checked against its closed form."""
    inputs = rwkv7_inputs(T=40, H=2, ab="zero_b", initial_state=False)
    o, _ = op(**inputs, scale=0.5, output_final_state=False)
    r, w, k, v = (inputs[n].detach().double().cpu() for n in ("r", "w", "k", "v"))
    G = w.cumsum(1)  # [B, T, H, K]
    decay = (G[:, :, None] - G[:, None, :]).clamp(max=0).exp()  # [B, t, j, H, K]
    att = torch.einsum("bthk,bjhk,btjhk->bhtj", r * 0.5, k, decay).tril()
    closed = torch.einsum("bhtj,bjhv->bthv", att, v)
    assert_close("o", closed, o.cpu(), 5e-3)  # the closed form is built on the CPU


def test_delta_rule_when_decay_is_one(op):
    """RWKV7 closed forms: w = 0, a = -kappa_hat, b = kappa_hat is the delta rule with beta = 1:
    S_t = (I - kappa kappa^T) S_{t-1} + k v^T, a projection of the old state."""
    inputs = rwkv7_inputs(T=30, decay="zero", ab="delta")
    o, ht = op(**inputs, scale=1.0, output_final_state=True)
    r, k, v, b = (inputs[n].detach().double().cpu()[0, :, 0] for n in ("r", "k", "v", "b"))
    S = inputs["initial_state"].detach().double().cpu()[0, 0]
    outs = []
    for t in range(r.shape[0]):
        kap = b[t]
        S = S - torch.outer(kap, kap @ S) + torch.outer(k[t], v[t])
        outs.append(S.T @ r[t])
    assert_close("o", torch.stack(outs), o[0, :, 0].cpu(), 5e-3)  # the recurrence runs on the CPU
    assert_close("final_state", S, ht[0, 0].cpu(), 5e-3)


@pytest.mark.parametrize("K,V", [(60, 100), (8, 12), (20, 16)])
def test_head_dims(op, K, V):
    """Odd head dims: non-power-of-two head dims and K < 16 (pad-to-16 masks)."""
    check_against_naive(op, rwkv7_inputs(T=20, K=K, V=V))


def test_large_key_dim_uses_recurrent_kernels():
    """K > 128 does not fit the chunk kernels' per-chunk tiles: chunk_rwkv7_triton computes it with the
    fused recurrent kernels, still exact."""
    check_against_naive(chunk_centred, rwkv7_inputs(T=6, K=160, V=16))


def test_deterministic_backward(op):
    """Determinism: no atomics; two runs give bitwise-equal outputs and gradients."""
    inputs = rwkv7_inputs(T=40, H=2)
    first = _run(op, inputs, 1.0)
    second = _run(op, inputs, 1.0)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    for name in first[2]:
        assert torch.equal(first[2][name], second[2][name]), f"d{name} differs between runs"


def test_cached_intermediates_match_recompute():
    """cache_intermediates keeps the forward's per-chunk products: bitwise the same gradients as
    recomputing them in the backward (the default)."""
    inputs = rwkv7_inputs(T=70)
    for bound in (None, LB):
        recompute = _run(chunk_rwkv7_triton, inputs, 1.0, gate_lower_bound=bound, cache_intermediates=False)
        cached = _run(chunk_rwkv7_triton, inputs, 1.0, gate_lower_bound=bound, cache_intermediates=True)
        for name in recompute[2]:
            assert torch.equal(recompute[2][name], cached[2][name]), f"d{name} differs with caching"


@pytest.mark.parametrize("cache", [False, True])
@pytest.mark.parametrize("varlen", [False, True])
def test_recomputed_states_match_kept_states(cache, varlen):
    """recompute_states: the backward's own forward scan (from the initial states) gives bitwise the
    gradients of the states that the forward kept, in both regimes, with and without cached
    intermediates, fixed-length (the custom ops) and packed (the autograd Function), partial chunks
    included; and those gradients match the fp64 oracle."""
    lengths = [1, 15, 33, 21]
    cu = make_cu_seqlens(lengths, device=DEVICE) if varlen else None
    inputs = rwkv7_inputs(T=70)
    if varlen:
        inputs = varlen_state(inputs, len(lengths))
    for bound in (None, LB):
        kw = dict(gate_lower_bound=bound, cache_intermediates=cache, cu_seqlens=cu)
        kept = _run(chunk_rwkv7_triton, inputs, 1.0, **kw)
        recomputed = _run(chunk_rwkv7_triton, inputs, 1.0, recompute_states=True, **kw)
        assert torch.equal(kept[0], recomputed[0]) and torch.equal(kept[1], recomputed[1])
        for name in kept[2]:
            assert torch.equal(kept[2][name], recomputed[2][name]), f"d{name} differs with recomputed states"
    check_against_naive(chunk_rwkv7_triton, inputs, cu_seqlens=cu, gate_lower_bound=LB, cache_intermediates=cache,
                        recompute_states=True)


def test_public_op_passes_recompute_states(monkeypatch):
    """chunk_rwkv7(backend="triton", recompute_states=True) reaches the kernels: the forward keeps no
    states and the backward launches the paired scans once; by default the backward scan runs alone.
    The PyTorch backend accepts and ignores the flag."""
    from flame.ops.rwkv7 import chunk_scan_triton

    launches = []

    class Counted:
        def __init__(self, kernel, name):
            self.kernel, self.name = kernel, name

        def __getitem__(self, grid):
            launches.append(self.name)
            return self.kernel[grid]

    for name in ("_scan_pair_kernel", "_scan_bwd_kernel"):
        monkeypatch.setattr(chunk_scan_triton, name, Counted(getattr(chunk_scan_triton, name), name))
    inputs = rwkv7_inputs(T=40, H=2)
    leaves = list(grad_leaves(inputs).values())
    grads = {}
    for recompute in (True, False):
        o, _ = chunk_rwkv7(**inputs, backend="triton", gate_lower_bound=LB, recompute_states=recompute)
        del launches[:]
        grads[recompute] = torch.autograd.grad(o, leaves, random_like(o, 3), allow_unused=True)
        assert launches == ["_scan_pair_kernel" if recompute else "_scan_bwd_kernel"]
    for g_recomputed, g_kept in zip(grads[True], grads[False]):
        assert (g_recomputed is None and g_kept is None) or torch.equal(g_recomputed, g_kept)
    torch_o, _ = chunk_rwkv7(**to_reference(inputs), backend="torch", recompute_states=True)
    assert_close("o", torch_o, o, RATIO[torch.float32])


def test_public_op_passes_cache_intermediates(monkeypatch):
    """chunk_rwkv7(backend="triton", cache_intermediates=True) reaches the kernels (the forward keeps its
    intermediates, so the backward runs no `prepare`; by default it recomputes them), and gives the
    default's gradients; the PyTorch backend accepts and ignores the flag."""
    from flame.ops.rwkv7 import chunk_triton

    prepares = []
    original = chunk_triton.prepare
    monkeypatch.setattr(chunk_triton, "prepare", lambda *a, **kw: prepares.append(1) or original(*a, **kw))
    inputs = rwkv7_inputs(T=40, H=2)
    kept, _ = chunk_rwkv7(**inputs, backend="triton", gate_lower_bound=LB, cache_intermediates=True)
    default, _ = chunk_rwkv7(**inputs, backend="triton", gate_lower_bound=LB)
    do = random_like(default, 3)
    leaves = list(grad_leaves(inputs).values())
    del prepares[:]
    kept_grads = torch.autograd.grad(kept, leaves, do, allow_unused=True)
    assert not prepares  # every intermediate came from the forward
    default_grads = torch.autograd.grad(default, leaves, do, allow_unused=True)
    assert len(prepares) == 1  # the recomputation from the WY inverse Tm alone
    for g_kept, g_default in zip(kept_grads, default_grads):
        assert (g_kept is None and g_default is None) or rel_rms_error(g_default, g_kept) < 1e-5
    ref_inputs = to_reference(inputs)
    torch_o, _ = chunk_rwkv7(**ref_inputs, backend="torch", cache_intermediates=True)
    assert_close("o", torch_o, kept, RATIO[torch.float32])


def test_rejects_float64():
    inputs = rwkv7_inputs(T=4, dtype=torch.float64)
    for fn in (chunk_rwkv7_triton, fused_recurrent_rwkv7_triton):
        with pytest.raises(TypeError, match="float64"):
            fn(**inputs)


# ------------------------------------------------------------------------------------ known failures

def test_nan_prone_inputs_rejected_and_bf16_outputs_finite():
    """docs/known-failures.md#all-nan-rwkv7-outputs (all-NaN RWKV7 outputs in bf16): the op rejects a
    positive log-decay and a
    head-first layout with a clear error, and layer-like bf16 inputs give finite outputs and gradients
    that match fp64, in both Triton ops."""
    inputs = rwkv7_inputs(T=40, H=2, dtype=torch.bfloat16)
    bad_w = {**inputs, "w": inputs["w"].detach().abs() + 0.1}  # log(w) of a positive w: positive log-decay
    for public in (chunk_rwkv7, fused_recurrent_rwkv7):
        with pytest.raises(ValueError, match="w"):
            public(**bad_w, backend="triton")
        head_first = {n: (x.detach().transpose(1, 2) if n != "initial_state" else x) for n, x in inputs.items()}
        with pytest.raises(ValueError, match="head"):
            public(**head_first, backend="triton")
    for fn in (chunk_centred, chunk_exact, fused_recurrent_rwkv7_triton):
        check_against_naive(fn, inputs)


def test_inputs_not_modified_and_chunk_agrees_with_recurrent():
    """docs/known-failures.md#chunked-and-recurrent-kernels-disagree (chunked and recurrent disagreeing
    because one path modified w in place):
    no kernel modifies its inputs in the forward or the backward, and chunk and recurrent agree with
    each other and with fp64, state gradients included."""
    inputs = rwkv7_inputs(T=70, H=2)
    before = {n: x.detach().clone() for n, x in inputs.items()}
    results = {}
    for name, fn in OPS.items():
        results[name] = check_against_naive(fn, inputs)
        for n, x in inputs.items():
            assert torch.equal(x.detach(), before[n]), f"{name} modified {n}"
    ref = results["fused_recurrent"]
    for name in ("chunk_exact", "chunk_centred"):
        assert_close("o", ref[0], results[name][0], 5e-3)
        assert_close("final_state", ref[1], results[name][1], 5e-3)
        for g in ref[2]:
            assert_close(f"d{g}", ref[2][g], results[name][2][g], 5e-3, atol=1e-5)


def test_value_checks_off_still_safe():
    """With value checks off the public op cannot reject a broken bound; the kernel's own per-chunk
    check still keeps the result exact."""
    inputs = rwkv7_inputs(T=40, decay=-5.0)
    checks.set_value_checks(False)
    try:
        check_against_naive(chunk_rwkv7, inputs, backend="triton", gate_lower_bound=LB)
    finally:
        checks.set_value_checks(True)


# ------------------------------------------------------------------------------------ GPU only

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_long_sequence_gate_at_bound(dtype):
    """16-bit inputs, RWKV7 gate bound on the GPU: T = 4096 with w at the bound over the whole sequence
    (centred C = 64)."""
    inputs = rwkv7_inputs(B=1, T=4096, H=2, K=64, V=64, dtype=dtype, decay=LB)
    check_against_naive(chunk_centred, inputs, ratio=1e-2)


@pytest.mark.gpu
def test_gpu_per_head_gates_stride():
    """The #1085 stride bug: H = 4 heads with different constant gates; every head must match fp64."""
    inputs = rwkv7_inputs(B=2, T=300, H=4, K=64, V=64, dtype=torch.bfloat16)
    with torch.no_grad():
        for h, g in enumerate((LB, -0.01, -0.3, 0.0)):
            inputs["w"][:, :, h].fill_(g)
    check_against_naive(chunk_centred, inputs, ratio=1e-2)
    check_against_naive(chunk_exact, inputs, ratio=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,H,K,V", [(2, 1000, 4, 64, 64), (1, 2048, 2, 128, 128), (2, 333, 3, 100, 60)])
def test_gpu_realistic_shapes_bf16(B, T, H, K, V):
    inputs = rwkv7_inputs(B=B, T=T, H=H, K=K, V=V, dtype=torch.bfloat16)
    for fn in (chunk_centred, chunk_exact, fused_recurrent_rwkv7_triton):
        check_against_naive(fn, inputs, ratio=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("cache", [False, True])
def test_gpu_recomputed_states_bf16(cache):
    """recompute_states at the rwkv7_340M layer's shape (B8 T2048 H16 K64, bf16, centred regime): the
    backward's paired scans give the gradients of kept states (the same arithmetic, compiled into
    another kernel), and match the fp64 oracle on a smaller batch."""
    inputs = rwkv7_inputs(B=8, T=2048, H=16, K=64, V=64, dtype=torch.bfloat16)
    kept = _run(chunk_centred, inputs, 1.0, cache_intermediates=cache)
    recomputed = _run(chunk_centred, inputs, 1.0, cache_intermediates=cache, recompute_states=True)
    assert torch.equal(kept[0], recomputed[0])
    for name in kept[2]:
        assert_close(f"d{name}", kept[2][name], recomputed[2][name], 1e-5, atol=1e-6)
    small = rwkv7_inputs(B=1, T=2048, H=2, K=64, V=64, dtype=torch.bfloat16)
    check_against_naive(chunk_centred, small, ratio=1e-2, cache_intermediates=cache, recompute_states=True)


@pytest.mark.gpu
def test_gpu_chunk_against_fused_recurrent():
    """Chunk (both regimes) against the fused recurrent kernel, fp32, with varlen and states."""
    lengths = [1, 100, 1000, 64, 2000]
    cu = make_cu_seqlens(lengths, device=DEVICE)
    inputs = varlen_state(rwkv7_inputs(T=sum(lengths), H=3, K=64, V=64), len(lengths))
    ref = _run(fused_recurrent_rwkv7_triton, inputs, 1.0, cu)
    for fn in (chunk_centred, chunk_exact):
        out = _run(fn, inputs, 1.0, cu)
        assert_close("o", ref[0], out[0], 5e-3)
        assert_close("final_state", ref[1], out[1], 5e-3)
        for g in ref[2]:
            assert_close(f"d{g}", ref[2][g], out[2][g], 5e-3, atol=1e-5)


@pytest.mark.gpu
def test_gpu_varlen_against_naive():
    lengths = [1, 15, 64, 65, 1000]
    cu = make_cu_seqlens(lengths, device=DEVICE)
    inputs = varlen_state(rwkv7_inputs(T=sum(lengths), H=2, K=64, V=64, dtype=torch.bfloat16), len(lengths))
    for fn in OPS.values():
        check_against_naive(fn, inputs, cu_seqlens=cu, ratio=1e-2)
