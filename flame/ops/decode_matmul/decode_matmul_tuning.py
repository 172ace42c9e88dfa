"""Launch configurations of the decode_matmul kernel per shape, the fastest of a sweep on a GPU:
{(batch bucket, N, K): config}, the batch bucket the next power of two of the rows, N the
launch's output columns, K its inputs; a config as decode_matmul_triton.CONFIG_KEYS. Written by
`python -m bench.decode_matmul --sweep --emit-table FILE` (the shapes of the 340M decode steps);
shapes not listed take decode_matmul_triton.fallback_config."""

TABLE: dict[tuple[int, int, int], dict] = {}
