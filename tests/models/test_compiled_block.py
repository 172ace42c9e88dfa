"""Compiled blocks train like eager ones, each block one graph.

The chunked ops reach torch.compile as custom ops (torch.ops.flame.chunk_<family>_fwd/_bwd), so each
block is one graph. With the op behind a graph break instead, saving the compiled backward of the region
beside it to the AOTAutograd cache crashed the process (SIGSEGV in the cache entry's pickling, on the
first backward, on an H100): the RWKV7 test runs Inductor with that cache on. The runs happen in
subprocesses so that a crash fails a test instead of the test session.
"""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import torch._functorch.config as fconfig
    fconfig.enable_autograd_cache = True
    from flame import ops
    from tests.models.helpers import build_seeded, tiny_args
    ops.set_value_checks(False)
    args = tiny_args("rwkv7", hidden_size=32, head_dim=16, num_layers=2, backend="triton")
    ids = torch.randint(0, 97, (1, 33), generator=torch.Generator().manual_seed(0))
    grads = []
    for compiled in (False, True):
        model = build_seeded(args)
        if compiled:
            for block in model.layers:
                block.compile(fullgraph=True)
        logits = model(ids[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[0, 1:]).backward()
        grads.append([p.grad for p in model.parameters()])
    for eager, comp in zip(*grads):
        torch.testing.assert_close(comp, eager, rtol=1e-4, atol=1e-6)
    print("ok")
""")


def test_compiled_rwkv7_model_with_autograd_cache_trains_like_eager():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (
        f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def test_rwkv6_and_gsa_blocks_compile_into_one_graph_and_train_like_eager():
    """fullgraph=True: no graph break anywhere in an RWKV6 or GSA block (their chunk ops are custom ops
    too); aot_eager keeps it fast while still running the traced forward and backward graphs."""
    script = textwrap.dedent("""
        import os
        os.environ["TRITON_INTERPRET"] = "1"
        import torch
        from flame import ops
        from tests.models.helpers import build_seeded, tiny_args
        ops.set_value_checks(False)
        for family in ("rwkv6", "gsa"):
            args = tiny_args(family, hidden_size=32, num_layers=1, backend="triton")
            ids = torch.randint(0, 97, (1, 33), generator=torch.Generator().manual_seed(0))
            grads = []
            for compiled in (False, True):
                model = build_seeded(args)
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
