#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install flame into it, editable, with
# its dev extra. Sourced by scripts/train.sh and scripts/test.sh; safe to run on its own.
#
#   FLAME_VENV         where the environment lives (default: .venv in the repository)
#   FLAME_CONSTRAINTS  pins file (default: requirements/cpu.txt, the CPU build of torch);
#                      on a CUDA machine set it to "" to keep the torch you have
#   PYTHON             the interpreter that creates the environment (default: python3, >= 3.11)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
venv="${FLAME_VENV:-$repo/.venv}"
constraints="${FLAME_CONSTRAINTS-requirements/cpu.txt}"

if [ ! -x "$venv/bin/python" ]; then
  "${PYTHON:-python3}" -c 'import sys; assert sys.version_info >= (3, 11), "flame needs Python >= 3.11, found " + sys.version.split()[0]'
  "${PYTHON:-python3}" -m venv "$venv"
fi
# shellcheck disable=SC1091
source "$venv/bin/activate"

# Reinstall only when the dependency files change.
stamp="$venv/.flame-install-stamp"
want="$(cat pyproject.toml ${constraints:+"$constraints"} | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing flame and its dependencies into $venv" >&2
  if [ -n "$constraints" ]; then
    python -m pip install -q -r "$constraints" -c "$constraints" -e ".[dev]"
  else
    python -m pip install -q -e ".[dev]"
  fi
  echo "$want" > "$stamp"
fi
