"""Entry point of `python -m flame.train` and of the `flame-train` console script."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    from flame.config import ConfigError, load_config
    from flame.data import DataError
    from flame.train.checkpoint import CheckpointError
    from flame.train.trainer import NonFiniteTrainingError, Trainer

    try:
        cfg = load_config(sys.argv[1:] if argv is None else list(argv))
    except ConfigError as err:
        print(f"flame-train: config error: {err}", file=sys.stderr)
        return 2
    try:
        Trainer(cfg).train()
    except (DataError, CheckpointError, NonFiniteTrainingError) as err:
        print(f"flame-train: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
