"""Triton chunked RWKV7 (DPLR delta rule, UT/WY form), forward and backward
(docs/kernels.md#rwkv7-chunked-form to #rwkv7-chunked-backward).

Per chunk of BT tokens, with Γ the fp32 chunk-local inclusive cumsum of w (scaled by log2 e, so
every factor is an exp2 of a non-positive number) and Γ̄ the exclusive one:

    M^qk = tril_incl(sc q e^{Γ_τ-Γ_j} k^T)   M^qb = tril_incl(sc q e^{Γ_τ-Γ_j} b^T)
    M^ak = strict(a e^{Γ̄_τ-Γ_j} k^T)          M^ab = strict(a e^{Γ̄_τ-Γ_j} b^T)
    Tm = (I - M^ab)^-1,  W = Tm Â,  G = Tm M^ak,  P = G V + W S^in
    O = Q̂ S^in + M^qk V + M^qb P,  S^out = e^{Γ_L} S^in + K̃^T V + B̃^T P

A chunk is therefore one linear map of (S^in, V) with four per-chunk matrices that do not depend on
the state, which `prepare` computes in parallel over all chunks, in one kernel (`_prepare_kernel`:
M^ak, M^ab, M^qk, M^qb, Tm, W, G, then the four maps; W and G stay in registers unless the backward
needs them, which is faster than two kernels passing them through global memory; launched once per
intra regime, see below):

    O     = Q' S^in + E V          Q' = Q̂ + M^qb W            [BT, K]
    S^out = A S^in + C^T V         E  = M^qk + M^qb G          [BT, BT]
                                   A  = diag(e^{Γ_L}) + B̃^T W  [K, K]
                                   C  = K̃ + G^T B̃              [BT, K]

The sequential scans then do two products per chunk and the output comes out of the forward scan:
    forward  (`_scan_fwd`): O = Q' S + E V;  S <- A S + C^T V
    backward (`_scan_bwd`): dV = E^T dO + C dS;  dS <- A^T dS + Q'^T dO     (dS = dS^out of the chunk)
The per-chunk backward (`chunk_bwd`, one program per chunk and head in each of two kernels) takes the
chunk's S^in, dS^out, dO and V, forms dQ' = dO S^T, dE = dO V^T, dA = dS S^T, dC = V dS^T (reductions
over V) and carries them back through the four definitions to M^qk, M^qb, W, G, B̃ (`_bwd_maps`); then
through the WY representation (dM^ab = strict(Tm^T dTm Tm^T), docs/kernels.md#rwkv7-chunked-backward)
to da and through the intra products to dk, db and dw by the reverse cumsum of identity I2
(`_bwd_intra`). The two pass fp32 [BT, K] / [BT, BT] tiles through global memory, so that neither
holds the whole chain (a program that held it spilled kilobytes of registers per thread); four kernels
(output side, state side, WY, column side) would move more tiles through memory and were slower. No
atomics anywhere: the backward is deterministic. By default the backward runs `prepare` again, from
the WY inverse Tm that the forward keeps; with cache_intermediates the forward keeps all its
intermediates instead (faster, more memory). Head dims K > 128 do not fit one program's tiles and run
on the fused recurrent kernels instead.

Intra regimes (docs/kernels.md#rwkv7-intra-chunk-regimes):
- exact per-pair exponents (any gate): a loop over the key column with exponents Γ_τ - Γ_j <= 0;
  the default, with BT = 16;
- centred tensor-core factorisation around the middle row m: taken only when the caller gives a
  gate_lower_bound that passes the fp32 headroom rule |lb| (BT/2 + 1) log2 e <= 124 (BT <= 32 in
  any case: [64, K] tiles cost twice the registers of [32, K] ones), and then
  only for chunks whose gates really are >= lb, checked per chunk by `_prepare_kernel` on the chunk's
  own gates, with no host sync, and recorded (int8 per chunk and head) for the backward, so both
  passes take the same regime; the chunks that break the promise take the exact per-pair path at the
  same chunk size. Every per-chunk kernel that depends on the regime launches twice, once per regime,
  each launch skipping the chunks of the other (`regime_selected`: one byte per program, cheaper than
  reading the chunk's gates): a program holding both paths spills more and runs slower. `prepare`'s first
  launch decides and records the regime. The scans do not depend on the regime.

Precision: fp32 decay cumsums, states, state gradients and intermediates everywhere. Products with
fp32 operands are 3xTF32 (fp32-accurate) for fp32 inputs and in the scans' state recurrence A S; for
16-bit inputs the per-chunk kernels run them in bf16x3 (`mm_prec`, ~2^-16 per product: half the work
and operand registers of 3xTF32, and no change in the trained head's errors, see ChunkPlan.prec). And for
bf16 inputs:
- the q-side intra products M^qk, M^qb take bf16 operands, and the scans' per-token matrices Q', E, C
  are stored in bf16 and multiplied with bf16 operands (fp32 accumulation, `dot_lowp` with LOWP)
  everywhere but in the recurrence A S itself;
- one TF32 pass (`mm_tf32_if` with TF32) in the WY inverse, followed by a Newton step
  (wy_inverse_triton.py), in the state side's products and the reductions over V of `_bwd_maps`
  and in the column side's products of `_bwd_intra` (see ChunkPlan.tf32).
Plain TF32 in the state recurrence, or in an inverse by nilpotent products, overflows a trained
head (tests/ops/test_rwkv7_bf16_trained_head.py); bf16 in W, G or the backward's products costs up
to 4x the error there (interpreter replica of tests/ops/test_rwkv7_bf16_trained_head.py). fp16
inputs keep fp32 operands (the fp16 caveat of docs/kernels.md#rwkv7-intra-chunk-regimes; bf16x3 has
fp32's exponent range). Under the interpreter, whose bf16 tl.dot is wrong and whose bf16 cast
truncates, LOWP = 2 reproduces the same round-to-nearest operand rounding around fp32 products,
TF32 = 2 truncates the operands of the one-pass TF32 products as the tensor cores read them, and
`mm_prec` emulates bf16x3 with the same operand splits.

Files, by stage: chunk_plan.py (the host's choices for one call: `ChunkPlan`), chunk_helpers_triton.py
(the device helpers: intra matrices in both regimes, tiles, the regime record),
chunk_prepare_triton.py (`prepare`), chunk_scan_triton.py (the scans), chunk_bwd_triton.py (the
per-chunk backward), and this module: the forward and backward of one call, the autograd path and the
custom ops.
"""

