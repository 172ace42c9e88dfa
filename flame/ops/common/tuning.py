"""Autotuning spaces of the core's kernels: the full list on a GPU, only the first config under the
Triton interpreter (where autotuning cannot work and would only multiply the run time)."""

import os


def configs(candidates: list) -> list:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return candidates[:1]
    return candidates
