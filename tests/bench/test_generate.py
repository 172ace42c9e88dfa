"""bench.generate's arithmetic and in-run timing, on CPU: the decoding rate comes from the time
between the mark after the first token and the end of the same generation, and a row whose
steps are faster than the decoding step's graph alone is flagged."""

from __future__ import annotations

import math
import time

import pytest
import torch

from bench import generate as bench_generate
from bench.generate import FirstLogitsMark, RunClock, decode_figures, marking_before, timed_generation

CPU = torch.device("cpu")


def test_decode_figures_are_the_rate_of_the_steps_after_the_first_token():
    figures = decode_figures(batch=4, new_tokens=33, decode_s=0.064, graph_step_ms=1.5)
    assert figures["decode_tokens_per_s"] == pytest.approx(4 * 32 / 0.064)
    assert figures["ms_per_step"] == pytest.approx(2.0)
    assert figures["graph_step_ms"] == 1.5
    assert figures["below_graph_step"] is False
    assert "note" not in figures


def test_a_rate_beyond_the_graph_step_is_flagged():
    """Issue 39's row: 7,937 tokens/s at batch 1 over 31 steps, with a graph step of 0.658 ms
    (at most ~1,520 tokens/s)."""
    decode_s = 31 / 7937
    figures = decode_figures(batch=1, new_tokens=32, decode_s=decode_s, graph_step_ms=0.658)
    assert figures["decode_tokens_per_s"] == pytest.approx(7937)
    assert figures["below_graph_step"] is True
    assert "timing error" in figures["note"] and "0.658" in figures["note"]
    at_the_limit = decode_figures(batch=1, new_tokens=32, decode_s=31 * 0.658e-3, graph_step_ms=0.658)
    assert at_the_limit["below_graph_step"] is False and "note" not in at_the_limit
    assert "below_graph_step" not in decode_figures(batch=1, new_tokens=32, decode_s=decode_s)


@pytest.mark.parametrize("decode_s", [0.0, -1e-3, math.nan, math.inf])
def test_a_decoding_time_that_is_no_duration_gives_no_rate(decode_s):
    figures = decode_figures(batch=2, new_tokens=8, decode_s=decode_s, graph_step_ms=1.0)
    assert math.isnan(figures["decode_tokens_per_s"]) and math.isnan(figures["ms_per_step"])
    assert "not a positive duration" in figures["note"]
    with pytest.raises(ValueError, match="new_tokens >= 2"):
        decode_figures(batch=2, new_tokens=1, decode_s=1.0)


def test_decode_row_joins_the_notes():
    class Args:
        prompt_len, new_tokens, tiny = 16, 32, True

    row = bench_generate.decode_row("rwkv7", "flame", 1, Args, 0.01, 31 / 7937, CPU, graph_step_ms=0.658,
                                    note="eager")
    assert row["prefill_ms"] == pytest.approx(10.0)
    assert row["note"].startswith("timing error") and row["note"].endswith("; eager")
    assert row["prompt_len"] == 16 and row["new_tokens"] == 32


def test_timed_generation_splits_each_run_at_its_first_token_mark():
    def run(clock):
        time.sleep(0.02)
        clock.mark()
        time.sleep(0.2)  # far from the prefill's 0.02 s, so that a loaded machine's late wake-ups cannot swap them
        return "tokens"

    prefill_s, decode_s, result = timed_generation(run, repeats=2, device=CPU)
    assert result == "tokens"
    assert 0.02 <= prefill_s < 0.2 <= decode_s

    for marks in (0, 2):
        with pytest.raises(RuntimeError, match=f"marked its first token {marks} times"):
            timed_generation(lambda clock, k=marks: [clock.mark() for _ in range(k)], repeats=1, device=CPU)


def test_marks_before_a_method_and_at_the_first_logits_only():
    class Loader:
        def load(self, state):
            return state + 1

    clock = RunClock(CPU)
    with marking_before(Loader, "load", clock):
        assert Loader().load(1) == 2
    assert Loader().load(1) == 2 and len(clock.marks) == 1

    processor = FirstLogitsMark(clock)
    scores = torch.ones(2, 3)
    for _ in range(3):
        assert processor(None, scores) is scores
    assert len(clock.marks) == 2


def test_flame_rows_on_a_tiny_model_time_one_mark_per_generation():
    """bench_flame on CPU: every generation passes Decoder.load once (else timed_generation
    raises), and the rows carry the graph-step comparison."""
    args = bench_generate.parse_args(["--device", "cpu", "--tiny", "--families", "rwkv7", "--libs", "flame",
                                      "--batch-sizes", "2", "--new-tokens", "4", "--repeats", "1",
                                      "--prompt-len", "8", "--prefill-len", "16", "--prefill-batch", "1",
                                      "--no-compile"])
    rows = bench_generate.bench_flame("rwkv7", args, CPU)
    decode = [r for r in rows if r["kind"] == "decode"]
    assert len(decode) == 1
    assert decode[0]["batch"] == 2 and decode[0]["prefill_ms"] > 0 and decode[0]["ms_per_step"] > 0
    assert isinstance(decode[0]["below_graph_step"], bool) and decode[0]["graph_step_ms"] > 0
