"""GPU time and TFLOP/s of every matrix product of a model's training step, by operand shapes.

    python -m bench.matmul_shapes                                   # rwkv7_340M, one micro-batch of 8
    python -m bench.matmul_shapes --config configs/rwkv7_1B.toml --batch 4 --top 20

One eager forward + backward of the config's model (bf16 autocast, random tokens, the config's
sequence length and model keys; no compile, no activation checkpointing) under torch.profiler with
the operands' shapes recorded, after two untimed ones. Each aten mm / addmm / bmm / baddbmm call is
one row group: calls, GPU ms per micro-batch (the kernels the call launched) and the TFLOP/s its
FLOPs reach. Compiled steps run the same cuBLAS products (Inductor keeps matmuls as extern calls),
so the table shows which products of the trained step run far below the GPU's matmul speed: the
narrow LoRA products, which read or write a [tokens, C] activation for few FLOPs, are memory-bound
(bench/RESULTS.md, "Matrix products by shape"). The ops' own Triton products (squared_relu_mlp's
epilogue kernel) are not aten products and do not appear.
"""

from __future__ import annotations

import argparse
import collections

from bench.timing import require_cuda

PRODUCTS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def product_flops(name: str, shapes: list[tuple[int, ...]]) -> int:
    """FLOPs of one product from its recorded input shapes (addmm / baddbmm: the bias comes first)."""
    a, b = (shapes[1], shapes[2]) if name in ("aten::addmm", "aten::baddbmm") else (shapes[0], shapes[1])
    if name in ("aten::bmm", "aten::baddbmm"):
        return 2 * a[0] * a[1] * a[2] * b[2]
    return 2 * a[0] * a[1] * b[1]


def product_table(events) -> dict[tuple[str, str], list[float]]:
    """{(op, shapes): [GPU us, calls, FLOPs]} over the profiler's events."""
    table: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0.0, 0, 0])
    for event in events:
        if event.name not in PRODUCTS:
            continue
        shapes = [tuple(s) for s in event.input_shapes if s]
        row = table[(event.name, str(shapes))]
        row[0] += event.device_time_total
        row[1] += 1
        row[2] += product_flops(event.name, shapes)
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/rwkv7_340M.toml")
    parser.add_argument("--batch", type=int, default=8, help="sequences per micro-batch")
    parser.add_argument("--top", type=int, default=24, help="rows to print, by GPU time")
    args = parser.parse_args()
    require_cuda("bench.matmul_shapes")

    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.generate import initialized_model
    from flame.config import load_config

    config = load_config(["--config", args.config])
    model_args, seq_len = config.model, config.training.seq_len
    model = initialized_model(model_args, torch.device("cuda"))
    ids = torch.randint(0, model_args.vocab_size, (args.batch, seq_len), device="cuda")

    def step():
        with torch.autocast("cuda", torch.bfloat16):
            loss = model(ids, labels=ids, loss_scale=1.0 / ids.numel())
        loss.backward()

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    table = product_table(prof.events())
    total_ms = sum(row[0] for row in table.values()) / 1e3
    print(f"{args.config}, batch {args.batch} x {seq_len}: matrix products {total_ms:.2f} GPU ms per micro-batch")
    print("| GPU ms | calls | TFLOP/s | op | operand shapes |\n|---|---|---|---|---|")
    for (name, shapes), (us, calls, flops) in sorted(table.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"| {us / 1e3:.3f} | {calls} | {flops / us / 1e6 if us else 0:.0f} | {name} | {shapes} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
