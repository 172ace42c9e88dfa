"""flame.export: a run's checkpoint written in another format.

`python -m flame.export` writes a checkpoint as a Hugging Face folder (`hf`, flame's own model
classes behind transformers' trust_remote_code), an fla folder (`fla`, fla 0.6's names and
config) or an RWKV-LM `.pth` (`rwkv`, RWKV6 and RWKV7); `export_checkpoint` does it from Python.

The run's checkpoint and the exports are read by flame.weights (`load_model`, `read_exported`),
which this package imports; transformers and safetensors are imported only where a format needs
them.
"""

from flame.export.errors import ExportError
from flame.export.writer import export_checkpoint

__all__ = ["ExportError", "export_checkpoint"]
