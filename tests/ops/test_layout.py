"""The fixed-length chunk tables: their contents, and one cached set per (B, T, chunk size, device)."""

import torch

from flame.ops.common.chunk_triton.layout import chunk_layout, fixed_length_tables


def test_fixed_length_tables_contents_and_memo():
    cu, idx, offsets = fixed_length_tables(3, 10, 4, "cpu")
    assert cu.tolist() == [0, 10, 20, 30]
    assert idx.dtype == torch.int32 and idx.tolist() == [[n, i] for n in range(3) for i in range(3)]
    assert offsets.tolist() == [0, 3, 6, 9]
    again = fixed_length_tables(3, 10, 4, torch.device("cpu"))
    assert all(a is b for a, b in zip(again, (cu, idx, offsets)))
    assert fixed_length_tables(3, 11, 4, "cpu")[0] is not cu
    layout = chunk_layout(3, 10, None, 4, "cpu")
    assert layout.chunk_indices is idx and layout.num_chunks == 9 and layout.num_seqs == 3
