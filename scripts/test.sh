#!/usr/bin/env bash
# Set up the environment, then run the test suite (CPU; Triton kernels run under the Triton
# interpreter). Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/ops -x`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
exec python -m pytest -q -ra "$@"
