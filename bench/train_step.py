"""Whole training steps of the shipped 340M configs on one GPU, through flame's own trainer.

    python -m bench.train_step                                  # rwkv7, rwkv6, gsa; flame (and fla if installed)
    python -m bench.train_step --families rwkv7 --libs flame    # one family, one library
    python -m bench.train_step --size 1B --libs flame           # the 1B configs
    python -m bench.train_step --families gsa -- --training.compile false   # trainer overrides after --
    python -m bench.train_step --families rwkv7 --libs flame --config configs/rwkv7_rwkvlm_demo.toml  # another config
    python -m bench.train_step --families rwkv7 --libs flame --baseline ../base   # beside another flame tree

What it measures (one CUDA GPU, as `python -m flame.train` runs there: fp32 weights under bf16
autocast, no FSDP): each family's `configs/<family>_340M.toml` (or `--size 1B`; 32768 tokens per step, vocab 32000)
on the embedded corpus (the GPU machines have no network), stepped by
`flame.train.Trainer.run_steps`, the loop of `python -m flame.train`: the same model wrapping
(compiled blocks replayed as CUDA graphs, activation checkpointing), loss, optimizer and step
pipelining (step N+1 is queued before step N's numbers are read). fla's model of the
family (fla 0.6, optional) runs in the same loop in a child process of its own, built through the
trainer's `model_factory` hook, with flame's loss and optimizer.

Per family and library it reports:
- tokens/s: the median over the timed steps after the warm-up, from the wall time between two steps'
  results (the loop reads each step's numbers, a device sync, once the next step is queued); the
  first step's time (compile, autotune) separately;
- peak memory: `torch.cuda.max_memory_allocated` over the run, and in brackets
  `torch.cuda.max_memory_reserved` (what the caching allocator took from the GPU: CUDA-graph pools and
  freed blocks included, what must fit);
- GPU ms per step by kind (matmul, attention kernels, loss, optimizer, other kernels) from a
  torch.profiler trace of `--profile-steps` steps, and the host-bound time: wall time per profiled
  step minus the time the GPU was busy (the union of kernel intervals);
- the number of graphs torch.compile built and whether Dynamo hit a recompile limit (the calls past
  it run eager), and the Python lines where one step makes the host wait for the GPU (none: the
  trainer reads the loss and grad norm through an event, `flame.train.readback`).

Each (family, library) runs in its own process so that one failure does not stop the others and
memory starts clean. Results print as a table and go to `--out` (JSON) when given.

`--baseline DIR` also steps flame from another tree (`git worktree add DIR REV`, or `git archive
REV flame bench configs | tar -x -C DIR` where the GPU machine has no git history): after each
family's flame run, the same run from DIR's flame, bench and configs, with its own compile cache
and trace folder (`--trace`'s subfolder named as DIR), labelled `flame@<DIR's name>`. A change is
judged against its baseline of the same machine and call, as bench/RESULTS.md's rows are.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from bench.fla_models import fla_model_factory
from bench.launcher import NODE_COMPILE_CACHE
from bench.timing import FLA_MISSING, KINDS, fla_available, kernel_times, require_cuda, triton_kernel_names

REPO = Path(__file__).resolve().parents[1]

FAMILIES = ("rwkv7", "rwkv6", "gsa")
LIBS = ("flame", "fla")


SIZES = ("340M", "1B")


def trainer_args(family: str, size: str, steps: int, dump_folder: str, overrides: list[str],
                 config: str | None = None) -> list[str]:
    """The command line of `python -m flame.train` that the benchmark steps through: `config`, or
    else the shipped configs/<family>_<size>.toml."""
    settings = {  # the embedded corpus, whatever data the config names
        "--data.dataset": "embedded", "--data.name": "", "--data.data_files": "[]", "--data.shard_dir": "",
        "--data.tokenizer": "", "--data.streaming": "false", "--data.num_workers": "0", "--model.vocab_size": "32000",
        "--training.steps": str(steps), "--checkpoint.enable": "false",
        "--metrics.val_freq": "0", "--metrics.log_freq": str(steps), "--metrics.enable_wandb": "false",
        "--job.dump_folder": dump_folder,
        "--training.compile_cache_dir": NODE_COMPILE_CACHE,
    }
    # an override replaces the benchmark's own setting of its key (the trainer takes each key once)
    mine = [arg for key, value in settings.items() if key not in overrides for arg in (key, value)]
    return ["--config", config or str(REPO / "configs" / f"{family}_{size}.toml"), *mine, *overrides]


def baseline_tree(path: str) -> Path:
    """The flame tree of `--baseline`: a folder with flame/, bench/ and configs/ (exits naming what
    is missing)."""
    tree = Path(path).resolve()
    missing = [part for part in ("flame/__init__.py", "bench/train_step.py", "configs") if not (tree / part).exists()]
    if missing:
        raise SystemExit(f"--baseline {path}: not a flame tree ({', '.join(missing)} missing); make one with "
                         f"`git worktree add {path} REV` or `git archive REV flame bench configs | tar -x -C {path}`")
    if tree == REPO:
        raise SystemExit(f"--baseline {path} is this tree itself")
    return tree


class Run(NamedTuple):
    """One library's run per family: its row label, the library the child steps, the child's
    working folder (None: this process's) and environment, its trace folder, and its trainer
    overrides after the user's."""
    label: str
    lib: str
    cwd: Path | None
    env: dict
    trace: Path | None
    overrides: list[str]


def tree_env(tree: Path) -> dict:
    """The environment of a child that imports flame and bench from `tree`: `tree` first on
    PYTHONPATH, this tree's entries dropped (other entries, such as installed wheels, kept)."""
    env = os.environ.copy()
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != REPO]
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *paths])
    return env


