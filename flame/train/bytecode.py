"""Python bytecode for installs that cannot keep their own.

A package installed without its `.pyc` files in a read-only folder (a container image built with
`pip install --no-compile`, a read-only squashfs) has every module compiled from source again by
every process: torch's thousands of modules take several seconds of each start, restarts included.
Python can keep the bytecode of every module under one writable folder instead (`sys.pycache_prefix`,
PYTHONPYCACHEPREFIX); `use_a_bytecode_cache` turns that on where torch's install needs it, before
torch is imported. A prefix or PYTHONDONTWRITEBYTECODE set by the user is left as it is.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path


def bytecode_cache_folder() -> Path:
    """`$XDG_CACHE_HOME/flame/pycache`, else `~/.cache/flame/pycache`."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flame" / "pycache"


def needs_a_bytecode_cache(package: str = "torch") -> bool:
    """Whether `package`'s modules are compiled from source by each process: its `__init__` has no
    bytecode beside it and Python cannot write it there."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return False
    if os.path.exists(importlib.util.cache_from_source(spec.origin)):
        return False
    return not os.access(os.path.dirname(spec.origin), os.W_OK)


def use_a_bytecode_cache(folder: Path | None = None, package: str = "torch") -> Path | None:
    """Keep every module's bytecode under `folder` (default `bytecode_cache_folder()`) when
    `package`'s install cannot keep its own (`needs_a_bytecode_cache`), the user has set no prefix
    and allows bytecode to be written; returns the folder in use, or None. Call it before importing
    `package`."""
    if sys.pycache_prefix is not None or sys.dont_write_bytecode or not needs_a_bytecode_cache(package):
        return None
    folder = folder or bytecode_cache_folder()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    if not os.access(folder, os.W_OK):
        return None
    sys.pycache_prefix = str(folder)
    return folder
