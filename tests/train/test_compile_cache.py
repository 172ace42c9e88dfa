"""training.compile_cache_dir (flame.train.compile_cache): where the compiled code is cached, the
cache variables set only where the user has not set them, the log of a cold and a warm start, and
(in a subprocess) a second compile served from the folder."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

from flame.config.loader import config_from_dict
from flame.train import compile_cache
from flame.train.compile_cache import (CompileCache, cache_folder, count_entries, fingerprint, point_caches_at,
                                       source_fingerprint)
from flame.train.activation_checkpoint import recompute_elementwise
from tests.train.helpers import tiny_config

VARIABLES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


@pytest.fixture
def clean_environment(monkeypatch):
    """Neither cache variable set, nothing set by flame before; both restored afterwards."""
    for variable in VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(compile_cache, "_set_by_flame", {})


@pytest.fixture
def info_log(flame_log):
    """The "flame.train" messages at INFO and above."""
    flame = logging.getLogger("flame")
    level = flame.level
    flame.setLevel(logging.INFO)
    yield flame_log
    flame.setLevel(level)


def test_the_default_folder_is_in_the_dump_folder_with_a_subfolder_per_flame_source(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert config_from_dict({}).training.compile_cache_dir == ""
    assert config_from_dict({"training": {"compile_cache_dir": "none"}}).training.compile_cache_dir == "none"
    version = f"flame-{source_fingerprint()}"
    assert cache_folder("", "outputs/run") == tmp_path / "outputs" / "run" / "compile_cache" / version
    assert cache_folder("shared/cache", "outputs/run") == tmp_path / "shared" / "cache" / version
    assert cache_folder("/abs/cache", "outputs/run") == Path("/abs/cache") / version
    assert cache_folder("none", "outputs/run") is None


def test_the_fingerprint_follows_the_python_source(tmp_path):
    (tmp_path / "ops").mkdir()
    (tmp_path / "ops" / "kernel.py").write_text("def backward(): return 1\n")
    (tmp_path / "notes.md").write_text("notes")
    first = fingerprint(tmp_path)
    (tmp_path / "notes.md").write_text("other notes")
    assert fingerprint(tmp_path) == first
    (tmp_path / "ops" / "kernel.py").write_text("def backward(): return 2\n")
    changed = fingerprint(tmp_path)
    assert changed != first
    (tmp_path / "ops" / "kernel.py").rename(tmp_path / "ops" / "other.py")
    assert fingerprint(tmp_path) != changed


def test_the_variables_point_at_the_folder_only_where_the_user_has_not_set_them(tmp_path, monkeypatch,
                                                                                clean_environment):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    first, second, user = tmp_path / "first", tmp_path / "second", str(tmp_path / "user")
    assert point_caches_at(first) == {}
    assert [os.environ[v] for v in VARIABLES] == [str(first / "inductor"), str(first / "triton")]
    assert (first / "inductor").is_dir() and (first / "triton").is_dir()
    # flame's own values move with the next run's folder
    assert point_caches_at(second) == {}
    assert [os.environ[v] for v in VARIABLES] == [str(second / "inductor"), str(second / "triton")]
    # the user's value stays; the other variable still points at the folder
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", user)
    assert point_caches_at(first) == {"TORCHINDUCTOR_CACHE_DIR": user}
    assert [os.environ[v] for v in VARIABLES] == [user, str(first / "triton")]
    # "none" removes flame's values and keeps the user's
    assert point_caches_at(None) == {"TORCHINDUCTOR_CACHE_DIR": user}
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == user and "TRITON_CACHE_DIR" not in os.environ
    # the values torch sets itself (its default folder, Triton's inside Inductor's) are not the user's
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    monkeypatch.setenv("TRITON_CACHE_DIR", os.path.join(default_cache_dir(), "triton", "0"))
    assert point_caches_at(first) == {}
    assert [os.environ[v] for v in VARIABLES] == [str(first / "inductor"), str(first / "triton")]


def test_the_log_says_cold_then_warm_and_times_the_first_step_once(tmp_path, info_log, clean_environment):
    training = tiny_config(tmp_path, training={"compile": True, "compile_cache_dir": ""}).training
    cache = CompileCache.setup(training, str(tmp_path))
    folder = tmp_path.resolve() / "compile_cache" / f"flame-{source_fingerprint()}"
    assert info_log == [f"compile cache: {folder}, 0 entries found (cold)"]
    for entry in ("inductor/fxgraph/ab/graph", "inductor/aotautograd/cd/graph", "triton/ef/kernel.cubin"):
        (folder / entry).parent.mkdir(parents=True, exist_ok=True)
        (folder / entry).write_bytes(b"compiled")
    assert (cache.state, count_entries([folder])) == ("cold", 3)
    info_log.clear()

    cache = CompileCache.setup(training, str(tmp_path))  # the restart
    assert info_log == [f"compile cache: {folder}, 3 entries found (warm)"]
    cache.first_step_done(1, 12.34)
    cache.first_step_done(2, 0.5)
    assert len(info_log) == 2
    assert info_log[1].startswith("compile cache: the first step (step 1) took 12.3s, compile included, ")
    assert info_log[1].endswith("s after the process started (warm cache)")


def test_nothing_is_set_or_logged_without_compile_and_none_turns_the_cache_off(tmp_path, info_log,
                                                                               clean_environment):
    eager = tiny_config(tmp_path, training={"compile": False}).training
    cache = CompileCache.setup(eager, str(tmp_path))
    cache.first_step_done(1, 1.0)
    assert (cache.enabled, info_log, [v for v in VARIABLES if v in os.environ]) == (False, [], [])
    assert not (tmp_path / "compile_cache").exists()

    CompileCache.setup(tiny_config(tmp_path, training={"compile": True}).training, str(tmp_path))
    info_log.clear()
    off = CompileCache.setup(tiny_config(tmp_path, training={"compile": True, "compile_cache_dir": "none"}).training,
                             str(tmp_path))
    off.first_step_done(1, 20.0)
    assert [v for v in VARIABLES if v in os.environ] == []  # the previous run's values are gone
    assert info_log[0] == ('compile cache: off (training.compile_cache_dir = "none"): Inductor and Triton '
                           'cache on this node, in their default folders')
    assert info_log[1].endswith("(compile cache off)")


def test_a_folder_that_cannot_be_made_is_an_error_naming_the_setting(tmp_path, clean_environment):
    (tmp_path / "taken").write_text("a file where the folder would be")
    training = tiny_config(tmp_path, training={"compile": True, "compile_cache_dir": str(tmp_path / "taken")}).training
    with pytest.raises(OSError, match="training.compile_cache_dir: cannot create the compile cache folder") as err:
        CompileCache.setup(training, str(tmp_path))
    assert err.value.filename.startswith(str(tmp_path / "taken"))


def test_the_elementwise_policy_carries_the_cache_hash_that_torch_asks_for():
    wrapped = recompute_elementwise(nn.Linear(2, 2))
    assert wrapped.checkpoint_fn.keywords["context_fn"].cache_hash == source_fingerprint()


PROBE = """
import json, sys
from pathlib import Path
import torch
from torch._dynamo.utils import counters
from flame.train.compile_cache import point_caches_at
point_caches_at(Path(sys.argv[1]))
compiled = []
for _ in range(2):  # the second compile starts afresh, as a restart does, and finds the first's code
    torch._dynamo.reset()
    torch.compile(lambda x: (x.sin() * 2 + 1).sum())(torch.randn(8))
    compiled.append(dict(counters["inductor"]))
    counters.clear()
