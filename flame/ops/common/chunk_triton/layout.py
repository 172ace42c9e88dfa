"""How a batch of sequences is cut into chunks: the index tables every chunk kernel reads.

Fixed-length input [B, T, ...] is treated as B sequences of T tokens; varlen input (B == 1 with
`cu_seqlens`) as the sequences between consecutive offsets. Each sequence is cut into its own
chunks of `chunk_size` tokens (the last one may be partial); chunks never cross a boundary.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class ChunkLayout:
    cu_seqlens: torch.Tensor     # int64 [N+1]: token offsets of the sequences (in the flattened B*T axis)
    chunk_indices: torch.Tensor  # int32 [num_chunks, 2]: (sequence, chunk within the sequence)
    chunk_offsets: torch.Tensor  # int64 [N+1]: index of each sequence's first chunk
    num_seqs: int
    num_chunks: int
    chunk_size: int


_FIXED_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
_FIXED_TABLES_MAX = 64  # distinct (B, T, chunk size, device) keys kept; a training run uses a handful


def fixed_length_tables(B: int, T: int, chunk_size: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cu_seqlens int64 [B+1], chunk_indices int32 [B*NT, 2], chunk_offsets int64 [B+1]) of a fixed-length
    [B, T] batch, memoized per (B, T, chunk_size, device): every chunk op of every layer reads the same
    few-KB tables, which the kernels only read, instead of building six tiny tensors on the device per call.

    The tables are built outside any CUDA-graph memory pool (`_outside_graph_pools`): a compiled block
    under CUDA graphs runs its first call with its allocations routed to the graph's pool, where a
    memoized tensor would be a live allocation that the graph does not own."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # one key per GPU; the builder thread selects it
        device = torch.device("cuda", torch.cuda.current_device())
    key = (B, T, chunk_size, device)
    tables = _FIXED_TABLES.get(key)
    if tables is None:
        nt = triton.cdiv(T, chunk_size)

        def build():
            cu = torch.arange(B + 1, dtype=torch.int64) * T
            ids = torch.arange(B * nt, dtype=torch.int32)
            chunk_indices = torch.stack([ids // nt, ids % nt], dim=1).contiguous()
            offsets = torch.arange(B + 1, dtype=torch.int64) * nt
            return tuple(t.to(device) for t in (cu, chunk_indices, offsets))

        tables = _outside_graph_pools(build, device)
        if len(_FIXED_TABLES) >= _FIXED_TABLES_MAX:
            _FIXED_TABLES.clear()
        _FIXED_TABLES[key] = tables
    return tables


def _outside_graph_pools(build, device: torch.device):
    """`build()`, with its CUDA allocations taken from the ordinary caching allocator even while this
    thread allocates to a CUDA-graph pool (CUDA-graph trees route allocations per thread): it runs in a
    short-lived thread of its own, which waits for its copies before returning. A first call inside a
    stream capture cannot do that, and says so."""
    if device.type != "cuda":
        return build()
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "flame's chunk ops build their fixed-length chunk tables on the first call of each shape, which "
            "cannot happen inside a CUDA-graph capture: run the op once with this shape before capturing")
    result: list = []

    def work():
        try:
            torch.cuda.set_device(device)
            tables = build()
            torch.cuda.current_stream(device).synchronize()
            result.append(tables)
        except BaseException as err:  # handed to the caller's thread
            result.append(err)

    worker = threading.Thread(target=work, name="flame-chunk-tables")
    worker.start()
    worker.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def chunk_layout(B: int, T: int, cu_seqlens: torch.Tensor | None, chunk_size: int, device) -> ChunkLayout:
    """The chunk tables of a [B, T] batch, or of the packed sequences of `cu_seqlens` (B == 1).

    Fixed length needs no host sync; varlen reads the offsets once on the host.
    """
    if cu_seqlens is None:
        cu, chunk_indices, offsets = fixed_length_tables(B, T, chunk_size, device)
        return ChunkLayout(cu, chunk_indices, offsets, B, chunk_indices.shape[0], chunk_size)
    bounds = cu_seqlens.tolist()
    lengths = [e - b for b, e in zip(bounds[:-1], bounds[1:])]
    counts = [triton.cdiv(n, chunk_size) for n in lengths]
    seq = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts, dtype=torch.int64))
    first = [0]
    for c in counts:
        first.append(first[-1] + c)
    within = torch.arange(first[-1]) - torch.tensor(first[:-1], dtype=torch.int64).repeat_interleave(
        torch.tensor(counts, dtype=torch.int64))
    chunk_indices = torch.stack([seq, within], dim=1).to(device=device, dtype=torch.int32).contiguous()
    return ChunkLayout(
        cu_seqlens.to(device=device, dtype=torch.int64).contiguous(),
        chunk_indices,
        torch.tensor(first, device=device, dtype=torch.int64),
        len(counts), first[-1], chunk_size,
    )


@triton.jit
def chunk_span(cu_seqlens, chunk_indices, i_c, BT: tl.constexpr):
    """The device side of the tables: chunk `i_c`'s first token t0 (int64, in the flattened B*T axis)
    and its number of valid rows Tc (<= BT; less only for a sequence's last chunk)."""
    i_n = tl.load(chunk_indices + 2 * i_c).to(tl.int64)
    i_t = tl.load(chunk_indices + 2 * i_c + 1).to(tl.int64)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    t0 = bos + i_t * BT
    return t0, tl.minimum(eos - t0, BT)
