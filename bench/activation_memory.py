"""Activation memory of a training step per family and activation-checkpointing policy: the
measurement behind `flame.train.memory_estimate.ACTIVATION_BYTES`, and its check.

    python -m bench.activation_memory                                # every family and policy
    python -m bench.activation_memory --families rwkv7 --policies elementwise,none --jobs 4

Each run trains one small model of the family (`configs/<family>_340M.toml` at hidden size W and
L blocks, batch x seq_len tokens per micro-batch, one micro-batch per step) with flame's trainer on
one GPU, as `python -m flame.train` runs there: bf16 compute, compiled blocks replayed as CUDA
graphs, the policy's activation checkpointing, fused AdamW. After a first step (compile, autotune,
AdamW's state) it resets the peak-memory counter and takes three more steps (the CUDA graphs are
recorded in the first of them); then

    activations = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()

the step's peak over the memory that stays between steps (weights, gradients, AdamW state, compute
copies). Every (family, policy, W) runs at two depths L1 < L2, each in a process of its own (a
clean allocator); with T tokens per micro-batch:

    saved per block and token  = (activations(L2) - activations(L1)) / ((L2 - L1) T)
    working per token          = (activations(L1) - L1 T saved - head) / T

head: `memory_estimate.head_workspace_bytes`, the LM head's workspace, computed. Two widths give
each figure as a + b W (`memory_estimate.PerToken`). RWKV7's model.cache_intermediates and
model.recompute_states are measured with the "elementwise" policy, as the change of `saved`.

The output: every run (the static memory, also over the 18 bytes per parameter that
`memory_estimate.replicated` counts for it; the activations, and what
`memory_estimate.activation_bytes` predicts for them from the table in the code; the largest
reserved over the largest allocated memory, the allocator's overhead that
`memory_estimate.FIT_FRACTION` leaves room for); the fitted table; and the table as Python, for
flame/train/memory_estimate.py. Several runs share the GPU at once (--jobs): memory counters are
per process.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.launcher import NODE_COMPILE_CACHE

REPO = Path(__file__).resolve().parents[1]
FAMILIES = ("rwkv7", "rwkv6", "gsa")
POLICIES = ("none", "selective", "elementwise", "full")
RWKV7_FLAGS = ("cache_intermediates", "recompute_states")
FLAG_POLICY = "elementwise"


def trainer_args(family: str, policy: str, flag: str, width: int, depth: int, batch: int, seq_len: int,
                 dump: str) -> list[str]:
    """The command line of the trainer of one run; `flag`: an RWKV7 flag turned on, or ""."""
    return [
        "--config", str(REPO / "configs" / f"{family}_340M.toml"),
        "--data.dataset", "embedded", "--data.tokenizer", "", "--data.name", "", "--data.streaming", "false",
        "--data.num_workers", "0", "--model.vocab_size", "32000",
        "--model.hidden_size", str(width), "--model.num_layers", str(depth),
        "--model.cache_intermediates", str(flag == "cache_intermediates").lower(),
        "--model.recompute_states", str(flag == "recompute_states").lower(),
        "--training.batch_size", str(batch), "--training.seq_len", str(seq_len),
        "--training.gradient_accumulation_steps", "1", "--training.activation_checkpoint", policy,
        "--training.compile", "true", "--training.cuda_graphs", "true", "--training.steps", "100",
        "--checkpoint.enable", "false", "--metrics.val_freq", "0", "--metrics.enable_wandb", "false",
        "--job.dump_folder", dump,
        "--training.compile_cache_dir", NODE_COMPILE_CACHE,
    ]


# ---- one run, in a child process ---------------------------------------------------------------

def run_child(spec: dict) -> dict:
    import torch

    from flame.config import load_config
    from flame.train.memory_estimate import ParamCounts, activation_bytes, head_workspace_bytes
    from flame.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as dump:
        cfg = load_config(trainer_args(spec["family"], spec["policy"], spec["flag"], spec["width"],
                                       spec["depth"], spec["batch"], spec["seq_len"], dump))
        trainer = Trainer(cfg)

        def step() -> None:
            result = trainer.train_step(trainer.next_micro_batches())
            if result.skipped:
                raise RuntimeError(f"{spec}: a non-finite step")

        step()  # compile and autotune; AdamW's state is allocated at the update
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(3):  # the CUDA graphs are recorded in the first, replayed after
            step()
        torch.cuda.synchronize()
        static = torch.cuda.memory_allocated()
        peak = torch.cuda.max_memory_allocated()
        try:
            predicted = activation_bytes(cfg)
        except ValueError:  # the table has no entry for this run yet
            predicted = None
        return {**spec, "params": ParamCounts.of(trainer.model).total, "static": static, "peak": peak,
                "activations": peak - static, "reserved": torch.cuda.max_memory_reserved(),
                "head": head_workspace_bytes(cfg), "predicted": predicted,
                "tokens": cfg.training.batch_size * cfg.training.seq_len}


# ---- the parent: runs in parallel, then the fit --------------------------------------------------

def run_all(specs: list[dict], jobs: int, timeout: float) -> list[dict]:
    """Every spec in a child process, `jobs` at a time; a failed run's result has "error"."""
    pending, running, results = list(specs), [], []
    while pending or running:
        while pending and len(running) < jobs:
            spec = pending.pop(0)
            fd, out = tempfile.mkstemp(suffix=".json")
            os.close(fd)
            cmd = [sys.executable, "-m", "bench.activation_memory", "--child", json.dumps(spec), "--out", out]
            log = open(out + ".log", "wb")
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
            running.append((spec, proc, out, log, time.monotonic()))
        time.sleep(1)
        for entry in list(running):
            spec, proc, out, log, start = entry
            if proc.poll() is None and time.monotonic() - start < timeout:
                continue
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            running.remove(entry)
            log.close()
            if proc.returncode == 0:
                result = json.loads(Path(out).read_text())
            else:
                tail = Path(out + ".log").read_text(errors="replace")[-1500:]
                result = {**spec, "error": f"exit {proc.returncode}: {tail}"}
            for path in (out, out + ".log"):
                Path(path).unlink(missing_ok=True)
            result["run_s"] = round(time.monotonic() - start, 1)
            print(json.dumps({k: v for k, v in result.items() if k != "error"}) if "error" not in result
                  else f"FAILED {spec}: {result['error']}", flush=True)
            results.append(result)
    return results


