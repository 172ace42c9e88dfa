"""flame.eval: the metric formulas, the windowed cross-entropy and byte count against a hand
computation on a small .jsonl / .txt file (one window at a time through the logits, as eval ran
before it batched the windows through the fused loss), the progress line, and one-line
command-line errors."""

from __future__ import annotations

import io
import json
import math
import runpy
import sys

import pytest
import torch

from flame.data.tokenizer import load_tokenizer
from flame.inference.evaluation import evaluate, lm_metrics, main
from tests.models.test_decoding import trained_like

DOCS = ["To be, or not to be: that is the question.", "Überall — 日本語 🙂 and more words here", "Short."]


def write_jsonl(tmp_path, docs: list[str]) -> str:
    """A docs.jsonl file in tmp_path, one {"text": doc} per line; returns its path."""
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return str(data)


def test_metrics_are_the_usual_formulas():
    m = lm_metrics(total_nats=6.0, num_tokens=3, num_bytes=4)
    assert m["loss"] == 2.0
    assert m["perplexity"] == pytest.approx(math.exp(2.0), rel=1e-12)
    assert m["bits_per_byte"] == pytest.approx(6.0 / math.log(2) / 4, rel=1e-12)
    assert (m["tokens"], m["bytes"]) == (3, 4)
    with pytest.raises(ValueError, match="no predicted tokens"):
        lm_metrics(1.0, 0, 4)
    with pytest.raises(ValueError, match="no bytes"):
        lm_metrics(1.0, 3, 0)


def hand_cross_entropy(model, stream: list[int], num_tokens: int, seq_len: int) -> float:
    """Sum of -log p(next token), one window of seq_len tokens at a time."""
    total = 0.0
    for start in range(0, num_tokens, seq_len):
        end = min(start + seq_len, num_tokens)
        logp = torch.log_softmax(model(torch.tensor([stream[start:end]]))[0].double(), dim=-1)
        total -= sum(logp[i, stream[start + i + 1]].item() for i in range(end - start))
    return total


@torch.no_grad()
def test_evaluate_matches_a_hand_computation(tmp_path):
    tokenizer = load_tokenizer("")
    model = trained_like("rwkv7", vocab_size=tokenizer.vocab_size)
    data = write_jsonl(tmp_path, DOCS)
    eod = tokenizer.eod_id
    stream = [eod]
    for d in DOCS:
        stream += tokenizer.encode(d) + [eod]

    m = evaluate(model, tokenizer, data, seq_len=7, batch_size=2)
    n = len(stream) - 1
    assert m["tokens"] == n and n % 7  # a short last window too
    assert m["bytes"] == sum(len(d.encode("utf-8")) for d in DOCS)
    assert m["loss"] * n == pytest.approx(hand_cross_entropy(model, stream, n, 7), rel=1e-5)

    # cut inside the second document: its predicted tokens' text counts, nothing after it
    first = len(tokenizer.encode(DOCS[0])) + 1
    cut = first + 5
    m = evaluate(model, tokenizer, data, seq_len=4, batch_size=3, max_tokens=cut)
    assert m["tokens"] == cut
    second = tokenizer.decode(tokenizer.encode(DOCS[1])[:5]).encode("utf-8")
    assert m["bytes"] == len(DOCS[0].encode("utf-8")) + len(second)
    assert m["loss"] * cut == pytest.approx(hand_cross_entropy(model, stream, cut, 4), rel=1e-5)

    text = tmp_path / "play.txt"
    text.write_text(DOCS[1], encoding="utf-8")
    m = evaluate(model, tokenizer, str(text), seq_len=16)
    assert m["bytes"] == len(DOCS[1].encode("utf-8"))
    assert m["tokens"] == len(tokenizer.encode(DOCS[1])) + 1


@pytest.mark.parametrize("family", ["rwkv6", "gsa"])
@torch.no_grad()
def test_batched_windows_equal_one_window_at_a_time(tmp_path, family):
    tokenizer = load_tokenizer("")
    model = trained_like(family, vocab_size=tokenizer.vocab_size)
    data = write_jsonl(tmp_path, DOCS * 3)
    progress = io.StringIO()
    batched = evaluate(model, tokenizer, data, seq_len=9, batch_size=4, progress_out=progress)
    single = evaluate(model, tokenizer, data, seq_len=9, batch_size=1)
    assert batched["tokens"] == single["tokens"] and batched["tokens"] % 9
    assert batched["loss"] == pytest.approx(single["loss"], rel=1e-6)
    stream = [tokenizer.eod_id]
    for d in DOCS * 3:
        stream += tokenizer.encode(d) + [tokenizer.eod_id]
    n = batched["tokens"]
    assert batched["loss"] * n == pytest.approx(hand_cross_entropy(model, stream, n, 9), rel=1e-5)
    assert batched["tokens_per_second"] > 0
    batches = -(-(n // 9) // 4) + 1  # full windows four at a time, then the short last window
    line = progress.getvalue().split("\r")[-1]
    assert line.startswith(f"flame.eval: batch {batches}/{batches} | {n}/{n} tokens |") and line.endswith("tokens/s\n")


@pytest.mark.parametrize("argv, message", [
    (["--model", "/nonexistent/model", "--data", __file__.replace(".py", ".txt")], "is not a file"),
    (["--model", "/nonexistent/model", "--data", __file__], "does not exist"),
    (["--model", ".", "--data", __file__, "--seq-len", "0"], "--seq-len"),
])
def test_command_line_errors_are_one_line(argv, message, capsys):
    assert main(argv) != 0
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and message in captured.err and "Traceback" not in captured.err



def test_python_m_flame_eval_runs_the_command_line(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["flame.eval", "--model", "/nonexistent/model", "--data", __file__])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("flame.eval", run_name="__main__")
    assert exit_.value.code == 1
    assert capsys.readouterr().err.startswith("flame.eval: error: model folder /nonexistent/model does not exist")

def test_command_line_evaluates_a_trained_checkpoint(tmp_path, capsys):
    pytest.importorskip("flame.export")
    from flame.weights import load_model
    from flame.train.trainer import Trainer
    from tests.train.helpers import tiny_config

    Trainer(tiny_config(tmp_path / "run", training={"steps": 2, "seq_len": 16},
                        checkpoint={"enable": True, "interval": 2})).train()
    capsys.readouterr()  # the trainer's log
    data = write_jsonl(tmp_path, DOCS)
    assert main(["--model", str(tmp_path / "run"), "--data", data, "--seq-len", "8",
                 "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    model = load_model(str(tmp_path / "run"))[0].float().eval()
    m = evaluate(model, load_tokenizer(""), data, seq_len=8)
    assert printed.startswith(f"loss {m['loss']:.4f} nats/token | perplexity {m['perplexity']:.3f} | "
                              f"bits per byte {m['bits_per_byte']:.4f}")
