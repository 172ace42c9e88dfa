"""Test-session setup.

Kernel tests run Triton's interpreter on CPU-only machines. TRITON_INTERPRET must be set before
any module that defines a @triton.jit kernel is imported, so it is set here, at collection time.
On a CUDA machine the real compiler runs instead, and tests marked `gpu` are collected too.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
