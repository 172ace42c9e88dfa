#!/usr/bin/env bash
# Set up the environment, then train the default job (configs/tiny.toml: a small RWKV7 on the
# embedded Shakespeare corpus, about a minute on a CPU). Extra arguments are config overrides,
# e.g. `bash scripts/train.sh --training.steps 50`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
exec python -m flame.train --config configs/tiny.toml "$@"