# ---- one (family, library) run, in a child process ---------------------------------------------

def host_syncs_of(step) -> list[str]:
    """Where one call of `step` makes the host wait for the GPU (torch's sync debug mode): for each
    synchronizing operation, its Python call chain from the first frame outside the standard
    library, innermost last (the warning alone names only the innermost frame, often inside torch).
    The trainer's read of a step's numbers waits on an event (`flame.train.readback`), which this
    mode does not report: a correct step reports none."""
    import traceback
    import warnings

    import torch

    found = []
    stepping = [False]  # switching the debug mode on reports a sync of its own, outside the step

    def record(message, category, filename, lineno, file=None, line=None):
        if stepping[0] and "synchroniz" in str(message):
            frames = [f"{Path(f.filename).name}:{f.lineno}" for f in traceback.extract_stack()[:-1]
                      if "/warnings.py" not in f.filename]
            found.append(" > ".join(frames[-6:]))

    with warnings.catch_warnings():  # restores showwarning and the filters on exit
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        stepping[0] = True
        try:
            step()
        finally:
            stepping[0] = False
            torch.cuda.set_sync_debug_mode("default")
    return found


def run_child(family: str, size: str, lib: str, steps: int, warmup: int, profile_steps: int,
              overrides: list[str], host_top: int = 0, trace: str | None = None, config: str | None = None) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from flame.config import load_config
    from flame.train.trainer import Trainer

    # one more step than measured: the loop reads the last step's numbers before it returns, so
    # the last step does not overlap the next one as every other step does
    total = warmup + steps + 1 + profile_steps + 1
    if lib == "fla":
        # fla's model does not compile: Inductor rejects the in-place use of views that its custom
        # autograd Functions return (torch 2.11); it runs eager, with its own fused Triton glue.
        # Nor does it take flame's "elementwise" recomputation: eager, that policy is a dispatch mode
        # that sees every op (hundreds of ms of host time per step), and fla's RWKV6 mutates a tensor
        # that the policy caches ("Tensor cached during selective activation checkpoint has been
        # mutated"); it keeps every activation, as fla's own trainer does by default
        overrides = [*overrides, "--training.compile", "false", "--training.activation_checkpoint", "none"]
    with tempfile.TemporaryDirectory() as dump:
        cfg = load_config(trainer_args(family, size, total, dump, overrides, config))
        if cfg.model.family != family:
            raise SystemExit(f"bench.train_step: {config} is a {cfg.model.family} config, not {family}")
        factory = fla_model_factory(family) if lib == "fla" else None
        trainer = Trainer(cfg, model_factory=factory)
        torch.cuda.reset_peak_memory_stats()
        tokens_per_step = (cfg.training.batch_size * cfg.training.seq_len
                           * cfg.training.gradient_accumulation_steps)

        # the trainer's own loop (`Trainer.run_steps`, as `train()` runs it): step N+1 is queued
        # before step N's numbers are read, so a step's time is the time between two results
        results = trainer.run_steps(total)
        losses = []
        clock = [time.perf_counter()]

        def step() -> float:
            result = next(results)
            if result.skipped:
                raise RuntimeError(f"{family}/{lib}: step {trainer.state.step} was non-finite")
            losses.append(result.loss)
            now = time.perf_counter()
            elapsed, clock[0] = now - clock[0], now
            return elapsed

        times = [step() for _ in range(warmup)]
        host_profile = None
        if host_top:
            import cProfile
            import io
            import pstats

            profiler = cProfile.Profile()
            profiler.enable()
        times += [step() for _ in range(steps)]
        if host_top:
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(host_top)
            host_profile = text.getvalue()
        first_step_s = times[0]
        timed = times[warmup:]
        # compiled graphs so far (0 when eager) and whether Dynamo gave up on a function (a
        # recompile limit hit leaves the calls past it eager)
        from torch._dynamo.utils import counters

        graphs = int(counters["stats"].get("unique_graphs", 0))
        recompile_limit_hits = sum(v for k, v in counters["stats"].items() if "limit" in k)
        syncs = host_syncs_of(step)

        # a saved trace carries the Python stacks, to find the call site of a kernel launched outside the graphs
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=bool(trace)) as prof:
            wall = sum(step() for _ in range(profile_steps))
        peak = torch.cuda.max_memory_allocated() / 2**30
        peak_reserved = torch.cuda.max_memory_reserved() / 2**30
        if trace:
            Path(trace).mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(Path(trace) / f"{family}_{lib}.json"))

        attention = triton_kernel_names(("flame.ops.rwkv", "flame.ops.gsa", "flame.ops.common",
                                         "fla.ops"))
        loss = triton_kernel_names(("flame.ops.linear_cross_entropy",))
        kernels = kernel_times(prof, profile_steps, attention, loss)
        step_ms = statistics.median(timed) * 1e3
        return {
            "family": family, "size": size, "lib": lib, "compile": cfg.training.compile,
            "compiled_graphs": graphs, "recompile_limit_hits": recompile_limit_hits,
            "host_syncs_per_step": syncs,
            "tokens_per_s": tokens_per_step / statistics.median(timed),
            "tokens_per_s_all": [tokens_per_step / t for t in timed],
            "first_step_s": first_step_s,
            "peak_gib": peak,
            "peak_reserved_gib": peak_reserved,
            **kernels,
            "wall_ms_per_step": step_ms,
            "wall_ms_per_profiled_step": wall * 1e3 / profile_steps,
            "host_bound_ms_per_step": max(step_ms - kernels["gpu_busy_ms_per_step"], 0.0),
            "host_profile": host_profile,
            "losses": losses,
        }


