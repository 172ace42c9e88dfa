"""flame.weights: a model's weights on disk, and reading them back.

- `layout`: a run's folders (config.toml, `<checkpoint.folder>/step-N/`, the COMPLETE marker):
  `complete_steps`, `find_step_dir`, `check_complete`, `read_run_checkpoint`;
- `dcp_reader`: `read_model_state_dict`, the model's tensors of a DCP checkpoint saved by any
  number of ranks;
- `foreign`: exported `hf`/`fla` folders and RWKV-LM `.pth` files, `read_exported`;
- `fla_names`, `rwkv_names`: flame's parameter names <-> fla's and RWKV-LM's, both ways;
- `state_dicts`: `check_state_dict` (names and shapes against a model), `untie_if_different`;
- `load`: `load_model`, flame's model from a checkpoint or an export; `load_exported_weights`, an
  export's weights into a training run's model (sharded or not); `check_model_args`, weights
  against the model a config describes;
- `errors`: `WeightsError`, the one error of a failed read.

The writers import this package: DCP saves in flame.train.checkpoint, exports in flame.export. It
imports neither of them.
"""

from flame.weights.dcp_reader import read_model_state_dict
from flame.weights.errors import WeightsError, first_line
from flame.weights.foreign import is_foreign_weights, read_exported
from flame.weights.layout import (
    COMPLETE_MARKER,
    CONFIG_FILE,
    MODEL_KEY,
    STEP_DIR,
    RunCheckpoint,
    check_complete,
    check_readable,
    complete_steps,
    find_run_config,
    find_step_dir,
    read_run_checkpoint,
    step_dir,
)
from flame.weights.load import build_with_weights, check_model_args, load_exported_weights, load_model
from flame.weights.state_dicts import check_state_dict, untie_if_different

__all__ = [
    "COMPLETE_MARKER",
    "CONFIG_FILE",
    "MODEL_KEY",
    "STEP_DIR",
    "RunCheckpoint",
    "WeightsError",
    "build_with_weights",
    "check_complete",
    "check_model_args",
    "check_readable",
    "check_state_dict",
    "complete_steps",
    "find_run_config",
    "find_step_dir",
    "first_line",
    "is_foreign_weights",
    "load_exported_weights",
    "load_model",
    "read_exported",
    "read_model_state_dict",
    "read_run_checkpoint",
    "step_dir",
    "untie_if_different",
]
