"""bench.registers: ptxas's report read per kernel, and one of RWKV7's per-chunk kernels compiled for
sm_90 on this machine (no GPU), in a process without the interpreter that tests/conftest.py sets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.registers import parse_ptxas_log

ROOT = Path(__file__).resolve().parents[2]

LOG = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_other_kernel' for 'sm_90a'
ptxas info    : Function properties for _other_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 0 barriers
ptxas info    : Compiling entry function '_bwd_intra_kernel' for 'sm_90a'
ptxas info    : Function properties for _bwd_intra_kernel
    48 bytes stack frame, 44 bytes spill stores, 52 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 48 bytes cumulative stack size
"""


def test_the_report_of_the_named_kernel_is_read():
    assert parse_ptxas_log(LOG, "_bwd_intra_kernel") == (255, 44, 52, 48)
    assert parse_ptxas_log(LOG, "_other_kernel") == (40, 0, 0, 0)
    with pytest.raises(ValueError, match="no register or spill line"):
        parse_ptxas_log("ptxas info    : Compiling entry function '_k' for 'sm_90a'\n", "_k")


def _ptxas_in_wheel() -> bool:
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        return os.path.exists(get_ptxas(90).path)
    except Exception:
        return False


@pytest.mark.skipif(not _ptxas_in_wheel(), reason="Triton's wheel has no ptxas for sm_90 here")
def test_a_kernel_compiles_for_the_h100_without_a_gpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "regs.json"
    done = subprocess.run([sys.executable, "-m", "bench.registers", "--only", "rwkv7.bwd_intra", "--json", str(out)],
                          capture_output=True, cwd=ROOT, text=True, timeout=300,
                          env={**env, "CUDA_VISIBLE_DEVICES": "", "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    [report] = json.loads(out.read_text())
    assert report["kernel"] == "rwkv7.bwd_intra" and report["warps"] == 4
    assert 32 <= report["registers"] <= 255
    assert report["spill_stores"] >= 0 and report["spill_loads"] >= 0
    assert "rwkv7.bwd_intra" in done.stdout and "registers" in done.stdout


def test_the_interpreter_is_refused_in_one_line():
    done = subprocess.run([sys.executable, "-m", "bench.registers"], capture_output=True, cwd=ROOT, text=True,
                          timeout=120, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 1
    assert done.stderr.strip() == ("bench.registers compiles kernels: unset TRITON_INTERPRET "
                                   "(the interpreter compiles nothing)")
