"""Language-model metrics of a trained model on a local text file: loss, perplexity, bits per byte.

    python -m flame.eval --model DIR --data FILE [--seq-len N] [--batch-size B] [--max-tokens M] [--no-compile]

FILE is a .txt file (one document) or a .jsonl file (one document per line, in a "text" field),
read and tokenized the way the trainer reads its data: the token stream `EOD d0 EOD d1 EOD ...`.
Every token after the first is predicted once, in non-overlapping windows of seq_len tokens that
each start from an empty state (the trainer's validation loss on the same windows). Bits per byte
divide the total cross-entropy by ln 2 and by the UTF-8 bytes of the text whose tokens were
predicted, which makes models with different tokenizers comparable.

The windows run batch_size at a time through the chunked kernels and the fused LM-head loss (the
model's forward with labels: no [tokens, vocab] logits), with the blocks compiled as the trainer
compiles them (flame.inference.compiled; on CUDA, unless --no-compile), at the speed of the training
step's forward; a progress line on stderr shows the tokens done and the tokens per second.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from flame.inference.compiled import compiled_blocks
from flame.config.torch_types import resolve_device
from flame.inference.load import InferenceError, load_for_inference, resolve_dtype, run_command
from flame.ops.utils.checks import value_checks_off


def lm_metrics(total_nats: float, num_tokens: int, num_bytes: int) -> dict[str, float]:
    """loss (mean nats per predicted token), perplexity exp(loss) and bits per byte
    (total_nats / ln 2 / num_bytes) of `num_tokens` predictions over `num_bytes` bytes of text."""
    if num_tokens <= 0:
        raise ValueError(f"no predicted tokens to average over (num_tokens = {num_tokens})")
    if num_bytes <= 0:
        raise ValueError(f"the evaluated text has no bytes (num_bytes = {num_bytes})")
    loss = total_nats / num_tokens
    return {"loss": loss, "perplexity": math.exp(loss), "bits_per_byte": total_nats / math.log(2) / num_bytes,
            "tokens": num_tokens, "bytes": num_bytes}


def read_documents(path: str, tokenizer, text_field: str = "text"):
    """(stream, offsets, doc_bytes) of a local .txt / .jsonl file: the token stream
    `EOD d0 EOD d1 ...`, document i's tokens (its EOD included) at stream[1 + offsets[i]:1 +
    offsets[i+1]], and the UTF-8 byte length of each document's text."""
    from flame.data.sources import file_type, load_documents
    from flame.data.tokens import build_stream, tokenize_documents

    if file_type(path) not in ("json", "text"):
        raise InferenceError(f"--data {path}: expected a .txt or .jsonl file")
    ds, field, _ = load_documents(path, text_field=text_field)
    tokens, offsets = tokenize_documents(ds, field, tokenizer)
    stream = build_stream(tokens, offsets, np.arange(len(offsets) - 1), tokenizer.eod_id)
    doc_bytes = np.array([len(text.encode("utf-8")) for text in ds[field]], dtype=np.int64)
    return stream, offsets, doc_bytes


def predicted_bytes(stream: np.ndarray, offsets: np.ndarray, doc_bytes: np.ndarray, num_tokens: int,
                    tokenizer) -> int:
    """UTF-8 bytes of the text of the first `num_tokens` predicted tokens (stream[1:num_tokens+1]):
    every whole document's bytes, plus the decoded text of a document cut short."""
    whole = int(np.searchsorted(offsets, num_tokens, side="right")) - 1  # documents ending by num_tokens
    total = int(doc_bytes[:whole].sum())
    if offsets[whole] < num_tokens:
        cut = stream[1 + offsets[whole]:1 + num_tokens].tolist()
        total += len(tokenizer.decode(cut).encode("utf-8"))
    return total


class Progress:
    """A progress line on a text stream (stderr by default), rewritten in place: batches and tokens
    done, tokens per second. `out=None` shows nothing."""

    def __init__(self, total_tokens: int, out=sys.stderr):
        self.total, self.out = total_tokens, out
        self.start = time.perf_counter()

    def update(self, done_tokens: int, batches: int, total_batches: int) -> None:
        if self.out is None:
            return
        rate = done_tokens / max(time.perf_counter() - self.start, 1e-9)
        end = "\n" if batches == total_batches else ""
        self.out.write(f"\rflame.eval: batch {batches}/{total_batches} | {done_tokens}/{self.total} tokens | "
                       f"{rate:,.0f} tokens/s{end}")
        self.out.flush()


