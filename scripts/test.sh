#!/usr/bin/env bash
# Set up the environment, then run the test suite (CPU; Triton kernels run under the Triton
# interpreter) in parallel pytest workers, one per CPU core up to 8 (FLAME_TEST_WORKERS sets the
# number; 0 runs in this process). Tests marked with one xdist_group run on one worker, so that the
# module fixture they share (a run of minutes) runs once. Extra arguments go to pytest, e.g.
# `bash scripts/test.sh tests/ops -x`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
workers="${FLAME_TEST_WORKERS:-$(python -c 'import os; print(min(os.cpu_count() or 1, 8))')}"
exec python -m pytest -q -ra -n "$workers" --dist loadgroup "$@"
