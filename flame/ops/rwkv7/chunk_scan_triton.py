"""The sequential scans of chunked RWKV7 in Triton, one program per sequence*head and V-block walking its
chunks: forward O = Q' S + E V, S <- A S + C^T V; backward dV = E^T dO + C dS, dS <- A^T dS + Q'^T dO
(chunk_triton.py); and their host launchers."""

import torch
import triton
import triton.language as tl

from ..common.chunk_triton.intra import mm_prec
from .chunk_helpers_triton import cast_to, dot_lowp, load_tile
from .chunk_plan import WARPS_SCAN


@triton.jit
def _scan_tiles(cu_seqlens, chunk_offsets, i_nh, i_v, H, K, V, BT: tl.constexpr, BK: tl.constexpr,
                BV: tl.constexpr):
    """What a scan program of sequence*head i_nh and V-block i_v walks with: its sequence and head, the
    sequence's token span [bos, eos) and first chunk c0 (int64), the row range, the K and V masks, and
    the offsets of a state tile, of A and of the chunk's first rows of K-, V- and BT-wide tensors."""
    i_n = i_nh // H
    i_h = i_nh % H
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    rows = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    s_off = o_k[:, None] * V + o_v[None, :]
    a_off = o_k[:, None] * K + o_k[None, :]
    p_k0 = (rows * H * K)[:, None] + o_k[None, :]
    p_v0 = (rows * H * V)[:, None] + o_v[None, :]
    p_t0 = (rows * H * BT)[:, None] + rows[None, :]
    return i_n, i_h, bos, eos, c0, rows, m_k, m_v, m_kv, s_off, a_off, p_k0, p_v0, p_t0


@triton.jit
def _load_chunk_maps(Qs, Es, Cs, As, t0, i_c, i_h, H, K, BT: tl.constexpr, p_k0, p_t0, a_off, m_r, m_k):
    """The scans' per-chunk maps Q', E, C (rows of the chunk starting at token t0) and A (chunk i_c),
    fp32. int64 scalar offsets of the chunk's first row, int32 tile offsets."""
    base = t0 * H + i_h
    b_Q = load_tile(Qs + base * K, p_k0, m_r & m_k[None, :])
    b_E = load_tile(Es + base * BT, p_t0, m_r)
    b_C = load_tile(Cs + base * K, p_k0, m_r & m_k[None, :])
    b_A = tl.load(As + (i_c * H + i_h) * K * K + a_off, mask=m_k[:, None] & m_k[None, :], other=0.0)
    return b_Q, b_E, b_C, b_A


@triton.jit
def _scan_fwd_kernel(
    v, Qs, Es, Cs, As, h0, hs, ht, o, cu_seqlens, chunk_offsets,
    H, K, V, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HS: tl.constexpr, STORE_HT: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr,
):
    """One sequence*head and V-block: O = Q' S + E V and S <- A S + C^T V, chunk after chunk."""
    _scan_fwd_program(v, Qs, Es, Cs, As, h0, hs, ht, o, cu_seqlens, chunk_offsets, tl.program_id(0), tl.program_id(1),
                      H, K, V, BT, BK, BV, HAS_H0, STORE_HS, STORE_HT, True, LOWP, PREC)


@triton.jit
def _scan_fwd_program(
    v, Qs, Es, Cs, As, h0, hs, ht, o, cu_seqlens, chunk_offsets, i_nh, i_v,
    H, K, V, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HS: tl.constexpr, STORE_HT: tl.constexpr, STORE_O: tl.constexpr, LOWP: tl.constexpr,
    PREC: tl.constexpr,
):
    """The forward scan of sequence*head i_nh and V-block i_v; the states S^in of every chunk go to hs
    (STORE_HS), the output to o (STORE_O)."""
    i_n, i_h, bos, eos, c0, rows, m_k, m_v, m_kv, s_off, a_off, p_k0, p_v0, p_t0 = _scan_tiles(
        cu_seqlens, chunk_offsets, i_nh, i_v, H, K, V, BT, BK, BV)

    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        S += tl.load(h0 + (i_n * H + i_h).to(tl.int64) * K * V + s_off, mask=m_kv, other=0.0).to(tl.float32)
    for i_t in range(0, tl.cdiv(eos - bos, BT)):
        t0 = bos + i_t * BT
        m_r = (rows < eos - t0)[:, None]
        if STORE_HS:
            tl.store(hs + ((c0 + i_t) * H + i_h) * K * V + s_off, S, mask=m_kv)
        bv = (t0 * H + i_h) * V
        b_v = load_tile(v + bv, p_v0, m_r & m_v[None, :])
        b_Q, b_E, b_C, b_A = _load_chunk_maps(Qs, Es, Cs, As, t0, c0 + i_t, i_h, H, K, BT, p_k0, p_t0, a_off, m_r, m_k)
        if STORE_O:
            b_o = dot_lowp(b_Q, S, LOWP, PREC) + dot_lowp(b_E, b_v, LOWP, PREC)
            tl.store(o + bv + p_v0, cast_to(b_o, o, LOWP), mask=m_r & m_v[None, :])
        S = mm_prec(b_A, S, PREC) + dot_lowp(tl.trans(b_C), b_v, LOWP, PREC)
    if STORE_HT:
        tl.store(ht + (i_n * H + i_h).to(tl.int64) * K * V + s_off, S, mask=m_kv)


@triton.jit
def _scan_bwd_kernel(
    do, Qs, Es, Cs, As, dht, dhs, dh0, dv, cu_seqlens, chunk_offsets,
    H, K, V, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr,
):
    """One sequence*head and V-block, last chunk first: dV = E^T dO + C dS and dS <- A^T dS + Q'^T dO;
    dS^out of every chunk goes to dhs."""
    _scan_bwd_program(do, Qs, Es, Cs, As, dht, dhs, dh0, dv, cu_seqlens, chunk_offsets, tl.program_id(0),
                      tl.program_id(1), H, K, V, BT, BK, BV, HAS_DHT, STORE_DH0, LOWP, PREC)