def per_token_fit(points: dict[int, float]):
    """(a, b) of a + b W through the points {W: bytes per token}; one point: b = y / W, a = 0."""
    widths = sorted(points)
    if len(widths) == 1:
        return 0.0, points[widths[0]] / widths[0]
    (w1, y1), (w2, y2) = (widths[0], points[widths[0]]), (widths[-1], points[widths[-1]])
    b = (y2 - y1) / (w2 - w1)
    return y1 - b * w1, b


def fit(results: list[dict]) -> tuple[dict, dict]:
    """(ACTIVATION_BYTES, RWKV7_FLAG_BYTES) as {key: ((a, b) saved, (a, b) working)} and
    {flag: (a, b)} from the runs."""
    by_key: dict[tuple, dict[int, dict[int, dict]]] = {}
    for r in results:
        if "error" not in r:
            by_key.setdefault((r["family"], r["policy"], r["flag"]), {}).setdefault(r["width"], {})[r["depth"]] = r
    saved_at, working_at = {}, {}
    for key, widths in by_key.items():
        for width, depths in widths.items():
            if len(depths) < 2:
                continue
            (d1, r1), (d2, r2) = sorted(depths.items())[0], sorted(depths.items())[-1]
            tokens = r1["tokens"]
            saved = (r2["activations"] - r1["activations"]) / ((d2 - d1) * tokens)
            working = (r1["activations"] - d1 * tokens * saved - r1["head"]) / tokens
            saved_at.setdefault(key, {})[width] = saved
            working_at.setdefault(key, {})[width] = working
    table, flags = {}, {}
    for (family, policy, flag), saved in saved_at.items():
        if not flag:
            table[family, policy] = (per_token_fit(saved), per_token_fit(working_at[family, policy, flag]))
    for (family, policy, flag), saved in saved_at.items():
        base = saved_at.get((family, policy, ""), {})
        delta = {w: saved[w] - base[w] for w in saved if w in base}
        if flag and delta:
            flags[flag] = per_token_fit(delta)
    return table, flags


