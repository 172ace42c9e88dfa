"""Where the chunked RWKV7 kernels' time goes under launch-option and plan variants (GPU diagnostic).

    python bench/rwkv7_sweep.py ref                 fp64 reference of the trained head (REF, below)
    python bench/rwkv7_sweep.py warm SPEC           compile the variant only (run several in parallel)
    python bench/rwkv7_sweep.py run SPEC            time it (do_bench, B8 T2048 H16 D64 bf16, default and
                                                    cached), profile its kernels, and its trained-head errors

SPEC is "base" or groups "TARGET:KEY=VALUE,..." joined by ";". TARGET is a kernel (prep, maps, intra,
sf, sb: `_prepare_kernel`, `_bwd_maps`, `_bwd_intra`, `_scan_fwd`, `_scan_bwd`)
whose launch keywords are overridden (num_warps, num_stages, maxnreg), "plan" for attributes of
`_Plan` (prec, tf32, modes, BV, BV_bwd), or "mod" with path=FILE: another version of chunk_triton.py
(e.g. an older commit's, to time both in one run; it imports its neighbours in flame/ops/rwkv7 as the
package file does). Values are Python literals; bare words are strings.
Examples: "maps:num_warps=8,maxnreg=None", "plan:prec='tf32x3'", "sf:num_warps=8;sb:num_warps=8",
"mod:path=/tmp/chunk_triton_old.py".
The sessions' calls ran the warm-ups in parallel, then `run` one variant after another (bench/RESULTS.md).
"""

import ast
import os
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
import ops  # noqa: E402  (bench/ops.py: the inputs and the timing of the op table)
from tests.ops.assertions import rel_rms_error  # noqa: E402
from tests.ops.inputs import forward_backward  # noqa: E402  (seeded dO, gradients of every leaf)
from flame.ops.rwkv7 import chunk_triton as ct  # noqa: E402

TRAINED_HEAD = ROOT / "tests/ops/data/rwkv7_340M_layer1_head3_bf16.pt"
REF = Path(os.environ.get("RWKV7_SWEEP_REF", "/tmp/rwkv7_trained_head_ref_s7.pt"))
KERNELS = dict(prep="_prepare_kernel", maps="_bwd_maps_kernel", intra="_bwd_intra_kernel",
               sf="_scan_fwd_kernel", sb="_scan_bwd_kernel")


def _literal(text):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse(spec):
    """{target: {key: value}} from a SPEC string."""
    if spec == "base":
        return {}
    out = {}
    for group in filter(None, spec.split(";")):
        target, _, pairs = group.partition(":")
        if target not in ("plan", "mod") and target not in KERNELS:
            raise SystemExit(f"unknown target {target!r} in {spec!r}; use plan, mod or one of {sorted(KERNELS)}")
        items = re.split(r",(?=\s*\w+=)", pairs)  # commas inside a value, e.g. modes=(1,), stay
        out[target] = {k.strip(): _literal(v) for k, v in (item.split("=", 1) for item in items if item)}
    return out


