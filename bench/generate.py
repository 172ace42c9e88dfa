"""Generation throughput of the shipped 340M configs on one GPU: flame.generate against fla's.

    python bench/generate.py                                   # rwkv7, rwkv6, gsa; batch 1 and 64
    python bench/generate.py --families rwkv7 --batch-sizes 1 --libs flame

What it measures (CUDA GPU, bf16 weights, random initialisation, vocabulary 32000): each family's
`configs/<family>_340M.toml` model continues B random prompts of --prompt-len tokens by --new-tokens
greedy tokens, at every batch size of --batch-sizes. flame: `flame.generate.generate` (the prompt
through the chunked kernels once, then one fused recurrent step per token). fla (0.6, optional,
imported only when installed and asked for): the same family built by fla with the same shape,
through transformers' `generate` with fla's own recurrent cache, forced to the same length
(min_new_tokens).

Per family, library and batch size it reports the prefill time (a generation of one token), the
decoding throughput (new tokens of the whole batch per second after the prefill) and the
end-to-end throughput (new tokens per second including the prefill), from the median times of
--repeats runs after one untimed warm-up run (Triton compilation and autotuning), and the peak
memory. The prefill is timed as a generation of one token, the same way for both libraries.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

FAMILIES = ("rwkv7", "rwkv6", "gsa")
LIBS = ("flame", "fla")


def model_args(family: str):
    from flame.config import load_config

    return load_config(["--config", str(REPO / "configs" / f"{family}_340M.toml")]).model


def build_flame(family: str, device):
    import torch

    from flame.models import build_model

    args = model_args(family)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = build_model(args)
    model.to_empty(device=device)
    model.init_weights()
    return model.to(torch.bfloat16).eval(), args.vocab_size


def build_fla(family: str, device):
    """fla's model of the family, shaped like flame's config (the mapping of bench/train_step.py)."""
    import torch

    from bench.train_step import fla_model_factory

    args = model_args(family)
    torch.manual_seed(0)
    model = fla_model_factory(family)(args).inner
    return model.to(device=device, dtype=torch.bfloat16).eval(), args.vocab_size


def timed(fn, repeats: int, device) -> tuple[float, object]:
    """(median seconds of `repeats` calls after one warm-up call, the last result)."""
    import torch

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    result = fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        result = fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def bench_one(family: str, lib: str, batch_sizes: list[int], prompt_len: int, new_tokens: int,
              repeats: int, device) -> list[dict]:
    """The prefill is measured as a generation of one token, so both libraries are timed the same
    way: decoding throughput = batch * (new_tokens - 1) / (time of new_tokens - time of 1)."""
    import torch

    model, vocab = (build_flame if lib == "flame" else build_fla)(family, device)
    cuda = device.type == "cuda"
    rows = []
    for batch in batch_sizes:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        prompts = torch.randint(0, vocab, (batch, prompt_len), device=device,
                                generator=torch.Generator(device=device).manual_seed(batch))

        def run(n: int):
            with torch.no_grad():
                if lib == "flame":
                    from flame.generate import generate

                    return generate(model, prompts, max_new_tokens=n, temperature=0)
                return model.generate(prompts, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                      use_cache=True, pad_token_id=0)[:, prompt_len:]

        prefill_s, _ = timed(lambda: run(1), repeats, device)
        total_s, out = timed(lambda: run(new_tokens), repeats, device)
        if out.shape != (batch, new_tokens):
            raise RuntimeError(f"{family}/{lib}: generated shape {tuple(out.shape)}, expected {(batch, new_tokens)}")
        decode_s = max(total_s - prefill_s, 1e-9)
        rows.append({
            "family": family, "lib": lib, "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
            "prefill_ms": prefill_s * 1e3,
            "decode_tokens_per_s": batch * (new_tokens - 1) / decode_s,
            "ms_per_step": decode_s * 1e3 / (new_tokens - 1),
            "end_to_end_tokens_per_s": batch * new_tokens / total_s,
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan"),
        })
        print(json.dumps(rows[-1]), flush=True)
    return rows


def fla_available() -> bool:
    try:
        import fla  # noqa: F401
    except Exception:
        return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 2)[2])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--libs", default=",".join(LIBS),
                        help="flame and/or fla (fla and transformers are imported only for fla, and "
                             "skipped with a note when fla is not installed)")
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs after the warm-up (median)")
    parser.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a smoke check)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()

    import torch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench/generate.py needs a CUDA GPU (--device cpu runs a slow smoke check)", file=sys.stderr)
        return 1
    if args.new_tokens < 2:
        print("--new-tokens must be >= 2 (the decoding rate is measured beyond the first token)", file=sys.stderr)
        return 1
    libs = args.libs.split(",")
    if "fla" in libs and not fla_available():
        print("fla is not installed: measuring flame only", flush=True)
        libs.remove("fla")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    results = []
    for family in args.families.split(","):
        for lib in libs:
            try:
                results += bench_one(family, lib, batch_sizes, args.prompt_len, args.new_tokens, args.repeats,
                                     device)
            except Exception as err:  # one library failing on one family does not stop the others
                print(f"{family}/{lib}: {type(err).__name__}: {err}", flush=True)
                results.append({"family": family, "lib": lib, "error": f"{type(err).__name__}: {err}"})

    print()
    print("| model | lib | batch | prefill ms | decode tokens/s | ms/step | end-to-end tokens/s | peak GiB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['family']} | {r['lib']} | | error: {r['error'][:80]} | | | | |")
            continue
        print(f"| {r['family']} 340M | {r['lib']} | {r['batch']} | {r['prefill_ms']:.1f} | "
              f"{r['decode_tokens_per_s']:.0f} | {r['ms_per_step']:.2f} | {r['end_to_end_tokens_per_s']:.0f} | "
              f"{r['peak_gib']:.2f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
