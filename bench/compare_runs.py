"""Side by side: the logged training steps of two runs' metrics.jsonl (loss, grad norm, tokens/s per
device, MFU, memory). It reads files only: any machine.

    python -m bench.compare_runs [--equal] RUN_A/metrics.jsonl RUN_B/metrics.jsonl

Two runs of `python -m flame.train` that should agree, e.g. a resumed run against the uninterrupted
one, FSDP over 2 GPUs against 1 GPU with twice the gradient accumulation, or `--training.compile
true` against `false`. With --equal the exit status is 1 unless every step both runs logged has
the same loss and grad norm, bit for bit, and 1 when they share no step.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.metrics import read_metrics
from flame.run_metrics import MetricsFileError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--equal", action="store_true", help="fail unless the shared steps are bitwise equal")
    parser.add_argument("a", help="the first run's metrics.jsonl")
    parser.add_argument("b", help="the second run's metrics.jsonl")
    args = parser.parse_args(argv)
    try:
        a = {r["step"]: r for r in read_metrics(Path(args.a))}
        b = {r["step"]: r for r in read_metrics(Path(args.b))}
    except MetricsFileError as err:
        raise SystemExit(f"bench.compare_runs: {err}") from None
    common = sorted(set(a) & set(b))
    print("step  loss_a   loss_b   rel_diff  gnorm_a  gnorm_b  tok/s/dev_a tok/s/dev_b  mfu_a  mfu_b  mem_a")
    for step in common:
        x, y = a[step], b[step]
        print(f"{step:4d} {x['loss']:.5f} {y['loss']:.5f} {abs(x['loss'] - y['loss']) / abs(x['loss']):.2e} "
              f"{x['grad_norm']:8.3f} {y['grad_norm']:8.3f} {x['tokens_per_s_per_device']:11.0f} "
              f"{y['tokens_per_s_per_device']:11.0f} {x.get('mfu', 0):.3f} {y.get('mfu', 0):.3f} "
              f"{x.get('memory_gib', 0):5.1f}")
    if not args.equal:
        return 0
    differ = [s for s in common if (a[s]["loss"], a[s]["grad_norm"]) != (b[s]["loss"], b[s]["grad_norm"])]
    if not common or differ:
        print(f"NOT EQUAL: {len(common)} shared steps, differing at {differ or 'none shared'}")
        return 1
    print(f"EQUAL: {len(common)} shared steps, bitwise")
    return 0


if __name__ == "__main__":
    sys.exit(main())
