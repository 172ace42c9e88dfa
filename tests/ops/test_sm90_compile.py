"""The Triton kernels of every op compile for an H100 (sm_90) in the regimes the host code launches.

CPU tests run kernels under the interpreter, which executes them as Python: code that the GPU
compiler rejects passes there (a load from the exact regime's None pointer failed on the
H100 only). Each case runs in a subprocess without TRITON_INTERPRET (tests/ops/sm90_compile.py).
On a CUDA machine the other tests compile the kernels for real, so this is skipped there.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.ops.sm90_compile import CASES

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests compile the kernels for real")
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernels_compile_for_sm90(case):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "tests.ops.sm90_compile", case], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{case}: kernels that do not compile for sm_90:\n{run.stdout}\n{run.stderr[-3000:]}"