import torch
import triton

from ..utils.backend import run_eager
from .chunk_bwd_triton import chunk_bwd
from .chunk_plan import MAX_CHUNK_K, ChunkPlan, check_kernel_dtype, chunk_size, intermediate_specs, scan_dtype_of
from .chunk_prepare_triton import prepare
from .chunk_scan_triton import scan_bwd, scan_fwd

def _forward(r, w, k, v, a, b, scale, h0, output_final_state, cu_seqlens, gate_lower_bound, need_grad, cache,
             keep_states=True):
    """o, the final state (or None), and what the backward needs: the plan, the per-chunk states hs (None
    without need_grad or `keep_states`) and the intermediates (all of them with `cache`, else the WY
    inverse Tm alone; None without need_grad)."""
    r, w, k, v, a, b = (x.contiguous() for x in (r, w, k, v, a, b))
    plan = ChunkPlan(r, v, cu_seqlens, gate_lower_bound)
    H, K, V = plan.H, plan.K, plan.V
    cache = need_grad and cache
    # the backward needs Tm: the forward keeps it also when it recomputes the rest (C fp32 per token and
    # head; its inverse is the longest chain of the recomputation)
    pre = prepare(plan, r, w, k, a, b, scale, store_bwd=cache, keep_tm=need_grad)
    hs = r.new_empty(plan.NT, H, K, V, dtype=torch.float32) if need_grad and keep_states else None
    ht = r.new_empty(plan.N, H, K, V, dtype=torch.float32) if output_final_state else None
    h0 = h0.contiguous() if h0 is not None else None
    o = torch.empty_like(v)
    scan_fwd(plan, pre, v, h0, hs, ht, o)
    saved = (pre if cache else {"Tm": pre["Tm"]}) if need_grad else None
    return o, ht, plan, hs, saved