# ---- the parent: one child per (family, library), then the table -------------------------------

def main() -> int:
    argv = sys.argv[1:]
    overrides = []
    if "--" in argv:
        cut = argv.index("--")
        argv, overrides = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--size", default="340M", choices=SIZES, help="which shipped configs: configs/<family>_<size>.toml")
    parser.add_argument("--config", help="this config instead of the shipped configs/<family>_<size>.toml "
                                         "(one family: its model.family)")
    parser.add_argument("--libs", default=",".join(LIBS))
    parser.add_argument("--steps", type=int, default=10, help="timed steps after the warm-up")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile, autotune)")
    parser.add_argument("--profile-steps", type=int, default=2)
    parser.add_argument("--host-profile", type=int, default=0, metavar="N",
                        help="also profile the host side of the timed steps (cProfile): the N functions "
                             "with the most own time (the timed tokens/s then include its overhead)")
    parser.add_argument("--trace", metavar="DIR",
                        help="also write the profiled steps' chrome trace, DIR/<family>_<lib>.json")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per (family, library) run")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--baseline", metavar="DIR", help="also run flame from the flame tree at DIR, after "
                                                          "each family's flame run (see the module docstring)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    baseline = baseline_tree(args.baseline) if args.baseline and not args.child else None
    require_cuda("bench.train_step")

    if args.child:
        family, lib, out = args.child.split(":", 2)
        result = run_child(family, args.size, lib, args.steps, args.warmup, args.profile_steps, overrides,
                           args.host_profile, args.trace, args.config)
        Path(out).write_text(json.dumps(result))
        return 0

    libs = [lib for lib in args.libs.split(",") if lib != "fla" or fla_available()]
    if "fla" in args.libs.split(",") and "fla" not in libs:
        print(FLA_MISSING, flush=True)
    trace = Path(args.trace).resolve() if args.trace else None
    runs = [Run(lib, lib, None, os.environ.copy(), trace, []) for lib in libs]
    if baseline is not None and "flame" in libs:
        # the baseline compiles into a cache of its own, unless the overrides name one, and traces
        # into a folder of its own
        cache = ([] if "--training.compile_cache_dir" in overrides
                 else ["--training.compile_cache_dir", f"{NODE_COMPILE_CACHE}-{baseline.name}"])
        runs.insert(libs.index("flame") + 1, Run(f"flame@{baseline.name}", "flame", baseline, tree_env(baseline),
                                                 trace / baseline.name if trace else None, cache))
    results = []
    for family in args.families.split(","):
        for run in runs:
            label, lib = run.label, run.lib
            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
                out = tmp.name
            cmd = [sys.executable, "-m", "bench.train_step", "--child", f"{family}:{lib}:{out}", "--size", args.size,
                   "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--profile-steps", str(args.profile_steps),
                   "--host-profile", str(args.host_profile), *(["--trace", str(run.trace)] if run.trace else []),
                   *(["--config", str(Path(args.config).resolve())] if args.config else []),
                   "--", *overrides, *run.overrides]
            print(f"=== {family} / {label}: {' '.join(cmd[3:])}", flush=True)
            start = time.monotonic()
            try:
                proc = subprocess.run(cmd, timeout=args.timeout, cwd=run.cwd, env=run.env)
                code = proc.returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
            if code == 0:
                result = json.loads(Path(out).read_text())
            else:
                result = {"family": family, "size": args.size, "lib": lib, "error": f"exit {code}"}
            result["lib"] = label
            result["run_s"] = time.monotonic() - start
            os.unlink(out)
            results.append(result)
            if result.get("host_profile"):
                print(result.pop("host_profile"), flush=True)
            print(json.dumps(result), flush=True)

    print()
    print("| model | lib | compile | tokens/s | peak GiB (reserved) | first step s | GPU ms/step: "
          + " / ".join(KINDS) + " | busy | host-bound |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['family']}_{r['size']} | {r['lib']} | - | {r['error']} | | | | | |")
            continue
        kinds = " / ".join(f"{r['gpu_ms_per_step'][k]:.1f}" for k in KINDS)
        print(f"| {r['family']}_{r['size']} | {r['lib']} | {r['compile']} | {r['tokens_per_s'] / 1e3:.1f}K | "
              f"{r['peak_gib']:.1f} ({r['peak_reserved_gib']:.1f}) | {r['first_step_s']:.1f} | {kinds} | "
              f"{r['gpu_busy_ms_per_step']:.1f} | "
              f"{r['host_bound_ms_per_step']:.1f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
