"""A compiled RWKV7 model trains like the eager one, with Inductor and its AOTAutograd cache on.

The chunked RWKV7 op reaches torch.compile as the custom ops torch.ops.flame.chunk_rwkv7_fwd/_bwd, so
each block is one graph. With the op as a graph break around an autograd.Function instead, saving the
compiled backward of the region beside it to the AOTAutograd cache crashes the process (SIGSEGV in the
cache entry's pickling, on the first backward, on an H100). The run happens in a subprocess so that a
crash fails this test instead of the test session.
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
