"""flame.generate: greedy decoding equals an argmax loop over full recomputes, seeded sampling is
reproducible, top-k / top-p keep the right tokens, the repetition penalty follows its formula,
stop tokens end each row on its own, tokens stream in chunks, streamed text is whole characters,
and the command line reports bad input in one line."""

from __future__ import annotations

import io
import runpy
import sys

import pytest
import torch

from flame.data.tokenizer import load_tokenizer
from flame.inference.generation import TextStream, generate, main, sample_next
from flame.inference.load import InferenceError
from tests.models.helpers import FAMILIES
from tests.models.test_decoding import trained_like


def argmax_by_recompute(model, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy continuation computed the slow way: a full forward over the whole text per token."""
    for _ in range(steps):
        ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_greedy_generate_equals_an_argmax_loop_over_full_recompute(family):
    model = trained_like(family)
    prompt = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(0))
    streamed = []
    new = generate(model, prompt, max_new_tokens=12, temperature=0, stream=streamed.append)
    assert new.shape == (2, 12)
    assert torch.equal(new, argmax_by_recompute(model, prompt, 12)[:, 11:])
    assert torch.equal(torch.cat(streamed, dim=1), new)


@torch.no_grad()
def test_prompts_of_different_lengths_decode_together_as_they_do_alone():
    model = trained_like("gsa")
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (5, 19, 1)]
    together = generate(model, prompts, max_new_tokens=6, temperature=0)
    for row, ids in enumerate(prompts):
        alone = generate(model, torch.tensor([ids]), max_new_tokens=6, temperature=0)
        assert torch.equal(together[row], alone[0]), f"prompt {row}"
    with pytest.raises(ValueError, match="non-empty"):
        generate(model, [[1, 2], []], max_new_tokens=2)


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy():
    model = trained_like("rwkv7")
    prompt = torch.randint(0, 256, (3, 5), generator=torch.Generator().manual_seed(1))
    draw = lambda seed, **kw: generate(model, prompt, max_new_tokens=16, seed=seed, **kw)  # noqa: E731
    assert torch.equal(draw(7, top_p=0.9), draw(7, top_p=0.9))
    assert not torch.equal(draw(7), draw(8))
    assert torch.equal(draw(3, top_k=1, temperature=1.5), generate(model, prompt, max_new_tokens=16, temperature=0))


def test_top_k_and_top_p_keep_exactly_the_most_likely_tokens():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = probs.log()
    generator = torch.Generator().manual_seed(0)

    def support(**kw):
        draws = {int(sample_next(logits, 1.0, generator=generator, **{"top_p": 1.0, "top_k": 0, **kw}))
                 for _ in range(300)}
        return draws

    assert support(top_k=2) == {1, 3}
    assert support(top_p=0.7) == {1, 3}       # 0.5 < 0.7, 0.5 + 0.3 reaches it
    assert support(top_p=0.81) == {1, 3, 2}
    assert support(top_p=0.01) == {1}         # the most likely token always stays
    assert support(top_k=3, top_p=0.6) == {1, 3}
    assert support() == {0, 1, 2, 3}
    assert torch.equal(sample_next(logits, 0.0, 0.5, 2, None), torch.tensor([1]))


def test_repetition_penalty_follows_its_formula():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.9]])
    seen = torch.tensor([[True, True, False, False]])
    assert int(sample_next(logits, 0.0, 1.0, 0, None)) == 0
    assert int(sample_next(logits, 0.0, 1.0, 0, None, seen, 2.0)) == 3  # 2.0 -> 1.0, below 1.9
    assert int(sample_next(-logits, 0.0, 1.0, 0, None, seen, 2.0)) == 1  # 1.0 -> 0.5 still leads; -2.0 -> -4.0

    model = trained_like("rwkv7")
    prompt = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(9))
    got = generate(model, prompt, max_new_tokens=20, temperature=0, repetition_penalty=1.3)
    with torch.no_grad():  # the reference: the CTRL penalty over prompt and continuation, on the host
        logits, state = model.forward_with_state(prompt, last_only=True)
        rows, want = [set(p.tolist()) for p in prompt], []
        for _ in range(20):
            scores = logits[:, -1].clone()
            for r, seen_r in enumerate(rows):
                for t in seen_r:
                    scores[r, t] = scores[r, t] / 1.3 if scores[r, t] > 0 else scores[r, t] * 1.3
            token = scores.argmax(-1)
            want.append(token)
            for r in range(2):
                rows[r].add(int(token[r]))
            logits, state = model.forward_with_state(token[:, None], state)
    assert torch.equal(got, torch.stack(want, dim=1))
    assert not torch.equal(got, generate(model, prompt, max_new_tokens=20, temperature=0))


def test_stop_tokens_end_each_row_on_its_own_and_tokens_stream_in_chunks():
    model = trained_like("gsa")
    prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (4, 9, 2)]
    greedy = generate(model, prompts, max_new_tokens=24, temperature=0)
    stops = [int(greedy[0, 3]), int(greedy[1, 10]), int(greedy[2, 6])]
    chunks = []
    ended = generate(model, prompts, max_new_tokens=24, temperature=0, eos_token_id=stops, stream=chunks.append,
                     stream_every=2)
    first = [next(i for i, t in enumerate(row.tolist()) if t in stops) for row in greedy]
    assert ended.shape[1] == max(first) + 1 < 24 and len(set(first)) > 1
    for row, stop in enumerate(first):
        assert torch.equal(ended[row, :stop + 1], greedy[row, :stop + 1])
        assert (ended[row, stop:] == greedy[row, stop]).all()  # a stopped row repeats its stop token
    assert torch.equal(torch.cat(chunks, dim=1), ended) and all(c.shape[1] <= 2 for c in chunks)
    chunks.clear()
    assert torch.equal(generate(model, prompts, max_new_tokens=7, temperature=0, stream=chunks.append,
                                stream_every=3), greedy[:, :7])
    assert [c.shape[1] for c in chunks] == [3, 3, 1]


def test_generation_stops_when_every_sequence_has_ended():
    model = trained_like("rwkv6")
    prompt = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(4))
    greedy = generate(model, prompt, max_new_tokens=10, temperature=0)
    eos = int(greedy[0, 2])
    ended = generate(model, prompt, max_new_tokens=10, temperature=0, eos_token_id=eos)
    first_eos = [int((row == eos).nonzero()[0]) if (row == eos).any() else 10 for row in greedy]
    assert ended.shape[1] == min(10, max(first_eos) + 1)
    for row, stop in enumerate(first_eos):
        n = min(stop + 1, ended.shape[1])
        assert torch.equal(ended[row, :n], greedy[row, :n])
        assert (ended[row, n:] == eos).all()


def test_generate_from_a_prompt_and_bad_settings():
    model = trained_like("gsa", vocab_size=8192)
    tokenizer = load_tokenizer("")
    new = generate(model, prompt="To be, or not", tokenizer=tokenizer, max_new_tokens=4, temperature=0)
    ids = torch.tensor([tokenizer.encode("To be, or not")])
    assert torch.equal(new, argmax_by_recompute(model, ids, 4)[:, ids.shape[1]:])
    for bad, match in (({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
                       ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"), ({"max_new_tokens": 0}, "max_new")):
        with pytest.raises(InferenceError, match=match):
            generate(model, ids, **{"max_new_tokens": 2, **bad})
    with pytest.raises(InferenceError, match="empty"):
        generate(model, prompt="", tokenizer=tokenizer)


def test_streamed_text_is_the_decoded_text_in_whole_characters():
    tokenizer = load_tokenizer("")
    prompt = tokenizer.encode("Hello")
    text = " wörld — 日本語 🙂 done\nnext line"
    ids = tokenizer.encode(text)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # some characters span several tokens
    out = Recorder()
    stream = TextStream(tokenizer, out, context=prompt[-4:])
    for i in ids:
        stream.add(i)
    stream.finish()
    assert out.getvalue() == tokenizer.decode(prompt + ids)[len(tokenizer.decode(prompt)):] + "\n"
    assert not any("\ufffd" in w for w in out.writes) and len(out.writes) > 5


class Recorder(io.StringIO):
    """A text stream that remembers each write."""

    def __init__(self):
        super().__init__()
        self.writes = []

    def write(self, s):
        self.writes.append(s)
        return super().write(s)


@pytest.mark.parametrize("argv, message", [
    (["--model", "/nonexistent/model", "--prompt", "hi"], "does not exist"),
    (["--model", ".", "--prompt", ""], "--prompt is empty"),
    (["--model", ".", "--prompt", "hi", "--temperature", "-0.5"], "temperature"),
    (["--model", ".", "--prompt", "hi", "--top-p", "1.5"], "top_p"),
    (["--model", ".", "--prompt", "hi", "--top-p", "0"], "top_p"),
    (["--model", ".", "--prompt", "hi", "--max-new-tokens", "0"], "max_new_tokens"),
])
def test_command_line_errors_are_one_line(argv, message, capsys):
    assert main(argv) != 0
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and message in captured.err and "Traceback" not in captured.err



def test_python_m_flame_generate_runs_the_command_line(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["flame.generate", "--model", "/nonexistent/model", "--prompt", "hi"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("flame.generate", run_name="__main__")
    assert exit_.value.code == 1
    assert capsys.readouterr().err.startswith("flame.generate: error: model folder /nonexistent/model does not exist")

def test_command_line_generates_from_a_trained_checkpoint(tmp_path, capsys):
    pytest.importorskip("flame.export")
    from flame.train.trainer import Trainer
    from tests.train.helpers import tiny_config

    Trainer(tiny_config(tmp_path, training={"steps": 2, "seq_len": 16},
                        checkpoint={"enable": True, "interval": 2})).train()
    capsys.readouterr()  # the trainer's log
    assert main(["--model", str(tmp_path), "--prompt", "To be, or not", "--temperature", "0",
                 "--max-new-tokens", "6", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out

    from flame.weights import load_model
    model = load_model(str(tmp_path))[0].float().eval()
    tokenizer = load_tokenizer("")
    ids = tokenizer.encode("To be, or not")
    new = generate(model, torch.tensor([ids]), max_new_tokens=6, temperature=0, eos_token_id=tokenizer.eod_id)
    new = [t for t in new[0].tolist() if t != tokenizer.eod_id]
    assert printed == tokenizer.decode(ids + new)[len(tokenizer.decode(ids)):] + "\n"
