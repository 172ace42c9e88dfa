"""Speed and peak memory of the LM-head loss: flame's fused linear_cross_entropy against the plain head.

    python -m bench.loss                              # N=32768 tokens, D=1024, V=32000, bf16
    python -m bench.loss --l2wrap --ignore 0.1        # with RWKV's L2Wrap term, 10% of labels ignored
    python -m bench.loss --n 16384 --impls fused,plain

What it measures, for one forward + backward of the loss of N tokens (hidden [N, D] and head weight
[V, D] in --dtype, both requiring grad, labels [N] with --ignore of them -100, scale 1 / valid count):
- plain: logits = hidden @ weight.T, F.cross_entropy(logits.float(), labels, reduction="sum") * scale
  (the loss on materialised logits, as flame.train.loss computes it; no L2Wrap);
- fused: flame.ops.linear_cross_entropy (chunks of rows, the Triton row kernel on CUDA);
- fused-torch: the same with the PyTorch row math (backend="torch"), to show what the row kernel buys.
Per implementation: the median time of forward + backward (`triton.testing.do_bench`, ms; on CPU a
median of wall-clock repeats, for a smoke run only), the peak memory above the inputs during one
forward + backward (`torch.cuda.max_memory_allocated`, GiB; CUDA only), and the loss relative to plain.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from bench.timing import require_cuda
from flame.ops.linear_cross_entropy import linear_cross_entropy

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
IMPLS = ("plain", "fused", "fused-torch")


def make_inputs(n, d, vocab, dtype, device, ignore, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen).to(device, dtype).requires_grad_()
    weight = (torch.randn(vocab, d, generator=gen) * d ** -0.5).to(device, dtype).requires_grad_()
    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[torch.rand(n, generator=gen) < ignore] = -100
    return hidden, weight, labels.to(device)


def loss_fn(impl, labels, scale, l2wrap, chunk_rows):
    if impl == "plain":
        if l2wrap:
            raise SystemExit("bench/loss.py: --l2wrap applies to the fused implementations only")
        return lambda h, w: F.cross_entropy((h @ w.t()).float(), labels, ignore_index=-100, reduction="sum") * scale
    backend = "torch" if impl == "fused-torch" else "auto"
    return lambda h, w: linear_cross_entropy(h, w, labels, scale=scale, l2wrap=l2wrap, chunk_rows=chunk_rows,
                                             backend=backend)


def forward_backward(fn, hidden, weight):
    loss = fn(hidden, weight)
    torch.autograd.grad(loss, (hidden, weight))
    return loss.detach()


def time_ms(step, device, reps):
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(step, return_mode="median")
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def peak_gib(step, device):
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**30


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--n", type=int, default=32768, help="tokens (rows of hidden)")
    parser.add_argument("--d", type=int, default=1024, help="hidden size")
    parser.add_argument("--v", type=int, default=32000, help="vocabulary size")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--ignore", type=float, default=0.0, help="fraction of labels set to -100")
    parser.add_argument("--l2wrap", action="store_true", help="fused: add the L2Wrap gradient term")
    parser.add_argument("--chunk-rows", type=int, default=None, help="fused: rows per chunk (default: its own)")
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated subset of {', '.join(IMPLS)}")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=3, help="CPU only: wall-clock repeats")
    args = parser.parse_args()

    impls = [impl for impl in args.impls.split(",") if impl]
    unknown = [impl for impl in impls if impl not in IMPLS]
    if unknown:
        parser.error(f"unknown --impls {', '.join(unknown)}; expected a subset of {', '.join(IMPLS)}")
    device = torch.device(args.device)
    if device.type == "cuda":
        require_cuda("bench.loss", "--device cpu runs a smoke run")
    hidden, weight, labels = make_inputs(args.n, args.d, args.v, DTYPES[args.dtype], device, args.ignore)
    scale = 1.0 / max(int((labels != -100).sum()), 1)
    print(f"N={args.n} D={args.d} V={args.v} {args.dtype} on {device}"
          f"{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}, "
          f"{args.ignore:.0%} ignored, l2wrap={args.l2wrap}: forward + backward")
    print(f"{'impl':<12} {'ms':>9} {'peak GiB':>9} {'loss / plain':>13}")
    reference = None
    for impl in impls:
        fn = loss_fn(impl, labels, scale, args.l2wrap, args.chunk_rows)

        def step(fn=fn):
            return forward_backward(fn, hidden, weight)

        loss = step()  # warm-up: Triton compiles here
        peak = peak_gib(step, device)
        ms = time_ms(step, device, args.reps)
        reference = loss if reference is None and impl == "plain" else reference
        ratio = f"{(loss / reference).item():.6f}" if reference is not None else "-"
        print(f"{impl:<12} {ms:9.2f} {peak:9.2f} {ratio:>13}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