@torch.no_grad()
def cross_entropy_of_stream(model, stream: np.ndarray, num_tokens: int, seq_len: int, batch_size: int,
                            progress=None, compile=True) -> float:
    """Total cross-entropy (nats, summed in fp64) of stream[1:num_tokens+1] predicted from
    stream[:num_tokens] in windows of seq_len tokens, batch_size windows per forward (the model's
    fused loss); `progress` (a Progress) is updated after each batch.

    compile (True, False or a torch.compile backend: flame.inference.compiled): the full batches, all
    of one shape [batch_size, seq_len], run through the model's compiled blocks; a last batch of
    fewer windows and the short last window run eagerly (no graph compiled for one call)."""
    device = model.embeddings.weight.device
    ids = torch.from_numpy(stream[:num_tokens + 1].astype(np.int64))
    full = num_tokens // seq_len
    inputs = ids[:full * seq_len].view(full, seq_len)
    labels = ids[1:full * seq_len + 1].view(full, seq_len)
    batches = [(inputs[i:i + batch_size], labels[i:i + batch_size]) for i in range(0, full, batch_size)]
    if num_tokens % seq_len:
        batches.append((ids[full * seq_len:num_tokens][None], ids[full * seq_len + 1:][None]))
    total = torch.zeros((), dtype=torch.float64, device=device)
    done = 0
    with value_checks_off():
        for i, (x, y) in enumerate(batches):
            with compiled_blocks(model, compile if x.shape == (batch_size, seq_len) else False):
                total += model(x.to(device, non_blocking=True), labels=y.to(device, non_blocking=True)).double()
            done += y.numel()
            if progress is not None:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)  # the rate counts finished work, not queued work
                progress.update(done, i + 1, len(batches))
    return float(total)


def evaluate(model, tokenizer, data: str, seq_len: int = 2048, batch_size: int = 8, max_tokens: int = 0,
             text_field: str = "text", progress_out=None, compile=True) -> dict[str, float]:
    """`lm_metrics` of `model` on the file `data`: at most max_tokens predicted tokens (0: all),
    plus the evaluation's `seconds` and `tokens_per_second` (the forwards only, not the reading
    and tokenizing; the first full batch's compilation included). progress_out: a text stream for
    the progress line (None: none). compile: see `cross_entropy_of_stream`."""
    if seq_len < 1 or batch_size < 1 or max_tokens < 0:
        raise InferenceError(f"seq_len and batch_size must be >= 1 and max_tokens >= 0, got {seq_len}, "
                             f"{batch_size}, {max_tokens}")
    stream, offsets, doc_bytes = read_documents(data, tokenizer, text_field)
    num_tokens = len(stream) - 1 if max_tokens == 0 else min(max_tokens, len(stream) - 1)
    start = time.perf_counter()
    nats = cross_entropy_of_stream(model, stream, num_tokens, seq_len, batch_size,
                                   Progress(num_tokens, progress_out), compile)
    seconds = time.perf_counter() - start
    metrics = lm_metrics(nats, num_tokens, predicted_bytes(stream, offsets, doc_bytes, num_tokens, tokenizer))
    return {**metrics, "seconds": seconds, "tokens_per_second": num_tokens / max(seconds, 1e-9)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m flame.eval",
        description="Loss (nats/token), perplexity and bits per byte of a trained flame model on a local "
                    ".txt or .jsonl file.",
    )
    parser.add_argument("--model", required=True,
                        help="an exported Hugging Face folder, or a run's dump folder, checkpoint folder or step-N folder")
    parser.add_argument("--data", required=True, help="a .txt file, or a .jsonl file with a text field per line")
    parser.add_argument("--text-field", default="text", help="the .jsonl field holding the text (default: text)")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per evaluation window (default 2048)")
    parser.add_argument("--batch-size", type=int, default=8, help="windows per forward (default 8)")
    parser.add_argument("--max-tokens", type=int, default=0, help="evaluate at most this many tokens (0: all)")
    parser.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="auto: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="run the full batches through the model's blocks compiled with torch.compile, on "
                             "CUDA (default; the first batch waits for the compilation); --no-compile: eagerly")
    return parser.parse_args(argv)


def run(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.seq_len < 1 or args.batch_size < 1 or args.max_tokens < 0:
        raise InferenceError("--seq-len and --batch-size must be >= 1 and --max-tokens >= 0")
    if not Path(args.data).is_file():
        raise InferenceError(f"--data {args.data} is not a file")
    device = resolve_device(args.device, "--device")
    model, tokenizer = load_for_inference(args.model, device, resolve_dtype(args.dtype, device))
    m = evaluate(model, tokenizer, args.data, args.seq_len, args.batch_size, args.max_tokens, args.text_field,
                 progress_out=sys.stderr, compile=args.compile)
    print(f"loss {m['loss']:.4f} nats/token | perplexity {m['perplexity']:.3f} | "
          f"bits per byte {m['bits_per_byte']:.4f} | {m['tokens']} tokens, {m['bytes']} bytes | "
          f"{m['tokens_per_second']:,.0f} tokens/s")


def main(argv: list[str] | None = None) -> int:
    return run_command("flame.eval", run, argv)

