"""The passes over chunks: the per-chunk states of the forward and the per-chunk state gradients.

The forward state recurrence over chunks (docs/kernels.md#chunk-decomposition-i1) is
    S_in(c+1) = exp(Γ_L(c)) * S_in(c) + Δ(c),    Δ(c) = Σ_j (k_j * exp(Γ_L - Γ_j)) v_j^T
and the reverse state-gradient recurrence (docs/kernels.md#rwkv6-chunked-backward, step 2) is
    dS_out(c-1) = exp(Γ_L(c)) * dS_out(c) + Δ'(c),    Δ'(c) = scale Σ_τ (q_τ * exp(Γq_τ)) do_τ^T.
Two ways to run them, with the same products and the same fp32 states:
- the walk (`_walk_kernel`): one program per (sequence, head, K-block x V-block) walks the chunks of
  its sequence with the state in registers: per chunk it stores the carried state, forms the chunk's
  local term (one tensor-core product) and carries the state across. One pass over the inputs and
  one write of the states, and the next chunk's loads overlap the current product. Its parallelism is
  N x H x tiles programs, each a chain of as many steps as the sequence has chunks;
- the split pass: (1) the local terms Δ, Δ' of every chunk, one program per (chunk, head, tile), fully
  parallel, written into the per-chunk state buffer (`_local_states_kernel`); (2) a scan that walks
  the chunks of each sequence and, in place, replaces each local term by the state entering the chunk
  (forward) or the gradient of the state leaving it (reverse). The scan is elementwise in K x V (the
  decay is diagonal), so its programs tile the flattened K*V axis: the parallelism does not depend on
  the batch size. It moves the state buffer through memory three times instead of once.
`walks` picks the walk where it has enough programs to fill the GPU (a batch of sequences) and the split
pass where it does not (a few long packed sequences with few heads).
States and state gradients are fp32 throughout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .intra import load_query_gate, load_row, load_rows, mm
from .layout import ChunkLayout, chunk_span

LOCAL_WARPS = 4   # launch settings (module constants so that a benchmark can sweep them)
SCAN_BLOCK = 512  # state elements per scan program
# The walk: 4 warps, 3 pipeline stages (the next chunks' loads in flight), tiles of up to 64 x 64; taken
# from 128 programs up, where it beat the split pass on the shapes tried (with fewer, longer chains the
# split pass wins; see bench/RESULTS.md, whole training step, for the state passes' share of a step)
WALK_WARPS = 4
WALK_STAGES = 3
WALK_BLOCK = 64
WALK_MIN_PROGRAMS = 128


@triton.jit
def _local_states_kernel(k, v, q, do, gc, h, dh, cu_seqlens, chunk_indices, scale,
                         H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                         BK: tl.constexpr, BV: tl.constexpr, EXCLUSIVE: tl.constexpr,
                         FWD: tl.constexpr, BWD: tl.constexpr, DT: tl.constexpr):
    i_c = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    i_kv = tl.program_id(2)
    i_k = i_kv // tl.cdiv(V, BV)
    i_v = i_kv % tl.cdiv(V, BV)
    t0, Tc = chunk_span(cu_seqlens, chunk_indices, i_c, BT)
    rows = tl.arange(0, BT)
    m_t = rows < Tc
    ck = i_k * BK + tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    m_k = ck < K
    m_v = cv < V
    s_off = (i_c * H + i_h) * K * V + ck[:, None] * V + cv[None, :]
    m_kv = m_k[:, None] & m_v[None, :]
    if FWD:
        kk = load_rows(k, t0, rows, m_t, i_h, ck, m_k, H, K)
        gk = load_rows(gc, t0, rows, m_t, i_h, ck, m_k, H, K)
        gl = load_row(gc, t0, Tc - 1, i_h, ck, m_k, H, K)
        kg = kk * tl.exp2(tl.where(m_t[:, None], gl[None, :] - gk, float("-inf")))
        vv = load_rows(v, t0, rows, m_t, i_h, cv, m_v, H, V)
        tl.store(h + s_off, mm(tl.trans(kg), vv, DT), mask=m_kv)
    if BWD:
        qq = load_rows(q, t0, rows, m_t, i_h, ck, m_k, H, K)
        gq = load_query_gate(gc, t0, rows, m_t, i_h, ck, m_k, H, K, EXCLUSIVE)
        qg = qq * tl.exp2(tl.where(m_t[:, None], gq, float("-inf"))) * scale
        dd = load_rows(do, t0, rows, m_t, i_h, cv, m_v, H, V)
        tl.store(dh + s_off, mm(tl.trans(qg), dd, DT), mask=m_kv)


@triton.jit
def _scan_load(x, gc, bos, eos, c0, i_t, valid, i_h, e, kidx, m_e,
               H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr):
    """Chunk i_t of the sequence [bos, eos): pointers to its state elements `e`, their local term,
    and log2 of the chunk's decay at each element's key row (0 where not `valid`)."""
    m = m_e & valid
    ptr = x + ((c0 + i_t) * H + i_h) * K * V + e
    t_last = tl.minimum(bos + (i_t + 1) * BT, eos) - 1
    d = tl.load(ptr, mask=m, other=0.0)
    gl = tl.load(gc + (t_last * H + i_h) * K + kidx, mask=m, other=0.0)
    return ptr, d, gl, m


@triton.jit
def _scan_step(ptr, S, d, gl, m):
    """Store the carried state for this chunk, then carry it across: S <- exp2(gl) S + local."""
    tl.store(ptr, S, mask=m)
    return tl.exp2(gl) * S + d


@triton.jit
def _scan_kernel(x, gc, init, final, cu_seqlens, chunk_offsets,
                 H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
                 REVERSE: tl.constexpr, HAS_INIT: tl.constexpr, STORE_FINAL: tl.constexpr):
    i_nh = tl.program_id(0).to(tl.int64)
    i_s = tl.program_id(1)
    i_n = i_nh // H
    i_h = i_nh % H
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    e = i_s * BS + tl.arange(0, BS)
    m_e = e < K * V
    kidx = e // V
    s_off = (i_n * H + i_h) * K * V + e
    S = tl.zeros([BS], dtype=tl.float32)
    if HAS_INIT:
        S += tl.load(init + s_off, mask=m_e, other=0.0).to(tl.float32)
    NT = tl.cdiv(eos - bos, BT)
    for i in range(0, NT, 4):
        # four chunks' loads are issued before the four dependent steps
        if REVERSE:
            i0, i1, i2, i3 = NT - 1 - i, NT - 2 - i, NT - 3 - i, NT - 4 - i
        else:
            i0, i1, i2, i3 = i, i + 1, i + 2, i + 3
        p0, d0, g0, m0 = _scan_load(x, gc, bos, eos, c0, i0, i < NT, i_h, e, kidx, m_e, H, K, V, BT)
        p1, d1, g1, m1 = _scan_load(x, gc, bos, eos, c0, i1, i + 1 < NT, i_h, e, kidx, m_e, H, K, V, BT)
        p2, d2, g2, m2 = _scan_load(x, gc, bos, eos, c0, i2, i + 2 < NT, i_h, e, kidx, m_e, H, K, V, BT)
        p3, d3, g3, m3 = _scan_load(x, gc, bos, eos, c0, i3, i + 3 < NT, i_h, e, kidx, m_e, H, K, V, BT)
        S = _scan_step(p0, S, d0, g0, m0)
        S = _scan_step(p1, S, d1, g1, m1)   # an invalid chunk has gl = 0, d = 0: S is unchanged
        S = _scan_step(p2, S, d2, g2, m2)
        S = _scan_step(p3, S, d3, g3, m3)
    if STORE_FINAL:
        tl.store(final + s_off, S, mask=m_e)


@triton.jit
def _walk(x, y, gc, init, final, out, cu_seqlens, chunk_offsets, scale, i_nh, i_kv,
          H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
          REVERSE: tl.constexpr, EXCLUSIVE: tl.constexpr, HAS_INIT: tl.constexpr, STORE_FINAL: tl.constexpr,
          DT: tl.constexpr):
    """One (sequence, head, tile) chain: forward (x = k, y = v) from `init` h0, storing S_in of every
    chunk; or REVERSE (x = q, y = do) from `init` dht, storing dS_out of every chunk. The carried value at
    the end (ht or dh0) goes to `final`."""
    i_n = i_nh // H
    i_h = i_nh % H
    i_k = i_kv // tl.cdiv(V, BV)
    i_v = i_kv % tl.cdiv(V, BV)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    rows = tl.arange(0, BT)
    ck = i_k * BK + tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    m_k = ck < K
    m_v = cv < V
    m_kv = m_k[:, None] & m_v[None, :]
    s_off = ck[:, None] * V + cv[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_INIT:
        S += tl.load(init + (i_n * H + i_h) * K * V + s_off, mask=m_kv, other=0.0).to(tl.float32)
    NT = tl.cdiv(eos - bos, BT)
    for i in range(0, NT):
        if REVERSE:
            i_t = NT - 1 - i
        else:
            i_t = i
        t0 = bos + i_t * BT
        Tc = tl.minimum(eos - t0, BT)
        m_t = rows < Tc
        tl.store(out + ((c0 + i_t) * H + i_h) * K * V + s_off, S, mask=m_kv)
        gl = load_row(gc, t0, Tc - 1, i_h, ck, m_k, H, K)
        xx = load_rows(x, t0, rows, m_t, i_h, ck, m_k, H, K)
        if REVERSE:
            gx = load_query_gate(gc, t0, rows, m_t, i_h, ck, m_k, H, K, EXCLUSIVE)
            xg = xx * tl.exp2(tl.where(m_t[:, None], gx, float("-inf"))) * scale
        else:
            gx = load_rows(gc, t0, rows, m_t, i_h, ck, m_k, H, K)
            xg = xx * tl.exp2(tl.where(m_t[:, None], gl[None, :] - gx, float("-inf")))
        yy = load_rows(y, t0, rows, m_t, i_h, cv, m_v, H, V)
        S = tl.exp2(gl)[:, None] * S + mm(tl.trans(xg), yy, DT)
    if STORE_FINAL:
        tl.store(final + (i_n * H + i_h) * K * V + s_off, S, mask=m_kv)


@triton.jit
def _walk_kernel(k, v, q, do, gc, h0, ht, dht, dh0, h, dh, cu_seqlens, chunk_offsets, scale, NH,
                 H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 EXCLUSIVE: tl.constexpr, FWD: tl.constexpr, BWD: tl.constexpr,
                 HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
                 DT: tl.constexpr):
    """The walks over chunks: the forward states (FWD), the reverse state gradients (BWD), or both in one
    launch (the first NH = N*H rows of the grid walk forward, the next NH backward). The roles are
    branches on the constexprs (a role flag held in a variable compiles both walks, and a walk on None
    inputs does not compile)."""
    i_nh = tl.program_id(0).to(tl.int64)
    i_kv = tl.program_id(1)
    if FWD and BWD:
        if i_nh < NH:
            _walk(k, v, gc, h0, ht, h, cu_seqlens, chunk_offsets, 1.0, i_nh, i_kv, H, K, V, BT, BK, BV,
                  False, EXCLUSIVE, HAS_H0, STORE_HT, DT)
        else:
            _walk(q, do, gc, dht, dh0, dh, cu_seqlens, chunk_offsets, scale, i_nh - NH, i_kv, H, K, V, BT, BK, BV,
                  True, EXCLUSIVE, HAS_DHT, STORE_DH0, DT)
    elif FWD:
        _walk(k, v, gc, h0, ht, h, cu_seqlens, chunk_offsets, 1.0, i_nh, i_kv, H, K, V, BT, BK, BV,
              False, EXCLUSIVE, HAS_H0, STORE_HT, DT)
    else:
        _walk(q, do, gc, dht, dh0, dh, cu_seqlens, chunk_offsets, scale, i_nh, i_kv, H, K, V, BT, BK, BV,
              True, EXCLUSIVE, HAS_DHT, STORE_DH0, DT)


def _tiles(K: int, V: int, edge: int = 64) -> tuple[int, int, int]:
    """(BK, BV, number of K x V tiles): powers of two from 16 up to `edge`."""
    BK = min(edge, max(16, triton.next_power_of_2(K)))
    BV = min(edge, max(16, triton.next_power_of_2(V)))
    return BK, BV, triton.cdiv(K, BK) * triton.cdiv(V, BV)


def chunk_local_states(q, k, v, do, gc, layout: ChunkLayout, scale: float, exclusive: bool, dot_dtype,
                       fwd: bool, bwd: bool):
    """The local terms of every chunk, fp32 [num_chunks, H, K, V]: Δ (from k, v; if `fwd`) and Δ'
    (from q, do; if `bwd`), in one launch. Unneeded inputs may be None. Returns (Δ or None, Δ' or None)."""
    ref = k if fwd else q
    B, T, H, K = ref.shape
    V = (v if fwd else do).shape[-1]
    h = torch.empty(layout.num_chunks, H, K, V, device=ref.device, dtype=torch.float32) if fwd else None
    dh = torch.empty(layout.num_chunks, H, K, V, device=ref.device, dtype=torch.float32) if bwd else None
    BK, BV, tiles = _tiles(K, V)
    _local_states_kernel[(layout.num_chunks, H, tiles)](
        k, v, q, do, gc, h, dh, layout.cu_seqlens, layout.chunk_indices, scale,
        H=H, K=K, V=V, BT=layout.chunk_size, BK=BK, BV=BV, EXCLUSIVE=exclusive, FWD=fwd, BWD=bwd,
        DT=dot_dtype, num_warps=LOCAL_WARPS, num_stages=1)
    return h, dh


def chunk_scan_states(x, gc, layout: ChunkLayout, init, store_final: bool, reverse: bool):
    """In place on x [num_chunks, H, K, V] fp32 holding the local terms: each chunk's entry becomes the
    carried state at that chunk (forward: the state entering it, from `init` h0; reverse: the
    gradient of the state leaving it, from `init` dht). Returns (x, the state carried out of each
    sequence [N, H, K, V] fp32, i.e. ht or dh0, or None unless `store_final`)."""
    _, H, K, V = x.shape
    final = torch.empty(layout.num_seqs, H, K, V, device=x.device, dtype=torch.float32) if store_final else None
    BS = min(SCAN_BLOCK, max(32, triton.next_power_of_2(K * V)))
    _scan_kernel[(layout.num_seqs * H, triton.cdiv(K * V, BS))](
        x, gc, init, final, layout.cu_seqlens, layout.chunk_offsets,
        H=H, K=K, V=V, BT=layout.chunk_size, BS=BS, REVERSE=reverse,
        HAS_INIT=init is not None, STORE_FINAL=store_final, num_warps=max(1, min(4, BS // 128)), num_stages=1)
    return x, final


def walks(layout: ChunkLayout, H: int, K: int, V: int) -> bool:
    """Whether the state passes of this shape take the walk (N x H x tiles >= WALK_MIN_PROGRAMS programs)
    rather than the split pass (local terms, then the elementwise scan)."""
    return layout.num_seqs * H * _tiles(K, V, WALK_BLOCK)[2] >= WALK_MIN_PROGRAMS


def chunk_states_walk(q, k, v, do, gc, layout: ChunkLayout, h0, dht, scale: float, exclusive: bool, dot_dtype,
                      fwd: bool, bwd: bool, store_ht: bool = False, need_dh0: bool = False):
    """The walk over chunks, in one launch: with `fwd` the per-chunk entering states h [num_chunks, H, K, V]
    fp32 from k, v and h0 (and the final state ht if `store_ht`); with `bwd` the per-chunk gradients of
    the leaving states dh from q, do and dht (and dh0 if `need_dh0`). Unneeded inputs may be None.
    Returns (h, ht, dh, dh0), None where not computed."""
    ref = k if fwd else q
    B, T, H, K = ref.shape
    V = (v if fwd else do).shape[-1]
    N = layout.num_seqs

    def states(n):
        return torch.empty(n, H, K, V, device=ref.device, dtype=torch.float32)

    h = states(layout.num_chunks) if fwd else None
    dh = states(layout.num_chunks) if bwd else None
    ht = states(N) if fwd and store_ht else None
    dh0 = states(N) if bwd and need_dh0 else None
    BK, BV, tiles = _tiles(K, V, WALK_BLOCK)
    _walk_kernel[(N * H * (int(fwd) + int(bwd)), tiles)](
        k, v, q, do, gc, h0, ht, dht, dh0, h, dh, layout.cu_seqlens, layout.chunk_offsets, scale, N * H,
        H=H, K=K, V=V, BT=layout.chunk_size, BK=BK, BV=BV, EXCLUSIVE=exclusive, FWD=fwd, BWD=bwd,
        HAS_H0=fwd and h0 is not None, STORE_HT=ht is not None, HAS_DHT=bwd and dht is not None,
        STORE_DH0=dh0 is not None, DT=dot_dtype, num_warps=WALK_WARPS, num_stages=WALK_STAGES)
    return h, ht, dh, dh0


def chunk_state_fwd(k, v, gc, layout: ChunkLayout, h0, output_final_state: bool, dot_dtype):
    """Per-chunk entering states h [num_chunks, H, K, V] fp32 and the final state [N, H, K, V] (or None).

    S_out = exp(Γ_L) * S_in + Σ_j (k_j * exp(Γ_L - Γ_j)) v_j^T over the chunk (identity I1).
    """
    if walks(layout, k.shape[2], k.shape[3], v.shape[3]):
        h, ht, _, _ = chunk_states_walk(None, k, v, None, gc, layout, h0, None, 1.0, False, dot_dtype,
                                        fwd=True, bwd=False, store_ht=output_final_state)
        return h, ht
    h, _ = chunk_local_states(None, k, v, None, gc, layout, 1.0, False, dot_dtype, fwd=True, bwd=False)
    return chunk_scan_states(h, gc, layout, h0, output_final_state, reverse=False)


def chunk_states_fwd_bwd(q, k, v, do, gc, layout: ChunkLayout, h0, dht, scale: float, exclusive: bool,
                         need_dh0: bool, dot_dtype, h=None):
    """The backward's state passes: (h, dh, dh0 or None). h: the per-chunk entering states, as
    `chunk_state_fwd` gives them (without the final state); dh [num_chunks, H, K, V] fp32: the gradients
    of the leaving states, dS_in = exp(Γ_L) * dS_out + scale (q * exp(Γq))^T do from dht (or 0) at the
    end; dh0 the last of them. Both passes run in one walk launch or one launch of local terms; given
    `h` (a forward that kept its states), only the reverse pass runs (k, v and h0 unused) and h comes
    back as given."""
    fwd = h is None
    k, v, h0 = (k, v, h0) if fwd else (None, None, None)
    if walks(layout, q.shape[2], q.shape[3], do.shape[3]):
        h_, _, dh, dh0 = chunk_states_walk(q, k, v, do, gc, layout, h0, dht, scale, exclusive, dot_dtype,
                                           fwd=fwd, bwd=True, need_dh0=need_dh0)
        return (h_ if fwd else h), dh, dh0
    h_, dh = chunk_local_states(q, k, v, do, gc, layout, scale, exclusive, dot_dtype, fwd=fwd, bwd=True)
    if fwd:
        h, _ = chunk_scan_states(h_, gc, layout, h0, False, reverse=False)
    dh, dh0 = chunk_scan_states(dh, gc, layout, dht, need_dh0, reverse=True)
    return h, dh, dh0
