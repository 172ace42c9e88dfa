"""flame.train.bytecode: a bytecode cache folder where torch's install keeps none."""

import os
import py_compile
import sys

import pytest

from flame.train import bytecode


@pytest.fixture
def package(tmp_path, monkeypatch):
    """An importable package `fakepkg` without bytecode in a writable folder; Python's own settings
    as a plain interpreter has them."""
    folder = tmp_path / "site" / "fakepkg"
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    monkeypatch.setenv("FLAME_BYTECODE_CACHE", str(tmp_path / "cache"))
    return folder


@pytest.mark.parametrize("why", ["PYTHONDONTWRITEBYTECODE", "read-only folder"])
def test_an_install_without_bytecode_gets_the_cache_folder(package, tmp_path, monkeypatch, why):
    assert not bytecode.lacks_bytecode("fakepkg")  # Python writes it beside the sources
    if why == "PYTHONDONTWRITEBYTECODE":
        monkeypatch.setattr(sys, "dont_write_bytecode", True)
    else:  # os.access is how the folder is judged (root may write anywhere)
        access = os.access
        monkeypatch.setattr(bytecode.os, "access",
                            lambda path, mode: str(path) != str(package) and access(path, mode))
    assert bytecode.lacks_bytecode("fakepkg")
    assert bytecode.use_a_bytecode_cache("fakepkg") == tmp_path / "cache"
    assert sys.pycache_prefix == str(tmp_path / "cache") and not sys.dont_write_bytecode


def test_bytecode_beside_the_sources_or_the_users_choice_is_left_alone(package, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setenv("FLAME_BYTECODE_CACHE", "none")
    assert bytecode.use_a_bytecode_cache("fakepkg") is None and sys.pycache_prefix is None
    monkeypatch.setenv("FLAME_BYTECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "mine"))  # PYTHONPYCACHEPREFIX
    assert bytecode.use_a_bytecode_cache("fakepkg") is None and sys.pycache_prefix == str(tmp_path / "mine")
    monkeypatch.setattr(sys, "pycache_prefix", None)
    source = str(package / "__init__.py")
    py_compile.compile(source, cfile=bytecode.importlib.util.cache_from_source(source))
    assert not bytecode.lacks_bytecode("fakepkg")
    assert not bytecode.lacks_bytecode("no_such_package_here")
    monkeypatch.delenv("FLAME_BYTECODE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert bytecode.bytecode_cache_folder() == tmp_path / "xdg" / "flame" / "pycache"
