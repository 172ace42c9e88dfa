"""flame.export: a run's weights out of and back into flame.

- `python -m flame.export` writes a checkpoint as a Hugging Face folder (`hf`, flame's own model
  classes behind transformers' trust_remote_code), an fla folder (`fla`, fla 0.6's names and
  config) or an RWKV-LM `.pth` (`rwkv`, RWKV6 and RWKV7);
- `load_model(path)` gives flame's own model from a checkpoint or from any of these exports;
- `formats.read_exported` reads an export back into flame's names (the trainer's
  `checkpoint.initial_load_path` uses it to continue pretraining from released weights).

It reads the trainer's checkpoint layout (flame.train.checkpoint); transformers and safetensors
are imported only where a format needs them.
"""

from flame.export.checkpoint_reader import (
    ExportError,
    find_step_dir,
    load_model,
    read_model_state_dict,
    read_run_checkpoint,
)

__all__ = ["ExportError", "find_step_dir", "load_model", "read_model_state_dict", "read_run_checkpoint"]
