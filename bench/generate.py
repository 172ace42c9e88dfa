"""Generation throughput of the shipped 340M configs on one GPU: flame, fla 0.6 and the official
`rwkv` package, on the same random weights.

    python -m bench.generate --out generate.json          # rwkv7, rwkv6, gsa; flame, hf, fla, rwkv
    python -m bench.generate --families rwkv7,rwkv6,gsa --libs flame --out generate.json

What it measures (CUDA GPU, bf16 weights, random initialisation, vocabulary 32000), per family of
--families (`configs/<family>_340M.toml`):

- decode: B random prompts of --prompt-len tokens continued by --new-tokens greedy tokens, at
  every batch size of --batch-sizes. Each generation is timed inside itself (`RunClock`, CUDA
  events in stream order): from its start to the mark after its first token (the prefill) and
  from that mark to its end (the decoding). Decoding tokens/s = B * (new_tokens - 1) / decoding
  time; both times are medians of --repeats runs after one warm-up run (compiles, captures the
  CUDA graph). flame: `flame.inference.generate`, the decode step replayed as a CUDA graph, marked
  where the generation loads the prompt's state into its `Decoder`; "graph step ms" is one
  replay alone, without the sampling, and a row whose decoding steps take less than that is
  flagged as a timing error (`decode_figures`). hf: flame's Hugging Face model class
  (flame.export.hf) through transformers' `generate`, whose FlameCache runs the same decode step.
  fla (optional, imported only when installed): the family built by fla with the same shape,
  through transformers' `generate` with fla's recurrent cache, forced to the same length. hf and
  fla are marked at transformers' first call of the logits processors (on the first token's
  logits). rwkv (optional: `pip install rwkv`): the official package on flame's `--format rwkv`
  export of the same weights (RWKV6 and RWKV7), strategy --rwkv-strategy, in a subprocess per
  family (its environment switches are set before import). The package decodes one sequence per
  call, so batch B runs B calls per token; only --rwkv-batch-sizes are measured, from a prompt of
  --rwkv-prompt-len tokens; marked after the prompt's first token.
- prefill: --prefill-batch x --prefill-len tokens through the chunked kernels to the recurrent state
  (flame's `prefill`, fla's forward with use_cache); flame's eval forward (the fused LM-head loss,
  as `flame.eval` runs it) on the same tokens; the rwkv package prefills one sequence of
  --rwkv-prompt-len tokens. flame's prefill and eval forward run the model's blocks compiled
  (flame.inference.compiled: torch.compile per block, compiled in the warm-up run; prefill compiles
  its segments of PREFILL_SEGMENT tokens and runs the rest eagerly) unless --no-compile; the row's
  "compiled" says whether they did.
- the peak GPU memory of each measurement.

A library that is not installed, or that fails on a family, is reported with a note and the
others go on. The final tables print to stdout; --out writes every row as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

FAMILIES = ("rwkv7", "rwkv6", "gsa")
LIBS = ("flame", "hf", "fla", "rwkv")
RWKV_FAMILIES = ("rwkv7", "rwkv6")
TINY = dict(hidden_size=128, num_layers=2, vocab_size=256, head_dim=64, num_heads=2, num_slots=16)
"""--tiny: a model small enough for a CPU smoke run of the script (RWKV head size 64, as the rwkv
package's RWKV7 requires)."""
WORKER_TIMEOUT_S = 900


def model_args(family: str, tiny: bool):
    import dataclasses

    from flame.config import load_config

    args = load_config(["--config", str(REPO / "configs" / f"{family}_340M.toml")]).model
    return dataclasses.replace(args, **TINY) if tiny else args


def initialized_model(args, device):
    """flame's model for the model keys `args`, built on the meta device and given its official
    random init on `device` (seed 0), fp32: the benchmarks' untrained model."""
    import torch

    from flame.models import build_model

    torch.manual_seed(0)
    with torch.device("meta"):
        model = build_model(args)
    model.to_empty(device=device)
    model.init_weights()
    return model


def build_flame(family: str, device, tiny: bool = False):
    """flame's model of the family, random official init, bf16 (fp32 on CPU), eval mode."""
    import torch

    model = initialized_model(model_args(family, tiny), device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return model.to(dtype).eval()


def build_fla(family: str, device, tiny: bool = False):
    """fla's model of the family, shaped like flame's config (bench.fla_models)."""
    import torch

    from bench.fla_models import fla_model_factory

    torch.manual_seed(0)
    model = fla_model_factory(family)(model_args(family, tiny)).inner
    return model.to(device=device, dtype=torch.bfloat16).eval()


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, repeats: int, device, warmup: int = 1) -> tuple[float, object]:
    """(median seconds of `repeats` calls after `warmup` calls, the last result)."""
    result = None
    for _ in range(warmup):
        result = fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        result = fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def reset_memory(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def random_ids(vocab: int, batch: int, length: int, device, seed: int):
    import torch

    return torch.randint(0, vocab, (batch, length), device=device,
                         generator=torch.Generator(device=device).manual_seed(seed))


def model_name(family: str, args) -> str:
    return f"{family} {'tiny' if args.tiny else '340M'}"


class RunClock:
    """Marks on the device's timeline inside one generation. On CUDA each mark is a CUDA event
    recorded on the current stream, so it lands after the work queued before it however far the
    host runs ahead; on CPU it is a host clock reading (every op has finished when the next starts)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        import torch

        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        """Seconds between consecutive marks, once the last one is reached."""
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def timed_generation(run, repeats: int, device) -> tuple[float, float, object]:
    """(median prefill seconds, median decoding seconds, last result) of `repeats` calls of
    run(clock) after one warm-up call. run marks the clock once, after the generation's first
    token; the marks before and after each call close the prefill (start to that mark) and the
    decoding (that mark to the end)."""
    run(RunClock(device))
    prefills, decodes, result = [], [], None
    for _ in range(repeats):
        clock = RunClock(device)
        sync(device)
        clock.mark()
        result = run(clock)
        clock.mark()
        times = clock.intervals()
        if len(times) != 2:
            raise RuntimeError(f"the generation marked its first token {len(times) - 1} times, expected once")
        prefills.append(times[0])
        decodes.append(times[1])
    return statistics.median(prefills), statistics.median(decodes), result


@contextlib.contextmanager
def marking_before(owner, name: str, clock: RunClock):
    """While the block runs, every call of `owner.name` (a function attribute of a class or
    object) marks `clock` first."""
    original = getattr(owner, name)

    def marked(*args, **kwargs):
        clock.mark()
        return original(*args, **kwargs)

    setattr(owner, name, marked)
    try:
        yield
    finally:
        setattr(owner, name, original)


class FirstLogitsMark:
    """A transformers logits processor that marks `clock` at its first call: the first token's
    logits, after the prefill. It returns the scores unchanged."""

    def __init__(self, clock: RunClock):
        self.clock, self.marked = clock, False

    def __call__(self, input_ids, scores):
        if not self.marked:
            self.clock.mark()
            self.marked = True
        return scores


def decode_figures(batch: int, new_tokens: int, decode_s: float, graph_step_ms: float | None = None) -> dict:
    """The rates of `new_tokens - 1` decoding steps of `batch` sequences that took decode_s
    seconds: decode_tokens_per_s, ms_per_step and, when nothing makes them wrong, no "note".

    decode_s that is not a positive finite number gives nan rates and a note. graph_step_ms (one
    step's CUDA graph replayed alone, the least a decoding step can take) adds graph_step_ms and
    below_graph_step: True, with a note, when the steps took less than their graph (decode_s <
    (new_tokens - 1) x graph step), which only a timing error explains."""
    steps = new_tokens - 1
    if steps < 1:
        raise ValueError(f"decoding rates need new_tokens >= 2, got {new_tokens}")
    figures: dict = {}
    if not (math.isfinite(decode_s) and decode_s > 0):
        figures["note"] = f"decoding time {decode_s!r} s is not a positive duration: no rate"
        decode_s = math.nan
    figures["decode_tokens_per_s"] = batch * steps / decode_s
    figures["ms_per_step"] = decode_s * 1e3 / steps
    if graph_step_ms is not None:
        figures["graph_step_ms"] = graph_step_ms
        figures["below_graph_step"] = figures["ms_per_step"] < graph_step_ms
        if figures["below_graph_step"]:
            figures["note"] = (f"timing error: {figures['ms_per_step']:.3f} ms per decoding step is below the "
                               f"graph step alone ({graph_step_ms:.3f} ms)")
    return figures


def decode_row(family, lib, batch, args, prefill_s, decode_s, device, *, prompt_len=None, new_tokens=None,
               graph_step_ms=None, **extra) -> dict:
    """One decode row: the prefill time and `decode_figures` of a generation of `new_tokens`
    (default --new-tokens) after a prompt of `prompt_len` (default --prompt-len)."""
    prompt_len = args.prompt_len if prompt_len is None else prompt_len
    new_tokens = args.new_tokens if new_tokens is None else new_tokens
    figures = decode_figures(batch, new_tokens, decode_s, graph_step_ms)
    notes = [n for n in (figures.pop("note", None), extra.pop("note", None)) if n]
    row = {"family": family, "model": model_name(family, args), "lib": lib, "kind": "decode", "batch": batch,
           "prompt_len": prompt_len, "new_tokens": new_tokens, "prefill_ms": prefill_s * 1e3, **figures,
           "peak_gib": peak_gib(device), **extra}
    if notes:
        row["note"] = "; ".join(notes)
    return row


# ---- flame ------------------------------------------------------------------------------------

def bench_flame(family: str, args, device) -> list[dict]:
    import torch

    from flame.inference.compiled import compiled_blocks
    from flame.inference.decoder import PREFILL_SEGMENT, Decoder, decoder_for, prefill, release_decoders
    from flame.inference.generation import generate
    from flame.ops.utils.checks import value_checks_off

    model = build_flame(family, device, args.tiny)
    rows = []
    with torch.no_grad():
        reset_memory(device)
        ids = random_ids(model.vocab_size, args.prefill_batch, args.prefill_len + 1, device, seed=1)
        inputs, labels = ids[:, :-1], ids[:, 1:]
        with value_checks_off():
            prefill_s, _ = timed(lambda: prefill(model, inputs, compile=args.compile), args.repeats, device)
            prefill_peak = peak_gib(device)
            reset_memory(device)

            def eval_forward():
                with compiled_blocks(model, args.compile):
                    return model(inputs, labels=labels)

            eval_s, _ = timed(eval_forward, args.repeats, device)
            with compiled_blocks(model, args.compile) as compiled:  # False also after a failed compilation
                pass
        tokens = inputs.numel()
        note = "compiled blocks" if compiled else "eager blocks"
        if compiled and args.prefill_len % PREFILL_SEGMENT:
            note += f" (prefill: {args.prefill_len % PREFILL_SEGMENT} of the tokens eagerly)"
        rows.append({"family": family, "model": model_name(family, args), "lib": "flame", "kind": "prefill",
                     "batch": args.prefill_batch,
                     "seq_len": args.prefill_len, "prefill_tokens_per_s": tokens / prefill_s,
                     "eval_tokens_per_s": tokens / eval_s, "prefill_peak_gib": prefill_peak,
                     "eval_peak_gib": peak_gib(device), "compiled": compiled, "note": note})
        print(json.dumps(rows[-1]), flush=True)
        del ids, inputs, labels

        for batch in args.batch_sizes:
            release_decoders(model)
            reset_memory(device)
            prompts = random_ids(model.vocab_size, batch, args.prompt_len, device, seed=batch)

            def run(clock: RunClock):
                with marking_before(Decoder, "load", clock):  # once per generation, after its first token
                    return generate(model, prompts, max_new_tokens=args.new_tokens, temperature=0)

            first_s, decode_s, out = timed_generation(run, args.repeats, device)
            if tuple(out.shape) != (batch, args.new_tokens):
                raise RuntimeError(f"generated shape {tuple(out.shape)}, expected {(batch, args.new_tokens)}")
            decoder = decoder_for(model, batch)
            step_s, _ = timed(decoder.step, 1, device, warmup=3)  # a coarse first look, refined below
            n_steps = max(10, min(200, int(0.2 / max(step_s, 1e-6))))
            sync(device)
            start = time.perf_counter()
            for _ in range(n_steps):
                decoder.step()
            sync(device)
            step_ms = (time.perf_counter() - start) * 1e3 / n_steps
            rows.append(decode_row(family, "flame", batch, args, first_s, decode_s, device,
                                   graph_step_ms=step_ms, graphed=decoder.graphed))
            print(json.dumps(rows[-1]), flush=True)
            if args.profile and batch == args.batch_sizes[0] and device.type == "cuda":
                print_step_profile(family, batch, decoder)
            del decoder, out  # this batch's buffers and graph go before the next batch's peak is measured
        release_decoders(model)
    return rows


def print_step_profile(family: str, batch: int, decoder, steps: int = 20) -> None:
    """The kernels of one decoding step (from `steps` graph replays under torch.profiler): how many,
    and the ones that take the most time."""
    from collections import defaultdict

    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            decoder.step()
        torch.cuda.synchronize()
    totals, counts = defaultdict(float), defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time_total
            counts[event.name] += 1
    kernels = sum(counts.values()) / steps
    busy = sum(totals.values()) / steps
    print(f"\n{family} batch {batch}: {kernels:.0f} kernels per step, {busy:.0f} us of kernel time per step")
    for name, total in sorted(totals.items(), key=lambda kv: -kv[1])[:15]:
        print(f"  {total / steps:8.1f} us  {counts[name] / steps:5.1f} x  {name[:100]}")


# ---- flame's Hugging Face export -------------------------------------------------------------------

def bench_hf(family: str, args, device) -> list[dict]:
    """flame's FlameForCausalLM (the class an `hf` export loads) through transformers' generate."""
    import dataclasses

    import torch

    from flame.export.hf import FlameConfig, FlameForCausalLM

    config = FlameConfig(**dataclasses.asdict(model_args(family, args.tiny)), pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = FlameForCausalLM(config)
    model = model.to(torch.bfloat16 if device.type == "cuda" else torch.float32).eval()
    rows = []
    with torch.no_grad():
        for batch in args.batch_sizes:
            reset_memory(device)
            prompts = random_ids(config.vocab_size, batch, args.prompt_len, device, seed=batch)

            def run(clock: RunClock):
                n = args.new_tokens
                return model.generate(prompts, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                      logits_processor=[FirstLogitsMark(clock)])[:, args.prompt_len:]

            first_s, decode_s, out = timed_generation(run, args.repeats, device)
            if tuple(out.shape) != (batch, args.new_tokens):
                raise RuntimeError(f"generated shape {tuple(out.shape)}, expected {(batch, args.new_tokens)}")
            rows.append(decode_row(family, "hf", batch, args, first_s, decode_s, device,
                                   note="transformers' generate loop around flame's decode step"))
            print(json.dumps(rows[-1]), flush=True)
    return rows


# ---- fla ----------------------------------------------------------------------------------------

def bench_fla(family: str, args, device) -> list[dict]:
    import torch

    model = build_fla(family, device, args.tiny)
    vocab = model.config.vocab_size
    rows = []
    with torch.no_grad():
        reset_memory(device)
        ids = random_ids(vocab, args.prefill_batch, args.prefill_len, device, seed=1)
        prefill_s, _ = timed(lambda: model(ids, use_cache=True), args.repeats, device)
        rows.append({"family": family, "model": model_name(family, args), "lib": "fla", "kind": "prefill",
                     "batch": args.prefill_batch,
                     "seq_len": args.prefill_len, "prefill_tokens_per_s": ids.numel() / prefill_s,
                     "prefill_peak_gib": peak_gib(device)})
        print(json.dumps(rows[-1]), flush=True)
        del ids
        for batch in args.batch_sizes:
            reset_memory(device)
            prompts = random_ids(vocab, batch, args.prompt_len, device, seed=batch)

            def run(clock: RunClock):
                n = args.new_tokens
                return model.generate(prompts, max_new_tokens=n, min_new_tokens=n, do_sample=False, use_cache=True,
                                      pad_token_id=0, logits_processor=[FirstLogitsMark(clock)])[:, args.prompt_len:]

            first_s, decode_s, out = timed_generation(run, args.repeats, device)
            if tuple(out.shape) != (batch, args.new_tokens):
                raise RuntimeError(f"generated shape {tuple(out.shape)}, expected {(batch, args.new_tokens)}")
            rows.append(decode_row(family, "fla", batch, args, first_s, decode_s, device))
            print(json.dumps(rows[-1]), flush=True)
    return rows


# ---- the official rwkv package, in a subprocess ---------------------------------------------------

def rwkv_worker(family: str, args, out_path: str) -> None:
    """Runs in the subprocess that `bench_rwkv` starts: export flame's weights as an RWKV-LM .pth,
    load it with the rwkv package, time its prefill and its decoding; write the rows as JSON."""
    import torch

    from flame.weights.rwkv_names import to_rwkv

    device = torch.device(args.device)
    model = build_flame(family, device, args.tiny)
    vocab = model.vocab_size
    state = to_rwkv({k: v.detach().to("cpu", torch.bfloat16).clone() for k, v in model.state_dict().items()},
                    family, model.tie_word_embeddings)
    del model
    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / family)
        torch.save(state, path + ".pth")
        del state
        from rwkv.model import RWKV  # the environment switches are set: see bench_rwkv

        rwkv_model = RWKV(model=path, strategy=args.rwkv_strategy)
    prompt = random_ids(vocab, 1, args.rwkv_prompt_len, device, seed=1)[0].tolist()

    def prefill_one():
        return rwkv_model.forward(list(prompt), None)

    def decode(batch: int, n: int, clock: RunClock):
        """Greedy continuations of `batch` copies of the prompt, one package call per sequence and
        token; marks `clock` after the first token."""
        logits, first_state = prefill_one()
        states = [[s.clone() for s in first_state] for _ in range(batch)]
        tokens = [int(logits.argmax())] * batch
        clock.mark()
        for _ in range(n - 1):
            for row in range(batch):
                out, states[row] = rwkv_model.forward([tokens[row]], states[row])
                tokens[row] = int(out.argmax())
        return tokens

    rows = []
    with torch.no_grad():
        reset_memory(device)
        prefill_s, _ = timed(prefill_one, args.repeats, device)
        rows.append({"family": family, "model": model_name(family, args), "lib": "rwkv", "kind": "prefill",
                     "batch": 1, "seq_len": args.rwkv_prompt_len,
                     "prefill_tokens_per_s": args.rwkv_prompt_len / prefill_s, "prefill_peak_gib": peak_gib(device),
                     "note": f"one sequence per call; strategy {args.rwkv_strategy}"})
        for batch in args.rwkv_batch_sizes:
            reset_memory(device)
            first_s, decode_s, _ = timed_generation(lambda clock: decode(batch, args.rwkv_new_tokens, clock),
                                                    args.repeats, device)
            rows.append(decode_row(family, "rwkv", batch, args, first_s, decode_s, device,
                                   prompt_len=args.rwkv_prompt_len, new_tokens=args.rwkv_new_tokens,
                                   note="one sequence per call"))
    Path(out_path).write_text(json.dumps(rows))


def rwkv_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("rwkv") is not None


def transformers_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformers") is not None


def bench_rwkv(family: str, args, device) -> list[dict]:
    """The rwkv package in a subprocess: it reads RWKV_V7_ON / RWKV_JIT_ON / RWKV_CUDA_ON at import
    and keeps module-level state (one RWKV version per process)."""
    if family not in RWKV_FAMILIES:
        return [{"family": family, "lib": "rwkv", "kind": "note", "note": "the rwkv package runs RWKV models only"}]
    env = dict(os.environ, RWKV_JIT_ON="1", RWKV_CUDA_ON="1" if args.rwkv_cuda else "0")
    env.pop("RWKV_V7_ON", None)
    if family == "rwkv7":
        env["RWKV_V7_ON"] = "1"
    with tempfile.TemporaryDirectory() as folder:
        out_path = str(Path(folder) / "rows.json")
        command = [sys.executable, "-m", "bench.generate", "--rwkv-worker", family, "--worker-out", out_path,
                   *args.argv]
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S,
                                  cwd=REPO)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the rwkv package worker ran past {WORKER_TIMEOUT_S} s") from None
        if done.returncode != 0 or not Path(out_path).is_file():
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"the rwkv package worker failed (exit {done.returncode}): {' | '.join(tail)}")
        rows = json.loads(Path(out_path).read_text())
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


# ---- main -----------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--libs", default=",".join(LIBS),
                        help="flame, hf, fla and/or rwkv (hf, fla and rwkv are optional: skipped with a note when "
                             "missing)")
    parser.add_argument("--batch-sizes", default="1,8,64,256")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs after the warm-up (median)")
    parser.add_argument("--prefill-batch", type=int, default=8)
    parser.add_argument("--prefill-len", type=int, default=2048)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="flame's prefill and eval forward through the model's compiled blocks (default); "
                             "--no-compile: eagerly")
    parser.add_argument("--rwkv-strategy", default=None,
                        help="the rwkv package's strategy (default: 'cuda bf16', 'cpu fp32' with --device cpu)")
    parser.add_argument("--rwkv-cuda", action="store_true",
                        help="RWKV_CUDA_ON=1: the package compiles its CUDA kernels at import (needs nvcc and ninja; "
                             "its RWKV7 decoding runs without them either way)")
    parser.add_argument("--rwkv-batch-sizes", default="1,8",
                        help="batch sizes measured for the rwkv package (one call per sequence and token)")
    parser.add_argument("--rwkv-new-tokens", type=int, default=64)
    parser.add_argument("--rwkv-prompt-len", type=int, default=128,
                        help="the rwkv package's prompt (its prefill walks the tokens one by one without RWKV_CUDA_ON)")
    parser.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a smoke run, with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model instead of the 340M configs (a smoke run)")
    parser.add_argument("--profile", action="store_true",
                        help="print the kernels of one flame decoding step at the first batch size (torch.profiler)")
    parser.add_argument("--out", help="write every row as JSON here")
    parser.add_argument("--rwkv-worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = [a for a in (sys.argv[1:] if argv is None else argv)]
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.rwkv_batch_sizes = [int(b) for b in args.rwkv_batch_sizes.split(",")]
    if args.rwkv_strategy is None:
        args.rwkv_strategy = "cuda bf16" if args.device.startswith("cuda") else "cpu fp32"
    return args


def print_tables(results: list[dict]) -> None:
    fmt = lambda v, spec: "" if v is None else format(v, spec)  # noqa: E731
    print("\n| model | lib | batch | decode tokens/s | ms/step | graph step ms | peak GiB | note |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        if r.get("kind") == "decode":
            note = r.get("note", "") or ("" if r.get("graphed", True) else "not graphed")
            print(f"| {r['model']} | {r['lib']} | {r['batch']} | {r['decode_tokens_per_s']:,.0f} | "
                  f"{r['ms_per_step']:.2f} | {fmt(r.get('graph_step_ms'), '.3f')} | {fmt(r['peak_gib'], '.2f')} | "
                  f"{note} |")
    print("\n| model | lib | prefill tokens | prefill tokens/s | eval tokens/s | peak GiB | note |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        if r.get("kind") == "prefill":
            print(f"| {r['model']} | {r['lib']} | {r['batch']} x {r['seq_len']} | "
                  f"{r['prefill_tokens_per_s']:,.0f} | {fmt(r.get('eval_tokens_per_s'), ',.0f')} | "
                  f"{fmt(r.get('prefill_peak_gib'), '.2f')} | {r.get('note', '')} |")
    notes = [r for r in results if r.get("kind") in ("error", "note")]
    if notes:
        print()
        for r in notes:
            print(f"- {r['family']}/{r['lib']}: {r.get('error') or r.get('note')}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from bench.timing import fla_available, require_cuda, versions

    device = torch.device(args.device)
    if args.rwkv_worker:
        rwkv_worker(args.rwkv_worker, args, args.worker_out)
        return 0
    if device.type == "cuda":
        require_cuda("bench.generate", "--device cpu --tiny runs a smoke check")
    if args.new_tokens < 2 or args.rwkv_new_tokens < 2:
        print("--new-tokens and --rwkv-new-tokens must be >= 2 (the decoding rate is measured beyond the first "
              "token)", file=sys.stderr)
        return 1
    libs = args.libs.split(",")
    unknown = [lib for lib in libs if lib not in LIBS]
    if unknown:
        print(f"unknown --libs {unknown}: expected some of {', '.join(LIBS)}", file=sys.stderr)
        return 1

    results: list[dict] = []
    for lib, available, hint in (("hf", transformers_available, "pip install transformers"),
                                 ("fla", fla_available, "pip install flash-linear-attention==0.6.0"),
                                 ("rwkv", rwkv_available, "pip install rwkv")):
        if lib in libs and not available():
            note = f"{lib} is not installed: skipped ({hint})"
            print(note, flush=True)
            results.append({"family": "-", "lib": lib, "kind": "note", "note": note})
            libs.remove(lib)
    print(f"# {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, {versions()}", flush=True)
    benches = {"flame": bench_flame, "hf": bench_hf, "fla": bench_fla, "rwkv": bench_rwkv}
    started = time.perf_counter()
    for family in args.families.split(","):
        for lib in libs:
            try:
                results += benches[lib](family, args, device)
            except Exception as err:  # one library failing on one family does not stop the others
                message = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
                print(f"{family}/{lib}: {message}", flush=True)
                results.append({"family": family, "lib": lib, "kind": "error", "error": message})
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    print_tables(results)
    print(f"\n{time.perf_counter() - started:.0f} s", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
