"""The compiled inference forward (flame.inference.compiled) of flame.eval and of prefill.

On CPU the blocks are traced by Dynamo with a counting backend that runs the traced graphs as they
are (no code generation): the compiled path gives the eager results exactly, and a count of the
compiled frames shows that new prompt lengths and ragged eval batches compile nothing new. Inductor
itself runs in the GPU-marked test. On CPU, the default (Inductor) falls back to eager."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from flame.data.tokenizer import load_tokenizer
from flame.inference import decoder
from flame.inference.compiled import compilation_failed, compile_supported, compiled_blocks
from flame.inference.decoder import prefill
from flame.inference.evaluation import evaluate
from flame.ops.utils.checks import value_checks_off
from tests.inference.test_eval import DOCS, write_jsonl
from tests.models.helpers import FAMILIES
from tests.models.test_decoding import trained_like

SEGMENT = 16


@pytest.fixture(autouse=True)
def fresh_dynamo(monkeypatch):
    """Each test starts with no compiled code and a prefill segment of SEGMENT tokens; reaching
    Dynamo's recompile limit is an error (not a silent fall back to eager, which would compile
    nothing new either)."""
    torch._dynamo.reset()
    monkeypatch.setattr(decoder, "PREFILL_SEGMENT", SEGMENT)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        yield
    torch._dynamo.reset()


def state_tensors(state) -> list[torch.Tensor | None]:
    """Every field of every layer's state, in one list (None for an unset field)."""
    out = []
    for layer in state:
        recurrent = layer.recurrent if isinstance(layer.recurrent, tuple) else (layer.recurrent,)
        out += [layer.attn_shift, layer.ffn_shift, *recurrent]
    return out


