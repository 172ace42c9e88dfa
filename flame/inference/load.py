"""What `flame.generate` and `flame.eval` share: loading a trained model with its tokenizer onto a
device, switching the ops' value checks off, and turning any failure into one line on stderr."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from flame.config.torch_types import DTYPES


class InferenceError(ValueError):
    """Bad command-line input: a missing model folder, an empty prompt, an out-of-range setting."""


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """"auto": bfloat16 on CUDA (the dtype the models train in), float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise InferenceError(f"--dtype must be auto, {' or '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def load_for_inference(model_dir: str, device: torch.device, dtype: torch.dtype):
    """(model in eval mode on `device` in `dtype`, its Tokenizer) from a trained model's folder:
    an exported Hugging Face folder, or a run's dump folder, checkpoint folder or step folder
    (read by flame.weights.load_model)."""
    if not Path(model_dir).exists():
        raise InferenceError(f"model folder {model_dir} does not exist")
    from flame.data.tokenizer import load_tokenizer
    from flame.weights import load_model

    model, _, tokenizer_path = load_model(model_dir)
    tokenizer = load_tokenizer(str(tokenizer_path or ""))
    tokenizer.check_vocab_size(model.vocab_size)
    return model.to(device=device, dtype=dtype).eval(), tokenizer


def run_command(name: str, main, argv: list[str] | None) -> int:
    """Run a CLI's `main(argv)`; any exception becomes `name: error: <its first line>` on stderr and
    exit code 1 (2 for argparse's own usage errors, which print themselves)."""
    try:
        main(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 1
    except KeyboardInterrupt:
        print(f"\n{name}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - a command-line user gets one line, not a traceback
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"{name}: error: {message}", file=sys.stderr)
        return 1
    return 0
