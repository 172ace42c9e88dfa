"""Test-session setup.

Kernel tests run Triton's interpreter on CPU-only machines. TRITON_INTERPRET must be set before
any module that defines a @triton.jit kernel is imported, so it is set here, at collection time.
On a CUDA machine the real compiler runs instead, tests marked `gpu` run too, and tests marked
`interpreter` (Triton kernels on CPU tensors) are skipped.
"""

import os

import pytest
import torch

from tests.triton_interpreter import speed_up_interpreter

HAS_CUDA = torch.cuda.is_available()

if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    speed_up_interpreter()


def pytest_collection_modifyitems(config, items):
    """Without CUDA, `gpu` tests skip; with CUDA (no interpreter), `interpreter` tests skip."""
    if HAS_CUDA:
        marker, skip = "interpreter", pytest.mark.skip(
            reason="runs Triton kernels on CPU tensors, which needs the interpreter (off on a CUDA machine)")
    else:
        marker, skip = "gpu", pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if marker in item.keywords:
            item.add_marker(skip)
