"""decode_matmul in Triton: one program per (tile of BN output columns, block of BB rows).

A tile lies inside one segment (the tile table gives its first output column, its segment's end,
its first weight row, its input, its activation and, for swiglu, the offset of the up rows). The
program walks K in blocks of BK: it builds the input block (loads it, or with the norm prologue
normalises the row block with the row statistics from a first walk and applies the lerp), and
accumulates in fp32, with tl.dot tiles (BB >= 16) or, for a few rows, a broadcast-and-sum (a GEMV:
the weight read is the cost, and a dot tile of one row wastes 15 of its 16), as the launch
configuration says. The epilogue applies the activation, the residual add and the commit copy of
the tile's columns. On Hopper the kernels launch as programmatic dependents
(flame.ops.utils.dependent_launch).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..utils.backend import triton_interpreter_enabled
from ..utils.dependent_launch import dependent_launch, launch_options, wait_for_producers
from .segments import ACTIVATIONS
from .decode_matmul_tuning import TABLE

TILE_FIELDS = 6  # first output column, segment end, first weight row, source, activation code, up-rows offset
_TILE_TABLES: dict[tuple, torch.Tensor] = {}


def tile_table(segments, block_n: int, device: torch.device) -> torch.Tensor:
    """The [tiles, TILE_FIELDS] int32 table of `segments` cut into tiles of block_n columns, built
    once per (segments, block_n, device): a captured CUDA graph then reads it without a copy."""
    key = (tuple(segments), block_n, device)
    table = _TILE_TABLES.get(key)
    if table is None:
        rows, col, wrow = [], 0, 0
        for seg in segments:
            up = seg.width if seg.act == "swiglu" else 0
            for start in range(0, seg.width, block_n):
                rows.append([col + start, col + seg.width, wrow + start, seg.source, ACTIVATIONS.index(seg.act), up])
            col += seg.width
            wrow += seg.weight_rows
        table = _TILE_TABLES[key] = torch.tensor(rows, dtype=torch.int32, device=device)
    return table


CONFIG_KEYS = ("DOT", "BB", "BN", "BK", "num_warps", "num_stages")
"""A launch configuration: the tl.dot path or the broadcast-and-sum, the block of rows (BB), of
output columns (BN) and of K (BK), and Triton's warps and software-pipelining stages."""