@triton.jit
def _scan_pair_kernel(
    v, do, Qs, Es, Cs, As, h0, hs, dht, dhs, dh0, dv, cu_seqlens, chunk_offsets,
    H, K, V, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr,
):
    """The backward's two scans in one launch, for a forward that did not keep its states: programs
    of grid axis 2 = 0 run the forward scan again for the states hs (no output), those of axis 2 = 1
    the backward scan. The two are independent and each is latency-bound (one program per sequence,
    head and V-block walks all chunks), so they share the GPU's SMs instead of running one after the
    other."""
    if tl.program_id(2) == 0:
        _scan_fwd_program(v, Qs, Es, Cs, As, h0, hs, None, None, cu_seqlens, chunk_offsets, tl.program_id(0),
                          tl.program_id(1), H, K, V, BT, BK, BV, HAS_H0, True, False, False, LOWP, PREC)
    else:
        _scan_bwd_program(do, Qs, Es, Cs, As, dht, dhs, dh0, dv, cu_seqlens, chunk_offsets, tl.program_id(0),
                          tl.program_id(1), H, K, V, BT, BK, BV, HAS_DHT, STORE_DH0, LOWP, PREC)


@triton.jit
def _scan_bwd_program(
    do, Qs, Es, Cs, As, dht, dhs, dh0, dv, cu_seqlens, chunk_offsets, i_nh, i_v,
    H, K, V, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, LOWP: tl.constexpr, PREC: tl.constexpr,
):
    """The backward scan of sequence*head i_nh and V-block i_v."""
    i_n, i_h, bos, eos, c0, rows, m_k, m_v, m_kv, s_off, a_off, p_k0, p_v0, p_t0 = _scan_tiles(
        cu_seqlens, chunk_offsets, i_nh, i_v, H, K, V, BT, BK, BV)

    dS = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DHT:
        dS += tl.load(dht + (i_n * H + i_h).to(tl.int64) * K * V + s_off, mask=m_kv, other=0.0).to(tl.float32)
    NT = tl.cdiv(eos - bos, BT)
    for i in range(0, NT):
        i_t = NT - 1 - i
        t0 = bos + i_t * BT
        m_r = (rows < eos - t0)[:, None]
        tl.store(dhs + ((c0 + i_t) * H + i_h) * K * V + s_off, dS, mask=m_kv)
        bv = (t0 * H + i_h) * V
        b_do = load_tile(do + bv, p_v0, m_r & m_v[None, :])
        b_Q, b_E, b_C, b_A = _load_chunk_maps(Qs, Es, Cs, As, t0, c0 + i_t, i_h, H, K, BT, p_k0, p_t0, a_off, m_r, m_k)
        b_dv = dot_lowp(tl.trans(b_E), b_do, LOWP, PREC) + dot_lowp(b_C, dS, LOWP, PREC)
        tl.store(dv + bv + p_v0, cast_to(b_dv, dv, LOWP), mask=m_r & m_v[None, :])
        dS = mm_prec(tl.trans(b_A), dS, PREC) + dot_lowp(tl.trans(b_Q), b_do, LOWP, PREC)
    if STORE_DH0:
        tl.store(dh0 + (i_n * H + i_h).to(tl.int64) * K * V + s_off, dS, mask=m_kv)

def scan_fwd(plan, maps, v, h0, hs, ht, o):
    """The forward scan: o, the per-chunk states hs (if given) and the final state ht (if given) from the
    maps Q', E, C, A of `prepare` and the initial state h0 (or None)."""
    H, K, V = plan.H, plan.K, plan.V
    _scan_fwd_kernel[(plan.N * H, plan.NV)](
        v, maps["Qs"], maps["Es"], maps["Cs"], maps["As"], h0, hs, ht, o, plan.cu, plan.chunk_offsets,
        H=H, K=K, V=V, BT=plan.BT, BK=plan.BK, BV=plan.BV, HAS_H0=h0 is not None, STORE_HS=hs is not None,
        STORE_HT=ht is not None, LOWP=plan.lowp, PREC=plan.prec_state, num_warps=WARPS_SCAN,
        num_stages=plan.scan_stages,
    )


def scan_bwd(plan, maps, v, do, h0, hs, dht, dhs, dh0, dv):
    """The backward scan: dv, the per-chunk state gradients dhs and dh0 (if given) from dO, dht (or None)
    and the maps. `hs` None: the forward did not keep its states, and the same launch runs the forward
    scan again for them from h0 (`_scan_pair_kernel`); returns hs."""
    H, K, V = plan.H, plan.K, plan.V
    args = (maps["Qs"], maps["Es"], maps["Cs"], maps["As"])
    launch = dict(H=H, K=K, V=V, BT=plan.BT, BK=plan.BK, BV=plan.BV, HAS_DHT=dht is not None,
                  STORE_DH0=dh0 is not None, LOWP=plan.lowp, PREC=plan.prec_state, num_warps=WARPS_SCAN,
                  num_stages=plan.scan_stages)
    if hs is None:
        hs = torch.empty_like(dhs)
        _scan_pair_kernel[(plan.N * H, plan.NV, 2)](
            v, do, *args, h0, hs, dht, dhs, dh0, dv, plan.cu, plan.chunk_offsets, HAS_H0=h0 is not None, **launch)
    else:
        _scan_bwd_kernel[(plan.N * H, plan.NV)](do, *args, dht, dhs, dh0, dv, plan.cu, plan.chunk_offsets, **launch)
    return hs