def _backward(plan, saved, r, w, k, v, a, b, hs, scale, h0, has_h0, do, dht):
    """dr, dw, dk, dv, da, db and dh0 (None without an initial state) of one call. `hs` None: the forward
    did not keep its states, and the backward scan's launch runs the forward scan again for them
    (`_scan_pair_kernel`, from the initial state h0)."""
    H, K, V = plan.H, plan.K, plan.V
    pre = saved if "Qs" in saved else prepare(plan, r, w, k, a, b, scale, store_bwd=True, keep_tm=True,
                                                 tm=saved["Tm"])
    do = do.contiguous()
    dht = dht.contiguous() if dht is not None else None
    dhs = r.new_empty(plan.NT, H, K, V, dtype=torch.float32)
    dh0 = r.new_empty(plan.N, H, K, V, dtype=torch.float32) if has_h0 else None
    dv = torch.empty_like(v)
    h0 = h0.contiguous() if has_h0 and hs is None else None
    hs = scan_bwd(plan, pre, v, do, h0, hs, dht, dhs, dh0, dv)
    dr, dw, dk, da, db = chunk_bwd(plan, pre, r, w, k, v, a, b, do, hs, dhs, scale)
    return dr, dw, dk, dv, da, db, dh0


class ChunkRWKV7Function(torch.autograd.Function):
    """The autograd path for calls the custom ops below do not take (varlen)."""

    @staticmethod
    def forward(ctx, r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens, gate_lower_bound,
                cache_intermediates, recompute_states):
        need_grad = any(ctx.needs_input_grad[i] for i in (0, 1, 2, 3, 4, 5, 7))
        o, ht, plan, hs, saved = _forward(r, w, k, v, a, b, scale, initial_state, output_final_state,
                                          cu_seqlens, gate_lower_bound, need_grad, cache_intermediates,
                                          keep_states=not recompute_states)
        if need_grad:
            ctx.save_for_backward(*(x.contiguous() for x in (r, w, k, v, a, b)), hs,
                                  initial_state if recompute_states else None)
            ctx.plan, ctx.scale, ctx.saved = plan, scale, saved
            ctx.has_h0 = initial_state is not None
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        r, w, k, v, a, b, hs, h0 = ctx.saved_tensors
        saved, ctx.saved = ctx.saved, None
        dr, dw, dk, dv, da, db, dh0 = _backward(ctx.plan, saved, r, w, k, v, a, b, hs, ctx.scale, h0, ctx.has_h0,
                                                do, dht)
        return dr, dw, dk, dv, da, db, None, dh0, None, None, None, None, None


# ------------------------------------------------------------------------------------------------
# custom ops: what torch.compile sees
# ------------------------------------------------------------------------------------------------
# A compiled block traces `torch.ops.flame.chunk_rwkv7_fwd` / `_bwd` as two opaque nodes, so Inductor
# fuses the glue on both sides of the attention and the block stays one graph. The forward returns
# every tensor its backward reads: the per-chunk states hs (empty with `recompute_states`) and the
# intermediates of `prepare`, all of them with `cache`, else the WY inverse Tm alone (the others come
# back empty). Their shapes follow from the input shapes alone for fixed-length calls; varlen calls
# (chunk counts that depend on the offsets' values) keep the autograd.Function above.

_EMPTY = (0,)
# the intermediates of `prepare` that a cached forward hands to the backward, in the ops' order
_INTERMEDIATES = ("Qs", "Es", "Cs", "As", "regime", "Wm", "Gm", "Mak", "Mqb", "Tm")


def _fixed_length_shapes(r, gate_lower_bound):
    """(chunk size, number of chunks, centred) of a fixed-length call, as ChunkPlan chooses them."""
    B, T = r.shape[:2]
    bt, centred = chunk_size(gate_lower_bound)
    return bt, B * triton.cdiv(T, bt), centred


