"""flame.train.bytecode: a bytecode cache folder where torch's install cannot keep its own."""

import os
import py_compile
import sys

import pytest

from flame.train import bytecode


@pytest.fixture
def package(tmp_path, monkeypatch):
    """An importable package `fakepkg` without bytecode, and a way to make its folder read-only
    (os.access is what Python's own bytecode writing is judged by here; root may write anywhere)."""
    folder = tmp_path / "site" / "fakepkg"
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    real_access = os.access

    def read_only():
        monkeypatch.setattr(bytecode.os, "access", lambda path, mode: False if str(path) == str(folder)
                            else real_access(path, mode))

    return folder, read_only


def test_a_read_only_install_without_bytecode_gets_the_cache_folder(package, tmp_path):
    folder, read_only = package
    assert not bytecode.needs_a_bytecode_cache("fakepkg")  # writable: Python keeps its own
    read_only()
    assert bytecode.needs_a_bytecode_cache("fakepkg")
    cache = tmp_path / "cache"
    assert bytecode.use_a_bytecode_cache(cache, "fakepkg") == cache
    assert sys.pycache_prefix == str(cache) and cache.is_dir()


def test_an_install_with_bytecode_or_a_users_choice_is_left_alone(package, tmp_path, monkeypatch):
    folder, read_only = package
    read_only()
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # PYTHONDONTWRITEBYTECODE
    assert bytecode.use_a_bytecode_cache(tmp_path / "cache", "fakepkg") is None
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "mine"))  # PYTHONPYCACHEPREFIX
    assert bytecode.use_a_bytecode_cache(tmp_path / "cache", "fakepkg") is None
    assert sys.pycache_prefix == str(tmp_path / "mine")
    monkeypatch.setattr(sys, "pycache_prefix", None)
    py_compile.compile(str(folder / "__init__.py"), cfile=bytecode.importlib.util.cache_from_source(
        str(folder / "__init__.py")))
    assert not bytecode.needs_a_bytecode_cache("fakepkg")
    assert not bytecode.needs_a_bytecode_cache("no_such_package_here")