def print_report(results: list[dict]) -> None:
    ok = [r for r in results if "error" not in r]
    print("\n| family | policy | flag | width | depth | params M | static GiB | static / 18 P | activations GiB | "
          "predicted GiB | reserved / peak |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(ok, key=lambda r: (r["family"], r["policy"], r["flag"], r["width"], r["depth"])):
        predicted = f"{r['predicted'] / 2**30:.2f}" if r["predicted"] is not None else "-"
        print(f"| {r['family']} | {r['policy']} | {r['flag'] or '-'} | {r['width']} | {r['depth']} | "
              f"{r['params'] / 1e6:.0f} | {r['static'] / 2**30:.2f} | {r['static'] / (18 * r['params']):.3f} | "
              f"{r['activations'] / 2**30:.2f} | "
              f"{predicted} | {r['reserved'] / r['peak']:.3f} |")
    table, flags = fit(results)
    print("\n| family | policy | saved per block: a + b C (bytes per token) | at C = 1024 / 2048 / 4096 | "
          "working: a + b C | at C = 1024 / 2048 / 4096 |")
    print("|---|---|---|---|---|---|")
    for (family, policy), (saved, working) in table.items():
        at = [" / ".join(f"{(fa + fb * c) / 1e3:.1f}K" for c in (1024, 2048, 4096)) for fa, fb in (saved, working)]
        print(f"| {family} | {policy} | {saved[0]:.0f} + {saved[1]:.2f} C | {at[0]} | "
              f"{working[0]:.0f} + {working[1]:.2f} C | {at[1]} |")
    print("\nACTIVATION_BYTES: dict[tuple[str, str], tuple[PerToken, PerToken]] = {")
    for (family, policy), (saved, working) in table.items():
        print(f'    ("{family}", "{policy}"): (PerToken({saved[0]:.0f}, {saved[1]:.2f}), '
              f"PerToken({working[0]:.0f}, {working[1]:.2f})),")
    print("}\n\nRWKV7_FLAG_BYTES: dict[str, PerToken] = {")
    for flag, (fa, fb) in flags.items():
        print(f'    "{flag}": PerToken({fa:.0f}, {fb:.2f}),')
    print("}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--flags", default=",".join(RWKV7_FLAGS),
                        help="RWKV7 flags to measure (with the elementwise policy); empty: none")
    parser.add_argument("--widths", default="1024,2048", help="hidden sizes (two give a + b C)")
    parser.add_argument("--depths", default="2,4", help="two block counts")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--jobs", type=int, default=6, help="runs at once on the GPU")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    parser.add_argument("--out", help="write every run's numbers as JSON here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        result = run_child(json.loads(args.child))
        Path(args.out).write_text(json.dumps(result))
        return 0

    from bench.timing import require_cuda, versions

    require_cuda("bench.activation_memory")
    import torch

    families, policies = args.families.split(","), args.policies.split(",")
    widths = [int(w) for w in args.widths.split(",")]
    depths = [int(d) for d in args.depths.split(",")]
    if len(depths) != 2 or depths[0] >= depths[1] or depths[0] < 2:
        parser.error("--depths takes two block counts, 2 <= L1 < L2 (RWKV7's first block differs)")
    flags = [f for f in args.flags.split(",") if f] if "rwkv7" in families else []
    runs = [(f, p, "") for f in families for p in policies] + [("rwkv7", FLAG_POLICY, flag) for flag in flags]
    # the shallow runs first: the deeper ones of the same shapes then find the compiled kernels cached
    specs = [{"family": f, "policy": p, "flag": flag, "width": w, "depth": d, "batch": args.batch,
              "seq_len": args.seq_len}
             for d, (f, p, flag), w in itertools.product(depths, runs, widths)]
    print(f"{torch.cuda.get_device_name()}, {versions()}: {len(specs)} runs, {args.jobs} at a time", flush=True)
    results = run_all(specs, args.jobs, args.timeout)
    print_report(results)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
