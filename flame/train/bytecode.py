"""Python bytecode where torch's install keeps none.

A container image often sets PYTHONDONTWRITEBYTECODE=1 and installs torch without its `.pyc` files
(or keeps it in a read-only folder): every process then compiles torch's thousands of modules from
source again, several seconds of each start, restarts included. `use_a_bytecode_cache` keeps the
bytecode of every module under one cache folder instead (`sys.pycache_prefix`: nothing is written
beside the sources), before torch is imported. FLAME_BYTECODE_CACHE names that folder (default
`$XDG_CACHE_HOME/flame/pycache`, else `~/.cache/flame/pycache`); FLAME_BYTECODE_CACHE=none turns it
off. A PYTHONPYCACHEPREFIX set by the user is left as it is.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

OFF = ("none", "0", "off", "false")


def bytecode_cache_folder() -> Path | None:
    """FLAME_BYTECODE_CACHE, else `$XDG_CACHE_HOME/flame/pycache`, else `~/.cache/flame/pycache`;
    None when FLAME_BYTECODE_CACHE turns the cache off."""
    chosen = os.environ.get("FLAME_BYTECODE_CACHE", "")
    if chosen.lower() in OFF:
        return None
    if chosen:
        return Path(chosen)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flame" / "pycache"


def lacks_bytecode(package: str = "torch") -> bool:
    """Whether each process compiles `package` from source: its `__init__` has no bytecode beside
    it, and Python will not write one there (PYTHONDONTWRITEBYTECODE, or a read-only folder)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return False
    if os.path.exists(importlib.util.cache_from_source(spec.origin)):
        return False
    return sys.dont_write_bytecode or not os.access(os.path.dirname(spec.origin), os.W_OK)


def use_a_bytecode_cache(package: str = "torch") -> Path | None:
    """Keep every module's bytecode under `bytecode_cache_folder()` when `package` lacks its own
    (`lacks_bytecode`) and the user has set no PYTHONPYCACHEPREFIX; returns the folder in use, or
    None. Call it before importing `package`."""
    if sys.pycache_prefix is not None or not lacks_bytecode(package):
        return None
    folder = bytecode_cache_folder()
    if folder is None:
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    if not os.access(folder, os.W_OK):
        return None
    sys.pycache_prefix = str(folder)
    sys.dont_write_bytecode = False  # written under the folder only, never beside the sources
    return folder