def _intermediate_shapes(r, gate_lower_bound, cache):
    """{name: (shape, dtype)} of the intermediates that the forward op returns (empty ones included)."""
    B, T, H, K = r.shape
    bt, nt, centred = _fixed_length_shapes(r, gate_lower_bound)
    specs = intermediate_specs(B, T, H, K, bt, nt, centred, scan_dtype_of(r.dtype))
    return {name: (shape if shape is not None and (cache or name == "Tm") else _EMPTY, dtype)
            for name, (shape, dtype) in specs.items()}


@torch.library.custom_op("flame::chunk_rwkv7_fwd", mutates_args=())
def _chunk_rwkv7_fwd_op(r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                        b: torch.Tensor, h0: torch.Tensor | None, scale: float, gate_lower_bound: float | None,
                        output_final_state: bool, need_grad: bool, cache: bool,
                        recompute_states: bool) -> list[torch.Tensor]:
    o, ht, _, hs, saved = _forward(r, w, k, v, a, b, scale, h0, output_final_state, None, gate_lower_bound,
                                   need_grad, cache, keep_states=not recompute_states)
    saved = saved or {}
    empty = lambda dtype=torch.float32: r.new_empty(_EMPTY, dtype=dtype)  # noqa: E731
    shapes = _intermediate_shapes(r, gate_lower_bound, cache and need_grad)
    return [o, ht if ht is not None else empty(), hs if hs is not None else empty(),
            *(saved[name] if saved.get(name) is not None else empty(shapes[name][1]) for name in _INTERMEDIATES)]


@_chunk_rwkv7_fwd_op.register_fake
def _(r, w, k, v, a, b, h0, scale, gate_lower_bound, output_final_state, need_grad, cache, recompute_states):
    B, T, H, K = r.shape
    V = v.shape[-1]
    _, nt, _ = _fixed_length_shapes(r, gate_lower_bound)
    shapes = _intermediate_shapes(r, gate_lower_bound, cache)
    f32 = dict(dtype=torch.float32)
    return [torch.empty_like(v, memory_format=torch.contiguous_format),
            r.new_empty((B, H, K, V) if output_final_state else _EMPTY, **f32),
            r.new_empty((nt, H, K, V) if need_grad and not recompute_states else _EMPTY, **f32),
            *(r.new_empty(shape if need_grad else _EMPTY, dtype=dtype) for shape, dtype in
              (shapes[name] for name in _INTERMEDIATES))]


@torch.library.custom_op("flame::chunk_rwkv7_bwd", mutates_args=())
def _chunk_rwkv7_bwd_op(r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                        b: torch.Tensor, hs: torch.Tensor, h0: torch.Tensor | None, intermediates: list[torch.Tensor],
                        do: torch.Tensor, dht: torch.Tensor | None, scale: float, gate_lower_bound: float | None,
                        has_h0: bool, cache: bool, recompute_states: bool) -> list[torch.Tensor]:
    r, w, k, v, a, b = (x.contiguous() for x in (r, w, k, v, a, b))
    plan = ChunkPlan(r, v, None, gate_lower_bound)
    named = dict(zip(_INTERMEDIATES, intermediates))
    if cache:
        saved = {name: (x if x.numel() else None) for name, x in named.items()}
    else:
        saved = {"Tm": named["Tm"]}
    grads = _backward(plan, saved, r, w, k, v, a, b, None if recompute_states else hs, scale, h0, has_h0, do, dht)
    dh0 = grads[-1] if grads[-1] is not None else r.new_empty(_EMPTY, dtype=torch.float32)
    return [*grads[:-1], dh0]


@_chunk_rwkv7_bwd_op.register_fake
def _(r, w, k, v, a, b, hs, h0, intermediates, do, dht, scale, gate_lower_bound, has_h0, cache, recompute_states):
    B, _, H, K = r.shape
    V = v.shape[-1]
    grads = [torch.empty_like(x, memory_format=torch.contiguous_format) for x in (r, w, k, v, a, b)]
    return [*grads, r.new_empty((B, H, K, V) if has_h0 else _EMPTY, dtype=torch.float32)]


