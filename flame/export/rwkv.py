"""Whether a flame model can be written as an RWKV-LM `.pth` (the tensors are renamed by
flame.weights.rwkv_names): the format has no config, so the model must compute with the eps that
RWKV-LM and the rwkv package hard-code."""

from __future__ import annotations

import math

from flame.export.errors import ExportError
from flame.weights.rwkv_names import OFFICIAL_EPS, RWKV_FAMILIES


def check_rwkv_format(model_args) -> None:
    """ExportError for a model of another family than RWKV6/RWKV7, or whose first eps field differs
    from RWKV-LM's."""
    if model_args.family not in RWKV_FAMILIES:
        raise ExportError(f"the RWKV-LM format holds RWKV6 and RWKV7 models only; this model is {model_args.family}")
    for key, official in OFFICIAL_EPS.items():
        value = getattr(model_args, key)
        if not math.isclose(value, official, rel_tol=1e-9):
            raise ExportError(f"the RWKV-LM .pth format cannot hold model.{key} = {value:g}: RWKV-LM and the "
                              f"rwkv package hard-code {official:g}, so the export would compute another "
                              f"function; export as hf instead")


__all__ = ["check_rwkv_format"]
