"""The plan of one chunked RWKV7 call in Triton: its chunk size and intra regime, chunk tables, block
sizes, operand precisions and launch settings, all decided on the host from the shapes, the dtype and
the gate bound before any kernel runs (chunk_triton.py describes the kernels)."""

import math

import torch
import triton

from ..common.chunk_triton.layout import fixed_length_tables
from ..common.chunk_triton.plan import three_programs_register_cap
from ..utils.backend import triton_interpreter_enabled

LOG2E = 1.4426950408889634
HEADROOM_LOG2 = 124.0  # fp32 exponent range (128) minus 4 bits of headroom
MAX_CHUNK_K = 128  # larger head dims go to the fused recurrent kernels
# warps per program: 4 everywhere. The per-chunk kernels compiled for 8 warps with 3xTF32 products
# give wrong results and illegal memory accesses on an H100 with triton 3.6 (BT = 64); at BT = 32 with
# bf16x3 products they run correctly but slower, although 8 warps halve their registers per thread
# (bench/RESULTS.md, "Chunk kernels' launch settings"; ChunkPlan.warps_* for a trial).
WARPS_CHUNK = 4
WARPS_SCAN = 4


def centred_chunk_size(gate_lower_bound) -> int | None:
    """Largest chunk size in (64, 32, 16) whose centred factors stay within fp32 headroom, or None."""
    if gate_lower_bound is None:
        return None
    lb = float(gate_lower_bound)
    if not math.isfinite(lb) or lb > 0:
        raise ValueError(f"gate_lower_bound must be a finite number <= 0 (a bound on the log-decay), got {lb}")
    for bt in (64, 32, 16):
        if abs(lb) * (bt / 2 + 1) * LOG2E <= HEADROOM_LOG2:
            return bt
    return None


def chunk_size(gate_lower_bound) -> tuple[int, bool]:
    """(chunk size, centred): the centred regime's chunk size where the bound admits it, capped at 32
    (C = 64 spills kilobytes per thread in the per-chunk kernels), else 16 and the exact regime."""
    bt = centred_chunk_size(gate_lower_bound)
    return (min(bt, 32), True) if bt is not None else (16, False)


def _chunk_layout(B, T, BT, cu_seqlens, device):
    """cu_seqlens (int64), chunk_info [NT, 2] = (sequence, chunk-in-sequence), chunk_offsets [N+1]."""
    if cu_seqlens is None:
        return (*fixed_length_tables(B, T, BT, device), B)
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    counts = [triton.cdiv(int(n), BT) for n in (cu[1:] - cu[:-1]).tolist()]
    info = [(n, i) for n, c in enumerate(counts) for i in range(c)]
    chunk_info = torch.tensor(info, dtype=torch.int32, device=device).reshape(-1, 2)
    offsets = torch.tensor([0] + counts, dtype=torch.int64, device=device).cumsum(0)
    return cu, chunk_info, offsets, len(counts)


def _scan_block_v(N, H, V):
    """V-block of the scans: the widest (<= 64) that still gives ~256 programs, at least 16 (the fastest
    of the widths and warp counts tried; the scans are latency-bound)."""
    bv = min(max(triton.next_power_of_2(V), 16), 64)
    while bv > 16 and N * H * triton.cdiv(V, bv) < 256:
        bv //= 2
    return bv


def check_kernel_dtype(op, r):
    if r.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{op}: the Triton kernels take float32, float16 or bfloat16 inputs, got {r.dtype}; "
                        "use backend='torch' for float64")


