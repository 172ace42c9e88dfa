"""Text generation: the prompts run once through the chunked kernels (prompts of different lengths
packed into one call), then each new token advances the recurrent state by one decoding step over
static buffers, replayed as one CUDA graph on CUDA (flame.inference.decoder); the sampling runs on
the device and the host never waits for a token.

    python -m flame.generate --model DIR --prompt TEXT [--max-new-tokens N] [--temperature T]
        [--top-p P] [--top-k K] [--repetition-penalty R] [--seed S] [--device D] [--dtype D]

prints the continuation only, as it is decoded (in chunks of a few tokens). From Python:

    from flame.inference import generate
    new_ids = generate(model, prompt="To be", tokenizer=tok, max_new_tokens=32, temperature=0)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch

from flame.inference.decoder import decoder_for, prefill
from flame.config.torch_types import resolve_device
from flame.inference.load import InferenceError, load_for_inference, resolve_dtype, run_command
from flame.ops.utils.checks import value_checks_off

PROMPT_CONTEXT_TOKENS = 4
"""Prompt tokens the streaming decoder keeps in front of the first new token, so that a tokenizer
that spells a leading space from context (SentencePiece's "▁") prints it."""

STREAM_EVERY = 8
"""New tokens per chunk handed to `stream` and per check of the stop tokens: the host reads the
device once per chunk, one chunk behind, so it never waits on the token being computed."""


def check_sampling(max_new_tokens: int, temperature: float, top_p: float, top_k: int,
                   repetition_penalty: float = 1.0) -> None:
    """Raise InferenceError naming the first setting out of range."""
    if max_new_tokens < 1:
        raise InferenceError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not temperature >= 0 or temperature == float("inf"):
        raise InferenceError(f"temperature must be a finite number >= 0 (0 is greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise InferenceError(f"top_p must be in (0, 1] (1 keeps every token), got {top_p}")
    if top_k < 0:
        raise InferenceError(f"top_k must be >= 0 (0 keeps every token), got {top_k}")
    if not 0 < repetition_penalty < float("inf"):
        raise InferenceError(f"repetition_penalty must be a finite number > 0 (1 is off), got {repetition_penalty}")


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
                generator: torch.Generator | None, seen: torch.Tensor | None = None,
                repetition_penalty: float = 1.0) -> torch.Tensor:
    """The next token [B] from the last position's logits [B, V], on their device, with no host sync.

    repetition_penalty p != 1 (with `seen` [B, V] bool, the tokens of each row so far) divides the
    positive logits of seen tokens by p and multiplies the negative ones by p (the usual CTRL
    penalty). Then: argmax at temperature 0; else a draw from softmax(logits / temperature)
    restricted to the top_k most likely tokens (0: all) and to the smallest set of them whose
    probability reaches top_p (the most likely one always stays). The draw is argmax(probs / E)
    with E ~ Exp(1) from `generator` (an exact sample of probs, without torch.multinomial's sync).
    """
    if repetition_penalty != 1 and seen is not None:
        logits = logits.float()
        penalised = torch.where(logits > 0, logits / repetition_penalty, logits * repetition_penalty)
        logits = torch.where(seen, penalised, logits)
    if temperature == 0:
        return logits.argmax(dim=-1)  # exact in the logits' own dtype
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # probability of the more likely tokens
        sorted_logits = sorted_logits.masked_fill(before >= top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    race = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(torch.finfo(probs.dtype).tiny)
    return (probs / race).argmax(dim=-1)


def _as_prompts(model, input_ids, prompt, tokenizer) -> list[torch.Tensor] | torch.Tensor:
    """The prompts on the model's device: one [B, T] tensor, or a list of B 1-D tensors of any
    lengths."""
    if (input_ids is None) == (prompt is None):
        raise ValueError("generate takes either input_ids or prompt (with its tokenizer)")
    if prompt is not None:
        if tokenizer is None:
            raise ValueError("generate(prompt=...) needs the tokenizer that encodes it")
        ids = tokenizer.encode(prompt)
        if not ids:
            raise InferenceError("the prompt is empty: it encodes to no tokens")
        input_ids = torch.tensor([ids])
    device = model.embeddings.weight.device
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be [batch, prompt_len >= 1], got shape {tuple(input_ids.shape)}")
        return input_ids.to(device)
    prompts = [torch.as_tensor(ids, dtype=torch.long, device=device) for ids in input_ids]
    if not prompts or any(p.dim() != 1 or p.numel() == 0 for p in prompts):
        raise ValueError("input_ids must be a [batch, prompt_len] tensor or a list of non-empty token-id lists")
    if len({p.numel() for p in prompts}) == 1:
        return torch.stack(prompts)
    return prompts


def _seen_tokens(prompts, vocab: int, device) -> torch.Tensor:
    """[B, V] bool: the tokens each prompt holds (for the repetition penalty)."""
    if isinstance(prompts, torch.Tensor):
        return torch.zeros(prompts.shape[0], vocab, dtype=torch.bool, device=device).scatter_(1, prompts, True)
    rows = torch.repeat_interleave(torch.arange(len(prompts), device=device),
                                   torch.tensor([p.numel() for p in prompts], device=device))
    seen = torch.zeros(len(prompts), vocab, dtype=torch.bool, device=device)
    seen[rows, torch.cat(prompts)] = True
    return seen


class _Chunks:
    """The new tokens handed to the host in chunks, without a per-token sync: every `every`
    tokens the chunk and the step at which the last row stopped are copied into host memory
    asynchronously (pinned, on CUDA), and read one chunk later, when that copy has landed."""

    def __init__(self, out: torch.Tensor, finished_at: torch.Tensor | None, stream, every: int):
        self.out, self.finished_at, self.stream, self.every = out, finished_at, stream, every
        self.cuda = out.device.type == "cuda"
        self.reading = stream is not None or finished_at is not None  # else nothing is copied out
        self.start = 0          # the first token not yet copied out
        self.in_flight = None   # the chunk copied last, not yet read
        self.stopped_at = None  # the number of tokens to keep, once every row has stopped

    def _copy(self, end: int) -> tuple:
        """(start, host tokens, host step of the last row's stop or None, event) of out[:, start:end]."""
        tokens = torch.empty(self.out.shape[0], end - self.start, dtype=torch.long, pin_memory=self.cuda)
        tokens.copy_(self.out[:, self.start:end], non_blocking=True)
        last_stop = None
        if self.finished_at is not None:
            last_stop = torch.empty(1, dtype=torch.long, pin_memory=self.cuda)
            last_stop.copy_(self.finished_at.max().view(1), non_blocking=True)
        event = torch.cuda.Event() if self.cuda else None
        if event is not None:
            event.record()
        chunk, self.start = (self.start, tokens, last_stop, event), end
        return chunk

    def _read(self, chunk: tuple) -> None:
        start, tokens, last_stop, event = chunk
        if event is not None:
            event.synchronize()
        if self.stopped_at is not None:
            return
        n = tokens.shape[1]
        if last_stop is not None and int(last_stop) < self.out.shape[1]:  # every row has stopped
            self.stopped_at = int(last_stop) + 1
            n = max(0, min(n, self.stopped_at - start))
        if self.stream is not None and n:
            self.stream(tokens[:, :n])

    def after(self, steps: int) -> bool:
        """Called once `steps` tokens are in `out`; True once every row is known to have stopped."""
        if self.reading and steps - self.start >= self.every:
            landed, self.in_flight = self.in_flight, self._copy(steps)
            if landed is not None:
                self._read(landed)
            if not self.cuda:  # a copy to the CPU has landed already
                self._read(self.in_flight)
                self.in_flight = None
        return self.stopped_at is not None

    def finish(self, steps: int) -> int:
        """Read what is left; returns the number of new tokens to keep."""
        if self.in_flight is not None:
            self._read(self.in_flight)
            self.in_flight = None
        if self.reading and self.stopped_at is None and steps > self.start:
            self._read(self._copy(steps))
        return steps if self.stopped_at is None else min(steps, self.stopped_at)


@torch.no_grad()
def generate(model, input_ids: torch.Tensor | list[list[int]] | None = None, *, prompt: str | None = None,
             tokenizer=None, max_new_tokens: int = 64, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
             repetition_penalty: float = 1.0, seed: int | None = None,
             eos_token_id: int | list[int] | None = None, stream: Callable[[torch.Tensor], None] | None = None,
             stream_every: int = STREAM_EVERY, graph: bool | None = None) -> torch.Tensor:
    """The new tokens [B, n] (n <= max_new_tokens) that `model` (a flame CausalLM) appends to
    `input_ids`: a tensor [B, T] of B prompts of T tokens, or a list of B token-id lists of any
    lengths (packed into one prefill, then decoded together); or to `prompt` encoded by
    `tokenizer` (B = 1).

    temperature 0 is greedy decoding; otherwise tokens are drawn with top_k / top_p filtering
    (`sample_next`) from a torch.Generator seeded with `seed` (None: a random seed), on the
    model's device, so a seed reproduces its text on the same device. repetition_penalty != 1
    penalises every token of the row's prompt and continuation so far.

    eos_token_id (one id or several): a row that produces one of them has stopped and repeats
    that token from then on; generation ends once every row has (checked every `stream_every`
    tokens, one chunk late, so up to 2 * stream_every extra steps may run; n counts up to the
    last row's stop). `stream(tokens [B, k])` receives the new tokens on the host in chunks of
    `stream_every` as they are decoded. graph: replay the decoding step as a CUDA graph (default:
    on CUDA; flame.inference.decoder).
    """
    check_sampling(max_new_tokens, temperature, top_p, top_k, repetition_penalty)
    if stream_every < 1:
        raise ValueError(f"stream_every must be >= 1, got {stream_every}")
    prompts = _as_prompts(model, input_ids, prompt, tokenizer)
    device = model.embeddings.weight.device
    generator = None
    if temperature > 0:
        generator = torch.Generator(device=device)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)

    with value_checks_off():
        logits, state = prefill(model, prompts)
    B, vocab = logits.shape
    seen = _seen_tokens(prompts, vocab, device) if repetition_penalty != 1 else None
    stops = None
    if eos_token_id is not None:
        stops = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), device=device)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    finished_at = torch.full((B,), max_new_tokens, dtype=torch.long, device=device) if stops is not None else None
    out = torch.empty(B, max_new_tokens, dtype=torch.long, device=device)
    chunks = _Chunks(out, finished_at, stream, stream_every)
    decoder, token, steps = None, None, 0
    for step in range(max_new_tokens):
        if step > 0:
            if decoder is None:
                decoder = decoder_for(model, B, graph=graph)
                decoder.load(state)
                del state
            decoder.tokens.copy_(token)
            logits = decoder.step()
        choice = sample_next(logits, temperature, top_p, top_k, generator, seen, repetition_penalty)
        if stops is not None:
            if token is not None:
                choice = torch.where(finished, token, choice)
            stopping = (choice[:, None] == stops).any(dim=-1) & ~finished
            finished_at.masked_fill_(stopping, step)
            finished |= stopping
        token = choice
        out[:, step] = token
        if seen is not None:
            seen.scatter_(1, token[:, None], True)
        steps = step + 1
        if chunks.after(steps):
            break
    return out[:, :chunks.finish(steps)]