print(json.dumps(compiled))
"""


@pytest.mark.slow
def test_a_second_compile_loads_the_code_from_the_folder(tmp_path):
    """In a fresh process (no cache variable, no compiled code): the first compile writes into the
    folder, and a second compile of the same function is served from it."""
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    done = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path)], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parents[2], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = json.loads(done.stdout.strip().splitlines()[-1])
    assert first.get("fxgraph_cache_miss") == 1 and not first.get("fxgraph_cache_hit"), first
    assert second.get("fxgraph_cache_hit") == 1 and not second.get("fxgraph_cache_miss"), second
    assert count_entries([tmp_path / "inductor"]) > 0


RESTART = """
import json, sys
from torch._dynamo.utils import counters
from flame.train.trainer import Trainer
from tests.train.helpers import tiny_config
dump, sections = sys.argv[1], json.loads(sys.argv[2])
Trainer(tiny_config(dump, **sections)).train()
print(json.dumps({name: dict(counters[name]) for name in ("aot_autograd", "inductor")}))
"""


def train_twice(tmp_path, model: dict, training: dict) -> list[tuple[str, dict]]:
    """Two fresh processes that train the same compiled model, each from step 0 in a dump folder of
    its own, with one compile cache folder: each one's log and torch's compile counters."""
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    sections = {"model": model, "training": {"compile": True, "activation_checkpoint": "elementwise",
                                              "steps": 2, "compile_cache_dir": str(tmp_path / "cache"), **training}}
    runs = []
    for name in ("first", "restart"):
        done = subprocess.run([sys.executable, "-c", RESTART, str(tmp_path / name), json.dumps(sections)],
                              capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[2],
                              timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append((done.stdout, json.loads(done.stdout.strip().splitlines()[-1])))
    return runs


@pytest.mark.gpu
def test_a_restart_loads_every_compiled_graph_from_the_cache_on_the_gpu(tmp_path):
    """The shipped path (compiled blocks of flame's Triton kernels under the "elementwise"
    checkpointing policy, replayed as CUDA graphs, bf16): the restart compiles no graph; torch's
    AOTAutograd cache serves every one (none missed, none bypassed)."""
    (first_log, first), (restart_log, restart) = train_twice(
        tmp_path, model={"family": "rwkv7", "head_dim": 64, "hidden_size": 256, "num_layers": 4, "backend": "auto"},
        training={"device": "cuda", "batch_size": 1, "seq_len": 256, "gradient_accumulation_steps": 2})
    assert "0 entries found (cold)" in first_log and first["aot_autograd"].get("autograd_cache_saved"), first
    assert "entries found (warm)" in restart_log and "the first step (step 1) took" in restart_log
    hits, aot = restart["aot_autograd"].get("autograd_cache_hit", 0), restart["aot_autograd"]
    assert hits > 0 and hits == aot.get("total"), restart
    assert not aot.get("autograd_cache_miss") and not aot.get("autograd_cache_bypass"), restart
    assert not restart["inductor"].get("fxgraph_cache_miss"), restart