def check_config(config, where: str = "decode_matmul config") -> dict:
    """`config` as a dict of CONFIG_KEYS, or a ValueError naming what is wrong with it: block sizes
    are powers of two, the tl.dot path needs blocks of at least 16 (its smallest tile)."""
    if not isinstance(config, dict) or set(config) != set(CONFIG_KEYS):
        raise ValueError(f"{where}: a launch configuration is a dict of exactly {CONFIG_KEYS}, got {config!r}")
    for key in ("BB", "BN", "BK"):
        value = config[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1 or value & (value - 1) \
                or value > 4096:
            raise ValueError(f"{where}: {key} must be a power of two in [1, 4096], got {value!r}")
    if not isinstance(config["DOT"], bool):
        raise ValueError(f"{where}: DOT must be True or False, got {config['DOT']!r}")
    if config["DOT"] and min(config["BB"], config["BN"], config["BK"]) < 16:
        raise ValueError(f"{where}: the tl.dot path needs BB, BN and BK >= 16, got {config!r}")
    if config["num_warps"] not in (1, 2, 4, 8, 16):
        raise ValueError(f"{where}: num_warps must be 1, 2, 4, 8 or 16, got {config['num_warps']!r}")
    if not isinstance(config["num_stages"], int) or not 1 <= config["num_stages"] <= 8:
        raise ValueError(f"{where}: num_stages must be an int in [1, 8], got {config['num_stages']!r}")
    return dict(config)


def batch_bucket(B: int) -> int:
    """The table's batch key of B rows: the next power of two."""
    return triton.next_power_of_2(B)


def check_table(table) -> dict:
    """The tuning table {(batch bucket, N, K): config} checked entry by entry (a ValueError names
    the first bad one): keys are three positive ints with a power-of-two bucket, values pass
    `check_config`."""
    if not isinstance(table, dict):
        raise ValueError(f"decode_matmul tuning table must be a dict, got {type(table).__name__}")
    checked = {}
    for key, config in table.items():
        if not (isinstance(key, tuple) and len(key) == 3 and all(isinstance(v, int) and v >= 1 for v in key)
                and batch_bucket(key[0]) == key[0]):
            raise ValueError(f"decode_matmul tuning table: a key is (batch bucket, N, K), three positive ints with "
                             f"a power-of-two bucket, got {key!r}")
        checked[key] = check_config(config, f"decode_matmul tuning table entry {key}")
    return checked


@functools.cache
def _checked_table() -> dict:
    return check_table(TABLE)


GEMV_ROWS = 4
"""Up to this many rows the fallback launch is a GEMV (broadcast-and-sum); from one more, tl.dot tiles."""


def fallback_config(B: int, N: int, K: int, sms: int) -> dict:
    """A launch configuration for a shape the table lacks: enough programs (column tiles x row
    tiles >= 2x the SMs where the blocks' lower bounds allow it) to spread the weight read over
    the GPU. Up to GEMV_ROWS rows a GEMV: BN output columns from 64 down to 8 while the programs
    are too few, and K blocks making a tile of 8K products (the whole of K where it fits); from
    GEMV_ROWS + 1 rows tl.dot tiles of 16 to 64 rows and columns, BK 64 or 128."""
    target = 2 * sms
    bk_max = max(16, triton.next_power_of_2(K))
    if B <= GEMV_ROWS:
        bb, bn = triton.next_power_of_2(B), 64
        while bn > 8 and triton.cdiv(N, bn) < target:
            bn //= 2
        bk = min(bk_max, max(32, 8192 // (bb * bn)))
        return dict(DOT=False, BB=bb, BN=bn, BK=bk, num_warps=4, num_stages=2)
    bb, bn = max(16, min(64, triton.next_power_of_2(B))), 64
    while triton.cdiv(N, bn) * triton.cdiv(B, bb) < target and max(bb, bn) > 16:
        if bn >= bb:
            bn //= 2
        else:
            bb //= 2
    bk = min(bk_max, 64 if bb * bn >= 2048 else 128)
    return dict(DOT=True, BB=bb, BN=bn, BK=max(16, bk), num_warps=4, num_stages=3)


def launch_config(B: int, N: int, K: int, sms: int = 132, table: dict | None = None, element_size: int = 2,
                  shared_memory: int | None = None, weight_tiles: int = 1) -> dict:
    """The launch configuration of B rows, N output columns and K inputs: the tuning table's entry
    for (batch bucket, N, K) (`table`, checked, or flame's decode_matmul_tuning.TABLE), else
    `fallback_config` for a GPU of `sms` SMs; then fitted to `shared_memory` bytes per block
    (`fit_shared_memory`) for operands of `element_size` bytes (the table holds bf16 launches) and
    `weight_tiles` weight tiles per K block (2 for swiglu's gate and up rows)."""
    config = (_checked_table() if table is None else check_table(table)).get((batch_bucket(B), N, K))
    config = dict(config) if config is not None else fallback_config(B, N, K, sms)
    if shared_memory is None:
        return config
    return fit_shared_memory(config, element_size, shared_memory, weight_tiles)


def fit_shared_memory(config: dict, element_size: int, shared_memory: int, weight_tiles: int = 1) -> dict:
    """`config` with fewer pipelining stages, then shorter K blocks, until the staged operand tiles
    (stages x (BB input rows + weight_tiles x BN weight rows) x BK x element_size) fit in 90% of
    `shared_memory` bytes: a bf16 launch of the table run on fp32 operands, or on a GPU with less
    shared memory per block than the one it was tuned on."""
    config = dict(config)
    budget = 0.9 * shared_memory
    need = lambda: (config["num_stages"] * (config["BB"] + weight_tiles * config["BN"]) * config["BK"]  # noqa: E731
                    * element_size)
    smallest_bk = 16 if config["DOT"] else 8
    while need() > budget and config["num_stages"] > 2:
        config["num_stages"] -= 1
    while need() > budget and config["BK"] > smallest_bk:
        config["BK"] //= 2
    while need() > budget and config["num_stages"] > 1:
        config["num_stages"] -= 1
    return config


@functools.cache
def _shared_memory(device: torch.device) -> int:
    """Shared memory per block with opt-in, bytes (99 KB where torch does not say)."""
    if device.type == "cuda":
        return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 99 * 1024)
    return 227 * 1024


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


@triton.jit
def _tanh(z):
    return 2 * tl.sigmoid(2 * z) - 1


@triton.jit
def _accumulate(acc, b_a, b_w, DOT: tl.constexpr, DOT_F32: tl.constexpr):
    """acc [BB, BN] + b_a [BB, BK] @ b_w [BN, BK]^T: a tl.dot tile (fp32 operands, exact products,
    under the interpreter and for fp32 weights), or a broadcast-and-sum over K."""
    if DOT:
        if DOT_F32:
            acc += tl.dot(b_a.to(tl.float32), tl.trans(b_w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(b_a, tl.trans(b_w))
    else:
        acc += tl.sum(b_a.to(tl.float32)[:, None, :] * b_w.to(tl.float32)[None, :, :], 2)
    return acc


@triton.jit
def _weight_block(p_w, o_k, m_n, K):
    """The [BN, BK] block of weight rows p_w at columns o_k (zeros past K and past the tile's rows)."""
    return tl.load(p_w + o_k[None, :], mask=m_n[:, None] & (o_k < K)[None, :], other=0)


@triton.jit
def _row_statistics(x, rows, s_xb, m_b, K, eps, NORM: tl.constexpr, SILU: tl.constexpr, BB: tl.constexpr,
                    BK: tl.constexpr):
    """The norm's mean and 1/std of a block of rows of x (of silu(x) with SILU), walking K; RMSNorm's
    mean is 0."""
    b_s1 = tl.zeros([BB], dtype=tl.float32)
    b_s2 = tl.zeros([BB], dtype=tl.float32)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_bk = m_b[:, None] & (o_k < K)[None, :]
        b_x = tl.load(x + rows[:, None] * s_xb + o_k[None, :], mask=m_bk, other=0).to(tl.float32)
        if SILU:
            b_x = b_x * tl.sigmoid(b_x)
        b_s1 += tl.sum(b_x, 1)
        b_s2 += tl.sum(b_x * b_x, 1)
    if NORM == 1:  # LayerNorm
        b_mean = b_s1 / K
        b_rstd = 1 / tl.sqrt(tl.maximum(b_s2 / K - b_mean * b_mean, 0.0) + eps)
    else:  # RMSNorm
        b_mean = tl.zeros([BB], dtype=tl.float32)
        b_rstd = 1 / tl.sqrt(b_s2 / K + eps)
    return b_mean, b_rstd


@triton.jit
def _lerped_block(x, rows, s_xb, o_k, m_k, m_bk, b_mean, b_rstd, nw, nb, prev, mu, mix, src, s_mp, s_mb, h_out, K,
                  SILU: tl.constexpr, LERP: tl.constexpr, MIX: tl.constexpr, STORE_H: tl.constexpr, write_h):
    """A [rows, K block] block of input `src`: h = norm(x) rounded to x's dtype (stored to h_out
    where `write_h`), then with LERP the lerp h + (prev - h) * (mu[src] + mix[src]), rounded once."""
    b_x = tl.load(x + rows[:, None] * s_xb + o_k[None, :], mask=m_bk, other=0).to(tl.float32)
    if SILU:
        b_x = b_x * tl.sigmoid(b_x)
    b_h = (b_x - b_mean[:, None]) * b_rstd[:, None]
    if nw is not None:
        b_h = b_h * tl.load(nw + o_k, mask=m_k, other=0).to(tl.float32)[None, :]
    if nb is not None:
        b_h = b_h + tl.load(nb + o_k, mask=m_k, other=0).to(tl.float32)[None, :]
    b_h = b_h.to(x.dtype.element_ty)
    if STORE_H:
        tl.store(h_out + rows[:, None] * K + o_k[None, :], b_h, mask=m_bk & write_h)
    if LERP:
        b_hf = b_h.to(tl.float32)
        b_d = tl.load(prev + rows[:, None] * K + o_k[None, :], mask=m_bk, other=0).to(tl.float32) - b_hf
        b_c = tl.load(mu + src * K + o_k, mask=m_k, other=0).to(tl.float32)[None, :]
        if MIX:
            b_c = b_c + tl.load(mix + src * s_mp + rows[:, None] * s_mb + o_k[None, :], mask=m_bk,
                                other=0).to(tl.float32)
        return (b_hf + b_d * b_c).to(x.dtype.element_ty)
    return b_h


@triton.jit
def _prologue_kernel(x, s_xb, inputs, P, B, K, nw, nb, eps, prev, mu, mix, s_mp, s_mb, h_out,
                     NORM: tl.constexpr, SILU: tl.constexpr, LERP: tl.constexpr, MIX: tl.constexpr,
                     STORE_H: tl.constexpr, PDL: tl.constexpr, BK: tl.constexpr):
    """The prologue alone, one program per row: the inputs [P, B, K] that the products read."""
    i_b = tl.program_id(0)
    rows = tl.full([1], i_b, dtype=tl.int64)
    m_b = rows < B
    wait_for_producers(PDL)
    b_mean, b_rstd = _row_statistics(x, rows, s_xb, m_b, K, eps, NORM, SILU, 1, BK)
    for src in range(0, P):
        for k0 in range(0, K, BK):
            o_k = k0 + tl.arange(0, BK)
            m_k = o_k < K
            m_bk = m_b[:, None] & m_k[None, :]
            b_a = _lerped_block(x, rows, s_xb, o_k, m_k, m_bk, b_mean, b_rstd, nw, nb, prev, mu, mix, src, s_mp,
                                s_mb, h_out, K, SILU, LERP, MIX, STORE_H, src == 0)
            tl.store(inputs + (src * B + rows[:, None]) * K + o_k[None, :], b_a, mask=m_bk)


@triton.jit
def _decode_matmul_kernel(x, s_xp, s_xb, w, tiles, out, N, B, K,
                          nw, nb, eps, prev, mu, mix, s_mp, s_mb, h_out,
                          res, gate, s_gb, c_src, c_dst,
                          NORM: tl.constexpr, SILU: tl.constexpr, LERP: tl.constexpr, MIX: tl.constexpr,
                          STORE_H: tl.constexpr, RESID: tl.constexpr, GATE: tl.constexpr, COMMIT: tl.constexpr,
                          GLU: tl.constexpr, DOT: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr,
                          BB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    i_n = tl.program_id(0)
    i_b = tl.program_id(1)
    p_t = tiles + i_n * 6
    col0 = tl.load(p_t)
    col_end = tl.load(p_t + 1)
    wrow0 = tl.load(p_t + 2)
    src = tl.load(p_t + 3)
    act = tl.load(p_t + 4)
    up = tl.load(p_t + 5)
    o_b = i_b * BB + tl.arange(0, BB)
    m_b = o_b < B
    rows = o_b.to(tl.int64)
    o_n = tl.arange(0, BN)
    m_n = col0 + o_n < col_end
    p_w = w + (wrow0 + o_n).to(tl.int64)[:, None] * K
    p_u = p_w + up.to(tl.int64) * K

    # The GEMV path (no DOT) reads each weight once and nothing else of size: its first weight block
    # is in flight before the wait and the statistics walk (the weights are constants of the step),
    # and each iteration loads the next block before it multiplies the current. The tl.dot path
    # loads its blocks in the loop, where Triton's software pipelining stages them.
    if not DOT:
        b_w = _weight_block(p_w, tl.arange(0, BK), m_n, K)
        if GLU:
            b_u = _weight_block(p_u, tl.arange(0, BK), m_n, K)
    wait_for_producers(PDL)

    if NORM != 0:
        b_mean, b_rstd = _row_statistics(x, rows, s_xb, m_b, K, eps, NORM, SILU, BB, BK)

    acc = tl.zeros([BB, BN], dtype=tl.float32)
    acc_up = tl.zeros([BB, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        m_bk = m_b[:, None] & m_k[None, :]
        if NORM != 0:
            b_a = _lerped_block(x, rows, s_xb, o_k, m_k, m_bk, b_mean, b_rstd, nw, nb, prev, mu, mix, src, s_mp, s_mb,
                                h_out, K, SILU, LERP, MIX, STORE_H, i_n == 0)
        else:
            b_a = tl.load(x + src * s_xp + rows[:, None] * s_xb + o_k[None, :], mask=m_bk, other=0)
        if DOT:
            acc = _accumulate(acc, b_a, _weight_block(p_w, o_k, m_n, K), DOT, DOT_F32)
            if GLU:
                acc_up = _accumulate(acc_up, b_a, _weight_block(p_u, o_k, m_n, K), DOT, DOT_F32)
        else:
            b_w_next = _weight_block(p_w, o_k + BK, m_n, K)
            acc = _accumulate(acc, b_a, b_w, DOT, DOT_F32)
            b_w = b_w_next
            if GLU:
                b_u_next = _weight_block(p_u, o_k + BK, m_n, K)
                acc_up = _accumulate(acc_up, b_a, b_u, DOT, DOT_F32)
                b_u = b_u_next

    if GLU:
        b_y = acc * tl.sigmoid(acc) * acc_up
    else:
        b_y = tl.where(act == 1, _tanh(acc), acc)
        b_y = tl.where(act == 2, tl.sigmoid(acc), b_y)
        b_y = tl.where(act == 3, tl.maximum(acc, 0.0) * tl.maximum(acc, 0.0), b_y)
    cols = col0 + o_n
    m_bn = m_b[:, None] & m_n[None, :]
    p_o = rows[:, None] * N + cols[None, :]
    if RESID:
        if GATE:
            b_y = b_y * tl.sigmoid(tl.load(gate + rows[:, None] * s_gb + cols[None, :], mask=m_bn,
                                           other=0).to(tl.float32))
        b_y = tl.load(res + p_o, mask=m_bn, other=0).to(tl.float32) + b_y
        tl.store(res + p_o, b_y.to(res.dtype.element_ty), mask=m_bn)
    else:
        tl.store(out + p_o, b_y.to(out.dtype.element_ty), mask=m_bn)
    if COMMIT:
        tl.store(c_dst + p_o, tl.load(c_src + p_o, mask=m_bn, other=0), mask=m_bn)


SEPARATE_PROLOGUE_ROWS = 8
"""From this many rows the norm and lerps run once in a launch of their own (`_prologue`) instead
of in every program of the products, each of which would otherwise recompute them for all its rows
over all of K (bench.decode_matmul --sweep shows the fused prologue's cost growing with the rows)."""


def _prologue(x, norm, norm_weight, norm_bias, eps, silu, previous, mu, mix, h_out) -> torch.Tensor:
    """The inputs [P, B, K] of the products: the norm of x's rows and their lerps (or h alone)."""
    B, K = x.shape
    P = 1 if mu is None else mu.shape[0]
    inputs = torch.empty(P, B, K, dtype=x.dtype, device=x.device)
    pdl = dependent_launch(x.device)
    _prologue_kernel[(B,)](
        x, x.stride(0), inputs, P, B, K, norm_weight, norm_bias if norm == "layer" else None, eps, previous,
        None if mu is None else mu.contiguous(), mix, mix.stride(0) if mix is not None else 0,
        mix.stride(1) if mix is not None else 0, h_out, NORM=1 if norm == "layer" else 2, SILU=bool(silu),
        LERP=mu is not None, MIX=mix is not None, STORE_H=h_out is not None, PDL=pdl,
        BK=min(1024, max(16, triton.next_power_of_2(K))), num_warps=4, **launch_options(pdl))
    return inputs


def decode_matmul_triton(x, weight, segments, norm, norm_weight, norm_bias, eps, silu, previous, mu, mix, h_out,
                         residual, residual_gate, commit, config: dict | None = None, warmup: bool = False):
    """Inputs are already checked (flame.ops.decode_matmul). `config`: a launch configuration
    (CONFIG_KEYS) in place of `launch_config`'s; `warmup`: compile the kernel for these arguments
    without running it (bench.decode_matmul's sweep compiles its candidates in parallel)."""
    B, K = x.shape[-2:]
    N = sum(seg.width for seg in segments)
    if norm is not None and B >= SEPARATE_PROLOGUE_ROWS and not warmup:
        x = _prologue(x, norm, norm_weight, norm_bias, eps, silu, previous, mu, mix, h_out)
        norm = previous = mu = mix = h_out = None
    glu = segments[0].act == "swiglu"
    blocks = launch_config(B, N, K, _sm_count(x.device), element_size=x.element_size(),
                           shared_memory=_shared_memory(x.device), weight_tiles=2 if glu else 1
                           ) if config is None else check_config(config)
    tiles = tile_table(segments, blocks["BN"], x.device)
    out = residual if residual is not None else torch.empty(B, N, dtype=x.dtype, device=x.device)
    dot_f32 = triton_interpreter_enabled() or x.dtype != torch.bfloat16 and x.dtype != torch.float16
    src, dst = commit if commit is not None else (None, None)
    pdl = dependent_launch(x.device)
    grid = (tiles.shape[0], triton.cdiv(B, blocks["BB"]))
    args = (
        x, x.stride(0) if norm is None else 0, x.stride(-2), weight, tiles, out, N, B, K,
        norm_weight if norm else None, norm_bias if norm == "layer" else None, eps, previous,
        None if mu is None else mu.contiguous(), mix,
        mix.stride(0) if mix is not None else 0, mix.stride(1) if mix is not None else 0, h_out,
        residual, residual_gate, residual_gate.stride(0) if residual_gate is not None else 0, src, dst,
    )
    options = dict(
        NORM=0 if norm is None else 1 if norm == "layer" else 2, SILU=bool(silu), LERP=mu is not None,
        MIX=mix is not None, STORE_H=h_out is not None, RESID=residual is not None, GATE=residual_gate is not None,
        COMMIT=commit is not None, GLU=glu, DOT=blocks["DOT"], DOT_F32=dot_f32, PDL=pdl, BB=blocks["BB"],
        BN=blocks["BN"], BK=blocks["BK"], num_warps=blocks["num_warps"], num_stages=blocks["num_stages"],
        **launch_options(pdl),
    )
    if warmup:
        _decode_matmul_kernel.warmup(*args, grid=grid, **options)
    else:
        _decode_matmul_kernel[grid](*args, **options)
    return out
