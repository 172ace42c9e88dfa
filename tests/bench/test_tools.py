"""Every tool in bench/ explains itself on `python -m bench.<tool> --help` without a GPU (and so does
scripts/gpu_tests.py), a tool that measures on a GPU refuses a CPU in one line, and bench/ops.py's
launch overrides reach the kernel's launch."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()

TOOLS = sorted(p.name for p in (ROOT / "bench").glob("*.py")
               if 'if __name__ == "__main__":' in p.read_text())


def test_the_bench_folder_has_its_tools():
    assert {"ops.py", "train_step.py", "scale.py", "data.py", "compare_runs.py"} <= set(TOOLS)


@pytest.mark.parametrize("tool", [*TOOLS, "scripts/gpu_tests.py"])
def test_help_says_what_it_measures_and_where(tool):
    command = [str(ROOT / tool)] if tool.startswith("scripts/") else ["-m", f"bench.{tool.removesuffix('.py')}"]
    done = subprocess.run([sys.executable, *command, "--help"], capture_output=True, cwd=ROOT,
                          text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage:"), done.stdout[:500]
    assert any(word in done.stdout for word in ("GPU", "CPU", "any machine")), done.stdout[:1000]


def test_launch_overrides_reach_the_kernel_launch(monkeypatch):
    from bench import ops

    launched = []

    class Kernel:
        def run(self, *args, **kwargs):
            launched.append(kwargs)

    module = types.ModuleType("flame.ops._bench_fake")
    module.__path__ = []
    module._fake_kernel = Kernel()
    monkeypatch.setitem(sys.modules, "flame.ops._bench_fake", module)
    alias = types.ModuleType("flame.ops._bench_fake.user")  # a module that imports the kernel by name
    alias._fake_kernel = module._fake_kernel
    monkeypatch.setitem(sys.modules, "flame.ops._bench_fake.user", alias)
    applied = ops.override_launches(["_fake_kernel:num_warps=8,maxnreg=None,modes=(1, 2)"],
                                    package="flame.ops._bench_fake")
    assert applied == ["flame.ops._bench_fake._fake_kernel: {'num_warps': 8, 'maxnreg': None, 'modes': (1, 2)}"]
    module._fake_kernel.run(1, grid=(2,), num_warps=4, num_stages=2)
    assert launched == [{"grid": (2,), "num_warps": 8, "num_stages": 2, "maxnreg": None, "modes": (1, 2)}]
    with pytest.raises(SystemExit, match="no Triton kernel '_missing'"):
        ops.override_launches(["_missing:num_warps=8"], package="flame.ops._bench_fake")
    with pytest.raises(SystemExit, match="expected KERNEL:KEY=VALUE"):
        ops.parse_launch("_fake_kernel")


GPU_TOOLS = {  # tool: its arguments of a GPU measurement
    "train_step": [], "scale": ["--configs", "configs/tiny.toml"], "loss": ["--device", "cuda"],
    "generate": [], "ops": [], "decode_matmul": [], "decode_matmul --sweep": ["--sweep"], "dp_proofs": [],
    "launch_settings": [], "matmul_shapes": [],
}


@pytest.mark.skipif(torch_cuda_available(), reason="a CUDA GPU is visible")
def test_a_gpu_tool_on_a_cpu_is_one_line_without_a_traceback():
    done = subprocess.run([sys.executable, "-m", "bench.train_step"], capture_output=True, cwd=ROOT,
                          text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 1
    assert done.stderr.strip() == "bench.train_step measures on a CUDA GPU and none is visible"


@pytest.mark.skipif(torch_cuda_available(), reason="a CUDA GPU is visible")
@pytest.mark.parametrize("tool", sorted(GPU_TOOLS))
def test_every_gpu_tool_refuses_a_cpu(tool, monkeypatch):
    """Each tool that measures on a GPU exits with one line before any work (SystemExit(str):
    Python prints the line, exit status 1)."""
    import importlib

    module = importlib.import_module(f"bench.{tool.split()[0]}")
    monkeypatch.setattr(sys, "argv", [tool, *GPU_TOOLS[tool]])
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as stopped:
        module.main()
    message = stopped.value.code
    assert isinstance(message, str) and "\n" not in message, message
    assert message.startswith(f"bench.{tool} measures on a CUDA GPU and none is visible"), message


def test_ops_names_its_libraries_before_looking_for_a_gpu():
    from bench import ops

    with pytest.raises(SystemExit, match="flame, fla, rwkvlm, rwkvlm_h100, inductor, not 'flame,nope'"):
        ops.main(["--libs", "flame,nope"])


def test_ops_leaves_out_a_library_it_cannot_load_and_says_why_once(tmp_path, monkeypatch, capsys):
    """RWKV-LM's kernels without its checkout: each of the two libraries is named once, with the
    folder looked in, and the op keeps flame's callable."""
    from bench import ops

    monkeypatch.setenv("FLAME_RWKVLM_DIR", str(tmp_path))
    op = ops.REGISTRY["chunk_rwkv7_logit"]
    unavailable: dict[str, str] = {}
    for _ in range(2):
        fns = ops.load_callables(op, {"flame", "rwkvlm", "rwkvlm_h100"}, unavailable)
        assert [lib for lib, _ in fns] == ["flame"]
    assert set(unavailable) == {"rwkvlm", "rwkvlm_h100"}
    assert all(str(tmp_path) in why for why in unavailable.values()), unavailable
    assert capsys.readouterr().out.count("not available") == 2