def load_variant(path):
    """A copy of chunk_triton.py at `path`, loaded as a module of the flame.ops.rwkv7 package."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("flame.ops.rwkv7._sweep_variant", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def apply(spec):
    """Patch _Plan and the kernels' launches for this process (and swap in another kernels file)."""
    global ct
    cfg = parse(spec)
    if "mod" in cfg:
        ct = load_variant(cfg.pop("mod")["path"])
    plan_over = cfg.pop("plan", {})
    init = ct._Plan.__init__

    def patched_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        for key, value in plan_over.items():
            setattr(self, key, value)
        self.NV = -(-self.V // self.BV)
    ct._Plan.__init__ = patched_init
    for short, over in cfg.items():
        kernel = getattr(ct, KERNELS[short])
        run = kernel.run

        def patched_run(*args, _run=run, _over=over, **kwargs):
            kwargs.update(_over)
            return _run(*args, **kwargs)
        kernel.run = patched_run


def trained_head(device):
    """The trained head's inputs as gradient leaves (tests/ops/test_rwkv7_bf16_trained_head.py)."""
    data = torch.load(TRAINED_HEAD, map_location=device)
    return {n: data[n].detach().clone().requires_grad_() for n in "rwkvab"}


def chunk(cache):
    return lambda d: ct.chunk_rwkv7_triton(d["r"], d["w"], d["k"], d["v"], d["a"], d["b"], scale=1.0,
                                           gate_lower_bound=ops.RWKV7_LOG_DECAY_BOUND, cache_intermediates=cache)[0]


def chunk_op(r, w, k, v, a, b, output_final_state, cache=False):
    """The variant's chunk op in the (**inputs, output_final_state) form of tests.ops.inputs.forward_backward."""
    return ct.chunk_rwkv7_triton(r, w, k, v, a, b, scale=1.0, output_final_state=output_final_state,
                                 gate_lower_bound=ops.RWKV7_LOG_DECAY_BOUND, cache_intermediates=cache)


def make_ref():
    from flame.ops import naive_rwkv7
    x = {n: t.detach().double().requires_grad_() for n, t in trained_head("cuda").items()}
    o, _, g = forward_backward(naive_rwkv7, x, with_dht=False, scale=1.0)
    torch.save({"o": o.detach(), **{"d" + n: t for n, t in g.items()}}, REF)
    print(f"reference saved to {REF}")


def trained_head_errors(ref, device):
    """Relative RMS errors of the variant's output and gradients on the trained head against `ref`."""
    o, _, g = forward_backward(chunk_op, trained_head(device), with_dht=False)
    return {"o": rel_rms_error(ref["o"], o), **{"d" + n: rel_rms_error(ref["d" + n], t) for n, t in g.items()}}


def kernel_profile(fn, x, n=5):
    """GPU ms per forward+backward by kernel (profiler; grads accumulate into .grad, as in training)."""
    per_kernel = defaultdict(float)
    for e in ops._profiled(fn, x, n).key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if t and "Memset" not in e.key and "memcpy" not in e.key.lower():
            per_kernel[e.key[:40]] += t / n / 1000.0
    return sum(per_kernel.values()), sorted(per_kernel.items(), key=lambda kv: -kv[1])


def main():
    if len(sys.argv) < 2 or sys.argv[1] not in ("ref", "warm", "run") or (sys.argv[1] != "ref" and len(sys.argv) != 3):
        raise SystemExit(__doc__)
    mode = sys.argv[1]
    if mode == "ref":
        make_ref()
        return
    spec = sys.argv[2]
    apply(spec)
    from flame.ops.checks import set_value_checks
    set_value_checks(False)
    x = ops._rwkv7_inputs(torch.bfloat16, "cuda", **ops.RWKV7_SHAPES[0])
    if mode == "warm":
        for cache in (False, True):
            torch.autograd.backward(chunk(cache)(x), torch.ones_like(chunk(cache)(x)))
        forward_backward(chunk_op, trained_head("cuda"), with_dht=False)
        print(spec, "warm")
        return
    t = {cache: ops._time(chunk(cache), x) for cache in (False, True)}
    total, rows = kernel_profile(chunk(False), x)
    print(f"== {spec}: default fwd {t[False][0]:.3f} f+b {t[False][1]:.3f} | cached fwd {t[True][0]:.3f} "
          f"f+b {t[True][1]:.3f} | kernel time per f+b {total:.3f}")
    print("   kernels: " + ", ".join(f"{k.split('(')[0]} {v:.3f}" for k, v in rows[:10]))
    while not REF.exists():  # written by a `ref` process running beside the warm-ups
        time.sleep(5)
    ref = torch.load(REF)
    errors = trained_head_errors(ref, "cuda")
    print("   trained head (default): " + " ".join(f"{k} {v:.2e}" for k, v in errors.items()))


if __name__ == "__main__":
    main()