class TextStream:
    """Writes the text of token ids as they arrive, whole characters only.

    A character can span several byte-level tokens, and a tokenizer can spell a token differently
    after other tokens; each new token is decoded together with the tokens of the last write,
    and the text beyond theirs is written once it no longer ends in an incomplete character.
    """

    def __init__(self, tokenizer, out=None, context: list[int] = ()):
        self.tokenizer = tokenizer
        self.out = out if out is not None else sys.stdout
        self.ids = list(context)
        self.prefix = 0              # the tokens decoded for context only start here
        self.read = len(self.ids)    # the tokens from here on are not written yet

    def add(self, token_id: int) -> None:
        self.ids.append(int(token_id))
        written = self.tokenizer.decode(self.ids[self.prefix:self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        if len(text) > len(written) and not text.endswith("\ufffd"):
            self.out.write(text[len(written):])
            self.out.flush()
            self.prefix, self.read = self.read, len(self.ids)

    def finish(self) -> None:
        """Write whatever is left (an incomplete character prints as U+FFFD) and a newline."""
        written = self.tokenizer.decode(self.ids[self.prefix:self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        self.out.write(text[len(written):] + "\n")
        self.out.flush()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m flame.generate",
        description="Continue a prompt with a trained flame model; prints the continuation as it is decoded.",
    )
    parser.add_argument("--model", required=True,
                        help="an exported Hugging Face folder, or a run's dump folder, checkpoint folder or step-N folder")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy decoding (default 1.0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1: off)")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the K most likely tokens (default 0: off)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="penalise the tokens seen so far (> 1 discourages repeats; default 1: off)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the sampler (default: random)")
    parser.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="auto: bfloat16 on CUDA, float32 on CPU")
    return parser.parse_args(argv)


def run(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    check_sampling(args.max_new_tokens, args.temperature, args.top_p, args.top_k, args.repetition_penalty)
    if not args.prompt:
        raise InferenceError("--prompt is empty")
    device = resolve_device(args.device, "--device")
    model, tokenizer = load_for_inference(args.model, device, resolve_dtype(args.dtype, device))
    prompt_ids = tokenizer.encode(args.prompt)
    if not prompt_ids:
        raise InferenceError("--prompt encodes to no tokens")
    text = TextStream(tokenizer, context=prompt_ids[-PROMPT_CONTEXT_TOKENS:])

    def show(tokens: torch.Tensor) -> None:
        for token in tokens[0].tolist():
            if token != tokenizer.eod_id:  # the end of the document ends the text, unprinted
                text.add(token)

    generate(model, torch.tensor([prompt_ids]), max_new_tokens=args.max_new_tokens,
             temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
             repetition_penalty=args.repetition_penalty, seed=args.seed, eos_token_id=tokenizer.eod_id, stream=show)
    text.finish()


def main(argv: list[str] | None = None) -> int:
    return run_command("flame.generate", run, argv)