def test_ops_channel_mix_entry_runs_flames_op_and_its_composition():
    """bench.ops' squared_relu_mlp entry on a small shape on CPU: flame's callable (the Triton
    kernels under the interpreter) and the composed peer give the same output."""
    from bench import ops

    op = ops.REGISTRY["squared_relu_mlp"]
    inputs = op.make_inputs(torch.float32, "cpu", M=40, C=32, F=64)
    composed = dict(ops.load_callables(op, {"inductor"}, {}))["inductor"]
    torch.testing.assert_close(op.flame(inputs), composed(inputs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["layer_norm", "rms_norm"])
def test_ops_norm_entries_run_the_blocks_form(name):
    """bench.ops' norm entries on a small shape on CPU (the Triton kernels under the interpreter):
    s + norm(s) with s = x + residual, as PyTorch's form computes it."""
    from bench import ops
    from flame.ops.norm import norm_torch

    inputs = ops.REGISTRY[name].make_inputs(torch.float32, "cpu", M=20, C=48)
    s = inputs["x"] + inputs["residual"]
    rms = name == "rms_norm"
    expected = s + norm_torch(s, inputs["weight"], inputs.get("bias"), 1e-5, rms)
    assert ("bias" in inputs) == (not rms)  # every input is a leaf the backward reaches
    torch.testing.assert_close(ops.REGISTRY[name].flame(inputs), expected, rtol=1e-5, atol=1e-5)


def test_ops_prints_a_line_per_library_with_flames_time_over_its():
    from bench import ops

    lines = ops._lines("chunk_rwkv7_logit", "B8", {"flame": (1.0, 4.0), "rwkvlm_h100": (2.0, 3.2)})
    assert lines[0].split()[2:] == ["flame", "1.000", "4.000", "-", "-"]
    assert lines[1].split()[2:] == ["rwkvlm_h100", "2.000", "3.200", "0.50", "1.25"]


def test_rwkvlm_kernels_name_what_breaks_their_contract():
    import torch

    from bench.rwkvlm_kernels import check_inputs

    x = torch.zeros(1, 32, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous bf16 CUDA tensors of r's shape .* r is torch.bfloat16"):
        check_inputs(x, x, x, x, x, x)


def test_train_steps_overrides_replace_its_own_settings_and_config_picks_the_file():
    from bench.train_step import trainer_args

    args = trainer_args("rwkv7", "340M", 5, "/tmp/dump", ["--model.vocab_size", "65536"],
                        config="configs/rwkv7_rwkvlm_demo.toml")
    assert args[:2] == ["--config", "configs/rwkv7_rwkvlm_demo.toml"]
    assert args.count("--model.vocab_size") == 1 and args[args.index("--model.vocab_size") + 1] == "65536"
    shipped = trainer_args("gsa", "1B", 5, "/tmp/dump", [])
    assert shipped[1].endswith("configs/gsa_1B.toml") and "32000" in shipped
    # the compile cache is shared by the runs on a node, not "none" (torch's one node cache, where
    # graphs of another version of flame's custom ops would load)
    assert shipped[shipped.index("--training.compile_cache_dir") + 1].endswith("flame-bench-compile-cache")


def test_rwkvlm_train_refuses_to_profile_every_step(tmp_path):
    from bench.rwkvlm import train

    with pytest.raises(SystemExit, match="--profile-steps 5 must be below --steps 5"):
        train(None, "unused.pth", tmp_path, 5, kernel="@rwkv3", jit=True, profile_steps=5)


@pytest.mark.parametrize("op", ["chunk_rwkv6", "chunk_gsa", "chunk_rwkv7_cached", "squared_relu_mlp", "layer_norm",
                                "rms_norm"])
def test_launch_settings_vary_settings_the_kernels_read(op):
    """Every variant replaces a module attribute that exists and holds a value of the kind it
    sets (a constant of the same type, or the function the op calls), so that a renamed constant
    fails here rather than sweeping nothing."""
    from bench import launch_settings
    from bench.ops import REGISTRY

    assert op in REGISTRY and set(launch_settings.SHAPES) == {"chunk_rwkv6", "chunk_gsa", "chunk_rwkv7_cached",
                                                              "squared_relu_mlp", "layer_norm", "rms_norm"}
    found = launch_settings.variants(op)
    assert len(found) >= {"squared_relu_mlp": 7, "layer_norm": 6, "rms_norm": 6}.get(op, 13)
    for label, settings in found.items():
        for module, name, value in (settings if isinstance(settings, list) else [settings]):
            shipped = getattr(module, name)
            assert callable(value) if callable(shipped) else type(value) is type(shipped) and value != shipped, label


def test_launch_settings_set_rwkv7_plan_attributes_the_plan_has():
    """An RWKV7 plan variant sets an attribute that ChunkPlan itself sets (a renamed one fails)."""
    import torch

    from bench import launch_settings
    from flame.ops.rwkv7.chunk_plan import ChunkPlan

    def settings(plan):
        return {k: v for k, v in vars(plan).items() if not isinstance(v, torch.Tensor)}

    r = v = torch.zeros(8, 64, 16, 64)  # the 340M layer's heads: scan V blocks of 32
    shipped = settings(ChunkPlan(r, v, None, -0.6))
    for label, (cls, _, init) in launch_settings.variants("chunk_rwkv7_cached").items():
        name = label.split()[0].removeprefix("plan.")
        if cls is ChunkPlan:
            plan = ChunkPlan.__new__(ChunkPlan)
            init(plan, r, v, None, -0.6)
            changed = {k for k in shipped if settings(plan)[k] != shipped[k]}
            assert set(settings(plan)) == set(shipped) and changed == ({name, "NV"} if name == "BV" else {name}), \
                (label, changed)


def test_matmul_shapes_counts_flops_and_groups_calls_by_shapes():
    """bench.matmul_shapes: FLOPs from the recorded shapes (addmm's bias first, bmm's batch) and one
    row per (op, shapes) with its calls and GPU time summed; other ops ignored."""
    from types import SimpleNamespace

    from bench.matmul_shapes import product_flops, product_table

    assert product_flops("aten::mm", [(4, 3), (3, 5)]) == 2 * 4 * 3 * 5
    assert product_flops("aten::addmm", [(5,), (4, 3), (3, 5)]) == 2 * 4 * 3 * 5
    assert product_flops("aten::bmm", [(2, 4, 3), (2, 3, 5)]) == 2 * 2 * 4 * 3 * 5
    event = lambda name, shapes, us: SimpleNamespace(name=name, input_shapes=shapes, device_time_total=us)  # noqa: E731
    table = product_table([event("aten::mm", [[4, 3], [3, 5]], 2.0), event("aten::mm", [[4, 3], [3, 5]], 3.0),
                           event("aten::mm", [[4, 3], [3, 6]], 1.0), event("aten::add", [[4], [4]], 9.0)])
    assert table == {("aten::mm", "[(4, 3), (3, 5)]"): [5.0, 2, 240], ("aten::mm", "[(4, 3), (3, 6)]"): [1.0, 1, 144]}


def test_train_step_baseline_must_be_another_flame_tree(tmp_path):
    from bench.train_step import REPO, baseline_tree

    with pytest.raises(SystemExit, match=r"not a flame tree \(flame/__init__.py, bench/train_step.py, configs missing\)"):
        baseline_tree(str(tmp_path))
    with pytest.raises(SystemExit, match="is this tree itself"):
        baseline_tree(str(REPO))
    for part in ("flame", "bench", "configs"):
        (tmp_path / part).mkdir()
    (tmp_path / "flame" / "__init__.py").touch()
    (tmp_path / "bench" / "train_step.py").touch()
    assert baseline_tree(str(tmp_path)) == tmp_path.resolve()


def test_train_step_baseline_imports_its_own_tree(tmp_path, monkeypatch):
    """The baseline's child finds flame and bench in its tree first, never in this one, and keeps
    the other entries of PYTHONPATH (the GPU machine's wheels)."""
    from bench.train_step import REPO, tree_env

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/tmp/site", str(REPO), str(REPO / ".")]))
    assert tree_env(tmp_path)["PYTHONPATH"].split(os.pathsep) == [str(tmp_path), "/tmp/site"]


def test_train_step_runs_the_baseline_after_each_family_s_flame_run(tmp_path, monkeypatch):
    """With --baseline, each family's flame run is followed by the baseline's: the same command in
    the baseline's folder, with its own compile cache, its row labelled flame@<folder>."""
    import json

    from bench import train_step
    from bench.timing import KINDS

    for part in ("flame", "bench", "configs"):
        (tmp_path / "base" / part).mkdir(parents=True)
    (tmp_path / "base" / "flame" / "__init__.py").touch()
    (tmp_path / "base" / "bench" / "train_step.py").touch()
    calls = []

    def fake_run(cmd, timeout, cwd, env):
        family, lib, out = cmd[cmd.index("--child") + 1].split(":", 2)
        calls.append((family, cwd, cmd[cmd.index("--") + 1:], cmd[cmd.index("--trace") + 1]))
        Path(out).write_text(json.dumps({
            "family": family, "size": "340M", "lib": lib, "compile": True, "tokens_per_s": 1e5, "peak_gib": 1.0,
            "peak_reserved_gib": 1.0, "first_step_s": 1.0, "gpu_ms_per_step": dict.fromkeys(KINDS, 1.0),
            "gpu_busy_ms_per_step": 1.0, "host_bound_ms_per_step": 0.0}))
        return types.SimpleNamespace(returncode=0)

    monkeypatch.setattr(train_step, "require_cuda", lambda name: None)
    monkeypatch.setattr(train_step.subprocess, "run", fake_run)
    out = tmp_path / "results.json"
    monkeypatch.setattr(sys, "argv", ["train_step", "--families", "rwkv7,gsa", "--libs", "flame", "--baseline",
                                      str(tmp_path / "base"), "--out", str(out), "--trace", str(tmp_path / "t")])
    assert train_step.main() == 0
    base = (tmp_path / "base").resolve()
    assert [(family, cwd) for family, cwd, _, _ in calls] == [("rwkv7", None), ("rwkv7", base), ("gsa", None),
                                                             ("gsa", base)]
    assert calls[0][2] == [] and calls[1][2] == ["--training.compile_cache_dir",
                                                 f"{train_step.NODE_COMPILE_CACHE}-base"]
    # the baseline's trace goes to a folder of its own: the child names its file <family>_flame.json
    traces = (tmp_path / "t").resolve()
    assert [trace for _, _, _, trace in calls[:2]] == [str(traces), str(traces / "base")]
    assert [r["lib"] for r in json.loads(out.read_text())] == ["flame", "flame@base"] * 2
