"""`python -m flame.export --checkpoint DIR [--step N] --out OUT [--format hf|fla|rwkv]
[--dtype bfloat16|float32] [--overwrite]`: a run's checkpoint as a Hugging Face folder, an fla
folder or an RWKV-LM .pth. Bad input is one line on stderr and exit status 1."""

from __future__ import annotations

import argparse
import sys

from flame.config import ConfigError
from flame.config.torch_types import DTYPES
from flame.data.errors import DataError
from flame.export.writer import DEFAULT_MAX_SHARD_SIZE, FORMATS, WRITTEN_DTYPES, export_checkpoint
from flame.weights import WeightsError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m flame.export",
        description="Export a flame checkpoint (any number of saving ranks, the optimizer state "
                    "is never read) to a Hugging Face folder, an fla folder or an RWKV-LM .pth.",
    )
    parser.add_argument("--checkpoint", required=True,
                        help="a run's dump folder, its checkpoint folder or one step-N folder")
    parser.add_argument("--step", type=int, default=None, help="the step to export (default: the latest complete one)")
    parser.add_argument("--out", required=True, help="output folder (hf, fla) or .pth file (rwkv)")
    parser.add_argument("--format", default="hf", choices=FORMATS,
                        help="hf: transformers with trust_remote_code; fla: fla 0.6's classes; rwkv: RWKV-LM .pth")
    parser.add_argument("--dtype", default="float32", choices=WRITTEN_DTYPES, help="dtype of the written weights")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing, non-empty output")
    parser.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE,
                        help="largest safetensors file before the weights are sharded (e.g. 5GB, 500MB)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        out = export_checkpoint(args.checkpoint, args.out, fmt=args.format, dtype=DTYPES[args.dtype],
                                step=args.step, overwrite=args.overwrite, max_shard_size=args.max_shard_size)
    except (WeightsError, ConfigError, DataError, OSError) as err:
        print(f"flame.export: error: {str(err).splitlines()[0] if str(err) else type(err).__name__}", file=sys.stderr)
        return 1
    print(f"flame.export: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