def _setup_context(ctx, inputs, output):
    r, w, k, v, a, b, h0, scale, gate_lower_bound, output_final_state, need_grad, cache, recompute_states = inputs
    # the backward's forward scan starts from h0 when the forward did not keep the states
    ctx.save_for_backward(r, w, k, v, a, b, h0 if recompute_states else None, *output[2:])
    ctx.scale, ctx.gate_lower_bound, ctx.cache = scale, gate_lower_bound, cache
    ctx.recompute_states = recompute_states
    ctx.has_h0, ctx.output_final_state = h0 is not None, output_final_state


def _backward_op(ctx, grads):
    do, dht = grads[0], grads[1]
    r, w, k, v, a, b, h0, hs, *intermediates = ctx.saved_tensors
    dr, dw, dk, dv, da, db, dh0 = torch.ops.flame.chunk_rwkv7_bwd(
        r, w, k, v, a, b, hs, h0, intermediates, do, dht if ctx.output_final_state else None, ctx.scale,
        ctx.gate_lower_bound, ctx.has_h0, ctx.cache, ctx.recompute_states)
    return dr, dw, dk, dv, da, db, (dh0 if ctx.has_h0 else None), None, None, None, None, None, None


_chunk_rwkv7_fwd_op.register_autograd(_backward_op, setup_context=_setup_context)


def chunk_rwkv7_triton(r, w, k, v, a, b, scale=1.0, initial_state=None, output_final_state=False, cu_seqlens=None,
                       gate_lower_bound=None, cache_intermediates=False, recompute_states=False):
    """Chunked RWKV7 with Triton, forward and backward. Inputs are already validated.

    gate_lower_bound: a claim that w >= bound everywhere. It selects the centred tensor-core regime
    only if it passes the fp32 headroom rule, and each chunk re-checks it on its own gates before
    using it. cache_intermediates (default off): keep the forward's per-chunk intermediates for the
    backward instead of running `prepare` again: per token and head 2 K + C bf16 (Q', C, E) and
    K + 4 C fp32 (W, G, Tm, M^ak, M^qb), plus K*K fp32 (A) per chunk and head, held from the forward to
    the backward. Off: the backward recomputes them (`_prepare_kernel` once more) from the WY inverse Tm
    alone, which the forward keeps (C fp32 per token and head; the inverse is the longest chain of the
    recomputation). The cached backward is faster (bench/RESULTS.md, kernels: chunk_rwkv7_cached).
    recompute_states (default off): the forward does not keep the per-chunk states S^in (K*V fp32 per
    chunk and head); the backward runs the forward scan again for them, in the launch of its own scan
    (`_scan_pair_kernel`, so the two scans overlap instead of adding up).
    Returns (o [B,T,H,V] in the input dtype, final state [N,H,K,V] fp32 or None).
    """
    check_kernel_dtype("chunk_rwkv7", r)
    if r.shape[-1] > MAX_CHUNK_K:
        # the per-chunk tiles of the whole key dimension no longer fit one program (registers, shared
        # memory); the fused recurrent kernels compute the same function exactly, step by step
        from .fused_recurrent_triton import fused_recurrent_rwkv7_triton
        return run_eager(fused_recurrent_rwkv7_triton, r, w, k, v, a, b, scale, initial_state, output_final_state,
                         cu_seqlens)
    if cu_seqlens is None:
        need_grad = torch.is_grad_enabled() and any(
            x is not None and x.requires_grad for x in (r, w, k, v, a, b, initial_state))
        o, ht, *_ = torch.ops.flame.chunk_rwkv7_fwd(
            r, w, k, v, a, b, initial_state, float(scale),
            None if gate_lower_bound is None else float(gate_lower_bound), bool(output_final_state), need_grad,
            bool(cache_intermediates), bool(recompute_states))
        return o, (ht if output_final_state else None)
    return run_eager(ChunkRWKV7Function.apply, r, w, k, v, a, b, scale, initial_state, output_final_state,
                     cu_seqlens, gate_lower_bound, cache_intermediates, bool(recompute_states))