def assert_states_equal(got, expected, **tol) -> None:
    assert len(got) == len(expected)
    for a, b in zip(state_tensors(got), state_tensors(expected), strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_compiled_prefill_equals_eager_and_new_lengths_compile_nothing(family):
    model = trained_like(family)
    ids = torch.randint(0, 256, (2, 3 * SEGMENT + 5), generator=torch.Generator().manual_seed(0))
    counter = CompileCounter()
    with value_checks_off():
        for length in (2 * SEGMENT + 5, 3 * SEGMENT, SEGMENT + 1, 7):
            logits, state = prefill(model, ids[:, :length], compile=counter)
            ref_logits, ref_state = prefill(model, ids[:, :length], compile=False)
            torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
            assert_states_equal(state, ref_state, rtol=1e-5, atol=1e-5)
            if length == 2 * SEGMENT + 5:
                frames = counter.frame_count
                assert frames > 0, "the first prefill compiled nothing"
        assert counter.frame_count == frames, "a new prompt length compiled new graphs"
        # the compiled blocks are switched back to eager outside the prefill
        assert all(block._compiled_call_impl is None for block in model.layers)


@torch.no_grad()
def test_each_batch_size_compiles_once():
    model = trained_like("gsa")
    ids = torch.randint(0, 256, (2, 3 * SEGMENT + 2), generator=torch.Generator().manual_seed(4))
    counter = CompileCounter()
    with value_checks_off():
        prefill(model, ids[:, :2 * SEGMENT], compile=counter)
        first = counter.frame_count
        prefill(model, ids[:1, :2 * SEGMENT], compile=counter)
        second = counter.frame_count
        prefill(model, ids[:1, :3 * SEGMENT + 2], compile=counter)
        prefill(model, ids[:, :3 * SEGMENT + 1], compile=counter)
        assert counter.frame_count == second > first > 0


@torch.no_grad()
def test_compiled_eval_equals_eager_and_compiles_the_full_batches_only(tmp_path):
    tokenizer = load_tokenizer("")
    model = trained_like("gsa", vocab_size=tokenizer.vocab_size)
    data = write_jsonl(tmp_path, DOCS * 3)
    counter = CompileCounter()
    compiled = evaluate(model, tokenizer, data, seq_len=9, batch_size=4, compile=counter)
    frames = counter.frame_count
    assert frames > 0
    eager = evaluate(model, tokenizer, data, seq_len=9, batch_size=4, compile=False)
    assert compiled["tokens"] == eager["tokens"] and compiled["tokens"] % 9  # a short last window too
    assert compiled["loss"] == pytest.approx(eager["loss"], rel=1e-6)
    # another file, whose ragged last batch and last window differ, compiles nothing new
    again = evaluate(model, tokenizer, data, seq_len=9, batch_size=4, max_tokens=9 * 4 * 2 + 9 + 3,
                     compile=counter)
    assert counter.frame_count == frames
    assert again["tokens"] == 9 * 4 * 2 + 9 + 3


def test_inductor_falls_back_to_eager_on_cpu():
    model = trained_like("rwkv6")
    assert not compile_supported(torch.device("cpu"))
    with compiled_blocks(model) as compiled:
        assert compiled is False
        assert all(block._compiled_call_impl is None for block in model.layers)
    ids = torch.randint(0, 256, (2, 2 * SEGMENT + 3), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, _ = prefill(model, ids)
        torch.testing.assert_close(logits, model(ids)[:, -1], rtol=1e-5, atol=1e-5)


def test_a_failing_compilation_warns_once_and_runs_eagerly():
    calls = []

    def broken_backend(graph, example_inputs):
        calls.append(1)
        raise RuntimeError("no compiler here")

    model = trained_like("gsa")
    ids = torch.randint(0, 256, (2, 2 * SEGMENT), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        with pytest.warns(RuntimeWarning, match="torch.compile of the model's blocks failed"):
            logits, _ = prefill(model, ids, compile=broken_backend)
        torch.testing.assert_close(logits, model(ids)[:, -1], rtol=1e-5, atol=1e-5)
        tried = len(calls)
        with compiled_blocks(model, broken_backend) as compiled:
            assert compiled is False  # the model's blocks stay eager from then on
        prefill(model, ids, compile=broken_backend)
    assert len(calls) == tried == 1


@pytest.mark.parametrize("family", FAMILIES)
def test_a_compilation_failing_after_the_first_segment_restarts_the_prompt_eagerly(family):
    """The first segment's graphs compile and run; the next segment's (which continue a state)
    fail: the prompt runs again eagerly from its start, so the result is the eager prefill's bitwise,
    whatever part of a block ran before the failure."""
    graphs = []

    def fails_after_the_first_segment(graph, example_inputs):
        graphs.append(1)
        if len(graphs) > 1:
            raise RuntimeError("no compiler for this graph")
        return graph.forward

    model = trained_like(family)
    ids = torch.randint(0, 256, (2, 3 * SEGMENT + 3), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), value_checks_off():
        with pytest.warns(RuntimeWarning, match="torch.compile of the model's blocks failed"):
            logits, state = prefill(model, ids, compile=fails_after_the_first_segment)
        ref_logits, ref_state = prefill(model, ids, compile=False)
    assert compilation_failed(model, fails_after_the_first_segment) and len(graphs) == 2
    assert torch.equal(logits, ref_logits)
    assert_states_equal(state, ref_state, rtol=0, atol=0)


def relative_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.float(), ref.float()
    return ((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_inductor_prefill_and_eval_loss_equal_eager_on_cuda(family, monkeypatch):
    """Inductor on the Triton kernels, bf16: the compiled prefill's logits and state and the
    compiled eval loss match the eager ones up to bf16 rounding (Inductor fuses and rounds the glue
    differently), and a second prompt length compiles nothing new."""
    monkeypatch.setattr(decoder, "PREFILL_SEGMENT", 64)
    model = trained_like(family, device="cuda", backend="triton").to(torch.bfloat16).eval()
    assert compile_supported(torch.device("cuda"))
    ids = torch.randint(0, 256, (4, 64 * 3 + 9), generator=torch.Generator().manual_seed(3)).cuda()
    counts = torch._dynamo.utils.counters
    counts.clear()
    with value_checks_off():
        logits, state = prefill(model, ids)
        ref_logits, ref_state = prefill(model, ids, compile=False)
        compiles = counts["stats"]["unique_graphs"]
        assert compiles > 0, "prefill compiled nothing"
        assert relative_rms(logits, ref_logits) < 2e-2
        for a, b in zip(state_tensors(state), state_tensors(ref_state), strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                assert relative_rms(a, b) < 2e-2
        prefill(model, ids[:, :64 * 2 + 1])
        assert counts["stats"]["unique_graphs"] == compiles, "a new prompt length compiled new graphs"
        x, y = ids[:, :128], ids[:, 1:129]
        with compiled_blocks(model) as compiled:
            assert compiled
            loss = model(x, labels=y)
        assert counts["stats"]["unique_graphs"] > compiles
        torch.testing.assert_close(loss.float(), model(x, labels=y).float(), rtol=1e-2, atol=0)