def scan_dtype_of(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the scans' per-token operands Q', E, C: bf16 for bf16 inputs, else fp32."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def intermediate_specs(B, T, H, K, BT, NT, centred, scan_dtype) -> dict:
    """{name: (shape, dtype)} of every intermediate `prepare` can write (shape None: not written, the
    regime outside the centred regime)."""
    f32 = torch.float32
    per_k, per_t = (B, T, H, K), (B, T, H, BT)
    return {"Qs": (per_k, scan_dtype), "Es": (per_t, scan_dtype), "Cs": (per_k, scan_dtype),
            "As": ((NT, H, K, K), f32), "regime": ((NT, H) if centred else None, torch.int8),
            "Wm": (per_k, f32), "Gm": (per_t, f32), "Mak": (per_t, f32), "Mqb": (per_t, f32), "Tm": (per_t, f32)}


class ChunkPlan:
    """Everything the kernels need to know about one call's shapes and regime."""

    def __init__(self, r, v, cu_seqlens, gate_lower_bound):
        B, T, H, K = r.shape
        V = v.shape[-1]
        self.B, self.T, self.H, self.K, self.V = B, T, H, K, V
        self.BK = max(triton.next_power_of_2(K), 16)
        self.BT, self.centred = chunk_size(gate_lower_bound)
        self.lower_bound = float(gate_lower_bound) if self.centred else 0.0
        # launches of the per-chunk kernels that depend on the regime (`regime_selected`): the centred
        # chunks, then those that break the bound
        self.modes = (1, 2) if self.centred else (0,)
        self.HP = triton.next_power_of_2(H)  # the regime row of a chunk, one vector load (`fallback_heads`)
        self.cu, self.chunk_info, self.chunk_offsets, self.N = _chunk_layout(B, T, self.BT, cu_seqlens, r.device)
        self.NT = self.chunk_info.shape[0]
        self.BV = _scan_block_v(self.N, H, V)
        self.NV = triton.cdiv(V, self.BV)
        self.BV_bwd = min(max(triton.next_power_of_2(V), 16), 32)  # V block of the backward's reductions over V
        # the scans prefetch the next chunk's matrices (2 stages) where shared memory allows
        self.scan_stages = 2 if self.BK <= 64 else 1
        interp = triton_interpreter_enabled()
        # the state recurrence A S: 3xTF32 for every input dtype (plain TF32 overflows a trained head,
        # tests/ops/test_rwkv7_bf16_trained_head.py)
        self.prec_state = "tf32x3"
        # the per-chunk kernels' fp32-operand products: bf16x3 (half the work of 3xTF32, the trained head's
        # errors unchanged) for 16-bit inputs, 3xTF32 for fp32. One TF32 pass instead (emulated under the
        # interpreter, trained head, T 1024) triples o's error in `prepare` and multiplies da's and dw's by
        # 2.4 in `_bwd_intra`, and dw's by 1.5 in `_bwd_maps`
        self.prec = "tf32x3" if r.dtype == torch.float32 else "bf16x3"
        # the register cap of `prepare` and `_bwd_intra` at head dims <= 64: 3 programs per SM instead of
        # 2, faster despite some spilling (`_bwd_maps`, which spills little at this cap, is faster
        # uncapped; bench/RESULTS.md, whole training step, the H200 measurements)
        self.maxnreg = three_programs_register_cap(K)
        # warps per program of the per-chunk kernels: `prepare`, `_bwd_maps` and `_bwd_intra`
        self.warps_prepare = self.warps_maps = self.warps_intra = WARPS_CHUNK
        # `_bwd_maps`'s pipeline stages over its V blocks: 3 the fastest tried; 1 at larger head dims,
        # whose tiles already fill shared memory
        self.stages_maps = 3 if self.BK <= 64 else 1
        # bf16 operands (fp32 accumulation) for the products outside the state recurrence, the a-side
        # intra products and the WY inverse and backward (`dot_lowp`; emulated under the interpreter)
        self.lowp = (2 if interp else 1) if r.dtype == torch.bfloat16 else 0
        # Q', E, C (the scans' per-token operands) in bf16 for bf16 inputs; states, A and the backward's
        # W, G, Tm, M^ak, M^qb stay fp32 (bf16 there multiplies da's and db's errors on the trained head)
        self.scan_dtype = scan_dtype_of(r.dtype)
        # one TF32 pass (not 3) for bf16 inputs (`mm_tf32_if`) where its error stays in one chunk's
        # gradients: `_bwd_maps`'s reductions over V and state side, `_bwd_intra`'s column side, and the WY
        # inverse (then brought back by a Newton step); elsewhere it costs the trained head accuracy
        self.tf32 = self.lowp  # the same switch: bf16 inputs, 1 on a GPU, 2 emulated under the interpreter

    def grid(self, mode):
        """The grid of a per-regime kernel's launch: (chunks, heads), or (chunks, 1) for the exact fallback
        after the centred launch, whose programs visit a chunk's heads themselves (`fallback_heads`)."""
        return (self.NT, 1) if mode == 2 else (self.NT, self.H)
