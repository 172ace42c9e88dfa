"""Entry point of `python -m flame.train` and of the `flame-train` console script.

Exit codes: 0 done; 1 a data, checkpoint, lock, dump-folder, file-system, collective or
non-finite-loss error (one `flame-train:` line names it and where); 2 a config error; 75 (PREEMPTED_EXIT_CODE) stopped by a stop signal after saving a
checkpoint at its last step, run again to resume; 76 (ABORTED_EXIT_CODE) a second signal aborted
that save, run again to resume from the last complete checkpoint.
"""

from __future__ import annotations

import sys

from flame.train.bytecode import use_a_bytecode_cache


def main(argv: list[str] | None = None) -> int:
    use_a_bytecode_cache()  # before torch is imported (flame.train.bytecode)
    import torch.distributed as dist

    from flame.config import ConfigError, load_config
    from flame.data import DataError
    from flame.train.parallel import CollectiveFailure
    from flame.train.preemption import PREEMPTED_EXIT_CODE, Preempted
    from flame.train.run_lock import DumpFolderError, RunLockedError
    from flame.train.trainer import NonFiniteTrainingError, Trainer
    from flame.weights import WeightsError

    try:
        cfg = load_config(sys.argv[1:] if argv is None else list(argv))
    except ConfigError as err:
        print(f"flame-train: config error: {err}", file=sys.stderr)
        return 2
    try:
        Trainer(cfg).train()
    except Preempted as stop:
        print(f"flame-train: {stop}", file=sys.stderr)
        return PREEMPTED_EXIT_CODE
    except (DataError, WeightsError, NonFiniteTrainingError, RunLockedError, DumpFolderError,
            CollectiveFailure) as err:
        print(f"flame-train: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    except OSError as err:
        if not err.filename:  # not a file's: a bug or a network error keeps its traceback
            raise
        print(f"flame-train: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
