"""Compiled blocks train like eager ones, each block one graph.

The chunked ops reach torch.compile as custom ops (torch.ops.flame.chunk_<family>_fwd/_bwd), so each
block is one graph. With the op behind a graph break instead, saving the compiled backward of the region
beside it to the AOTAutograd cache crashes the process (SIGSEGV in the cache entry's pickling, on the
first backward, on an H100): the RWKV7 test runs Inductor with that cache on, in a cache folder of
its own (the node's default folder may hold graphs traced through another version of flame's custom
ops). The runs happen in subprocesses so that a crash fails a test instead of the test session. The
Triton backend runs on the GPU where there is one, under Triton's interpreter on CPU otherwise.
"""

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import os, sys
    import torch
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
        from tests.triton_interpreter import speed_up_interpreter
        speed_up_interpreter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    import torch._functorch.config as fconfig
    fconfig.enable_autograd_cache = True
    from flame import ops
    from tests.models.helpers import build_seeded, tiny_args
    ops.set_value_checks(False)
    args = tiny_args("rwkv7", hidden_size=32, head_dim=16, num_layers=2, backend="triton")
    ids = torch.randint(0, 97, (1, 33), generator=torch.Generator().manual_seed(0)).to(device)
    grads = []
    for compiled in (False, True):
        model = build_seeded(args).to(device)
        if compiled:
            for block in model.layers:
                block.compile(fullgraph=True)
        logits = model(ids[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[0, 1:]).backward()
        grads.append([p.grad for p in model.parameters()])
    for eager, comp in zip(*grads):
        torch.testing.assert_close(comp, eager, rtol=1e-3, atol=1e-5)  # Inductor fp32 reassociation
    print("ok")
""")


def test_compiled_rwkv7_model_with_autograd_cache_trains_like_eager(tmp_path):
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (
        f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def test_rwkv6_and_gsa_blocks_compile_into_one_graph_and_train_like_eager():
    """fullgraph=True: no graph break anywhere in an RWKV6 or GSA block (their chunk ops are custom ops
    too); aot_eager keeps it fast while still running the traced forward and backward graphs."""
    script = textwrap.dedent("""
        import os
        import torch
        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
            from tests.triton_interpreter import speed_up_interpreter
            speed_up_interpreter()
        device = "cuda" if torch.cuda.is_available() else "cpu"
        from flame import ops
        from tests.models.helpers import build_seeded, tiny_args
        ops.set_value_checks(False)
        for family in ("rwkv6", "gsa"):
            args = tiny_args(family, hidden_size=32, num_layers=1, backend="triton")
            ids = torch.randint(0, 97, (1, 33), generator=torch.Generator().manual_seed(0)).to(device)
            grads = []
            for compiled in (False, True):
                model = build_seeded(args).to(device)
                if compiled:
                    for block in model.layers:
                        block.compile(fullgraph=True, backend="aot_eager")
                logits = model(ids[:, :-1])
                torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[0, 1:]).backward()
                grads.append([p.grad for p in model.parameters()])
            for eager, comp in zip(*grads):
                torch.testing.assert_close(comp, eager, rtol=1e-5, atol=1e-6)
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (
        f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


@pytest.mark.parametrize("family", ["rwkv7", "rwkv6", "gsa"])
def test_deep_model_compiles_each_block_kind_once(family):
    """Every block of a 10-layer model runs compiled: the blocks share at most two graphs (layer 0's and
    the rest's). A branch on an int module attribute such as layer_id would compile one graph per
    layer, and past Dynamo's recompile limit (8) the deeper layers would silently run eager."""
    import torch
    from torch._dynamo.utils import counters

    from flame import ops
    from tests.models.helpers import build_seeded, tiny_args

    torch._dynamo.reset()
    counters.clear()
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: conftest.py set the interpreter
    model = build_seeded(tiny_args(family, hidden_size=32, num_layers=10, backend="triton")).to(device)
    for block in model.layers:
        block.compile(backend="eager", fullgraph=True)
    previous = ops.utils.checks.value_checks_enabled()
    ops.set_value_checks(False)
    try:
        model(torch.randint(0, 97, (1, 17), generator=torch.Generator().manual_seed(0)).to(device)).sum().backward()
    finally:
        ops.set_value_checks(previous)
        torch._dynamo.reset()
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    assert not any("recompile_limit" in key for key in counters["stats"]), dict(counters["stats"])
