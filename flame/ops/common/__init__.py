"""The chunk cores shared by the op families: chunk_torch (PyTorch) and chunk_triton (Triton);
docs/kernels.md#chunk-cores."""
