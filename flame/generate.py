"""Text generation: the prompt runs once through the chunked kernels, then each new token advances
the recurrent state by one step (fused recurrent kernels: O(1) per token, the prompt is never read
again).

    python -m flame.generate --model DIR --prompt TEXT [--max-new-tokens N] [--temperature T]
        [--top-p P] [--top-k K] [--seed S] [--device D] [--dtype D]

prints the continuation only, as it is decoded. From Python:

    from flame.generate import generate
    new_ids = generate(model, prompt="To be", tokenizer=tok, max_new_tokens=32, temperature=0)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch

from flame.inference import InferenceError, load_for_inference, resolve_device, resolve_dtype, run_command, value_checks_off
from flame.models.state import concat_states

PROMPT_CONTEXT_TOKENS = 4
"""Prompt tokens the streaming decoder keeps in front of the first new token, so that a tokenizer
that spells a leading space from context (SentencePiece's "▁") prints it."""


def check_sampling(max_new_tokens: int, temperature: float, top_p: float, top_k: int) -> None:
    """Raise InferenceError naming the first setting out of range."""
    if max_new_tokens < 1:
        raise InferenceError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not temperature >= 0 or temperature == float("inf"):
        raise InferenceError(f"temperature must be a finite number >= 0 (0 is greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise InferenceError(f"top_p must be in (0, 1] (1 keeps every token), got {top_p}")
    if top_k < 0:
        raise InferenceError(f"top_k must be >= 0 (0 keeps every token), got {top_k}")


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
                generator: torch.Generator | None) -> torch.Tensor:
    """The next token [B] from the last position's logits [B, V]: argmax at temperature 0, else a
    draw from softmax(logits / temperature) restricted to the top_k most likely tokens (0: all)
    and to the smallest set of them whose probability reaches top_p (the most likely one always
    stays)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
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
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model, input_ids: torch.Tensor | None = None, *, prompt: str | None = None, tokenizer=None,
             max_new_tokens: int = 64, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
             seed: int | None = None, eos_token_id: int | None = None,
             stream: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    """The new tokens [B, n] (n <= max_new_tokens) that `model` (a flame CausalLM) appends to
    `input_ids`: a tensor [B, T] of B prompts of T tokens, or a list of B token-id lists of any
    lengths (each prefilled on its own, then decoded together); or to `prompt` encoded by
    `tokenizer` (B = 1).

    temperature 0 is greedy decoding; otherwise tokens are drawn with top_k / top_p filtering from
    a torch.Generator seeded with `seed` (None: a random seed), on the model's device, so a seed
    reproduces its text on the same device. `stream(tokens [B])` is called with every new token
    as it is chosen. With eos_token_id, a sequence that produced it keeps producing it, and
    generation stops once every sequence has.
    """
    check_sampling(max_new_tokens, temperature, top_p, top_k)
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
        input_ids = input_ids.to(device)
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be [batch, prompt_len >= 1], got shape {tuple(input_ids.shape)}")
        prompts = [input_ids]
    else:
        prompts = [torch.as_tensor(ids, dtype=torch.long, device=device)[None] for ids in input_ids]
        if not prompts or any(p.dim() != 2 or p.shape[1] == 0 for p in prompts):
            raise ValueError("input_ids must be a [batch, prompt_len] tensor or a list of non-empty token-id lists")
    generator = None
    if temperature > 0:
        generator = torch.Generator(device=device)
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)

    new_tokens = []
    with value_checks_off():
        prefilled = [model.forward_with_state(p, last_only=True) for p in prompts]
        logits = torch.cat([p[0] for p in prefilled], dim=0)
        state = prefilled[0][1] if len(prefilled) == 1 else concat_states([p[1] for p in prefilled])
        finished = torch.zeros(logits.shape[0], dtype=torch.bool, device=device)
        for step in range(max_new_tokens):
            token = sample_next(logits[:, -1], temperature, top_p, top_k, generator)
            if eos_token_id is not None:
                token = token.masked_fill(finished, eos_token_id)
                finished |= token == eos_token_id
            new_tokens.append(token)
            if stream is not None:
                stream(token)
            if step + 1 == max_new_tokens or (eos_token_id is not None and bool(finished.all())):
                break
            logits, state = model.forward_with_state(token[:, None], state)
    return torch.stack(new_tokens, dim=1)


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
    parser.add_argument("--seed", type=int, default=None, help="seed of the sampler (default: random)")
    parser.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="auto: bfloat16 on CUDA, float32 on CPU")
    return parser.parse_args(argv)


def run(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    check_sampling(args.max_new_tokens, args.temperature, args.top_p, args.top_k)
    if not args.prompt:
        raise InferenceError("--prompt is empty")
    device = resolve_device(args.device)
    model, tokenizer = load_for_inference(args.model, device, resolve_dtype(args.dtype, device))
    prompt_ids = tokenizer.encode(args.prompt)
    if not prompt_ids:
        raise InferenceError("--prompt encodes to no tokens")
    text = TextStream(tokenizer, context=prompt_ids[-PROMPT_CONTEXT_TOKENS:])

    def show(token: torch.Tensor) -> None:
        if int(token[0]) != tokenizer.eod_id:  # the end of the document ends the text, unprinted
            text.add(token[0])

    generate(model, torch.tensor([prompt_ids]), max_new_tokens=args.max_new_tokens,
             temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
             eos_token_id=tokenizer.eod_id, stream=show)
    text.finish()


def main(argv: list[str] | None = None) -> int:
    return run_command("flame.generate", run, argv)


if __name__ == "__main__":
    sys.exit(main())
