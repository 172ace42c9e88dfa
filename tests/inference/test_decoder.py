"""The decoding step over static buffers (CausalLM.decode_step, flame.inference.decoder): its greedy
tokens equal the eager recurrent step's (forward_with_state per token) and a full forward's argmax
over 256 tokens in fp32 on CPU, for every family; packed prefill of prompts of different lengths;
the fused decode kernels (Triton, under the interpreter on CPU) against their PyTorch forms; the
decoder's cache and weight refresh; on CUDA, the captured graph against the eager step in bf16."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flame.inference.decoder import Decoder, decoder_for, prefill, release_decoders
from flame.inference.generation import generate
from flame.ops.utils.backend import triton_interpreter_enabled
from flame.ops.gsa.decode_step import gsa_decode_step
from flame.ops.rwkv6.decode_step import rwkv6_decode_step
from flame.ops.rwkv7.decode_step import rwkv7_decode_step
from tests.models.helpers import FAMILIES
from tests.models.test_decoding import trained_like

NEW_TOKENS = 256


def eager_recurrent_greedy(model, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy tokens from forward_with_state, one call per token (the fused recurrent ops)."""
    logits, state = model.forward_with_state(prompt, last_only=True)
    tokens = []
    for _ in range(steps):
        tokens.append(logits[:, -1].argmax(-1))
        logits, state = model.forward_with_state(tokens[-1][:, None], state)
    return torch.stack(tokens, dim=1)


def assert_steps_follow(model, decoder: Decoder, ids: torch.Tensor, prefill_len: int, tol: float) -> None:
    """From the state of model's prefill of ids[:, :prefill_len], the decoder's step gives the
    logits of model's eager recurrent step for each following token of ids."""
    logits, state = model.forward_with_state(ids[:, :prefill_len])
    decoder.load(state)
    for t in range(prefill_len, ids.shape[1]):
        logits, state = model.forward_with_state(ids[:, t:t + 1], state)
        decoder.tokens.copy_(ids[:, t])
        torch.testing.assert_close(decoder.step(), logits[:, 0], rtol=tol, atol=tol)


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_static_step_greedy_equals_the_eager_step_and_the_full_forward_over_256_tokens(family):
    model = trained_like(family).eval()
    prompt = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(3))
    static = generate(model, prompt, max_new_tokens=NEW_TOKENS, temperature=0)
    assert static.shape == (2, NEW_TOKENS)
    assert not decoder_for(model, 2).graphed  # CPU: the same buffers, run eagerly
    assert torch.equal(static, eager_recurrent_greedy(model, prompt, NEW_TOKENS))
    full = torch.cat([prompt, static], dim=1)
    assert torch.equal(model(full)[:, prompt.shape[1] - 1:-1].argmax(-1), static)
    assert len(set(static[0].tolist())) > 3  # a random model's greedy text loops, but not from the start


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_decode_step_logits_equal_forward_with_state(family):
    model = trained_like(family).eval()
    ids = torch.randint(0, 256, (3, 14), generator=torch.Generator().manual_seed(4))
    assert_steps_follow(model, Decoder(model, 3), ids, 9, tol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_packed_prefill_of_prompts_of_different_lengths_equals_separate_prefills(family):
    model = trained_like(family).eval()
    generator = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 256, (n,), generator=generator) for n in (9, 1, 23, 4)]
    logits, state = prefill(model, prompts)
    assert logits.shape == (4, 256)
    for row, ids in enumerate(prompts):
        alone_logits, alone_state = model.forward_with_state(ids[None], last_only=True)
        torch.testing.assert_close(logits[row], alone_logits[0, -1], rtol=1e-5, atol=1e-5)
        for packed, alone in zip(state, alone_state):
            for field in ("attn_shift", "ffn_shift"):
                if getattr(alone, field) is not None:
                    torch.testing.assert_close(getattr(packed, field)[row], getattr(alone, field)[0])
            for p, a in zip(*(s if isinstance(s, tuple) else (s,) for s in (packed.recurrent, alone.recurrent))):
                torch.testing.assert_close(p[row], a[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="at least one token"):
        model.forward_with_state(torch.zeros(1, 3, dtype=torch.long), cu_seqlens=torch.tensor([0, 3, 3]))
    with pytest.raises(ValueError, match="empty prefixes"):
        model.forward_with_state(torch.zeros(1, 3, dtype=torch.long), state, cu_seqlens=torch.tensor([0, 3]))


@torch.no_grad()
def test_decoder_cache_and_weight_refresh():
    model = trained_like("rwkv7").eval()
    first = decoder_for(model, 2)
    assert decoder_for(model, 2) is first and decoder_for(model, 3) is not first
    ids = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(7))
    before = generate(model, ids, max_new_tokens=6, temperature=0)
    model.layers[1].attn.receptance.weight.mul_(-1)  # an in-place change the stacked copy must see
    after = generate(model, ids, max_new_tokens=6, temperature=0)
    assert torch.equal(after, eager_recurrent_greedy(model, ids, 6)) and not torch.equal(after, before)
    release_decoders(model)
    assert decoder_for(model, 2) is not first


@pytest.mark.skipif(not triton_interpreter_enabled(), reason="Triton kernels on CPU need TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernels_equal_their_pytorch_forms(dtype):
    """The three decode_step ops: Triton (interpreter) against PyTorch, outputs and in-place
    updates, with strided inputs (views of stacked matmul outputs)."""
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    B, H, N = 3, 4, 16
    C = H * N
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)

    def both(fn, *buffers):
        """fn(backend, *clones of buffers) on both backends -> two lists (outputs, buffers)."""
        results = []
        for backend in ("torch", "triton"):
            copies = [b.clone() for b in buffers]
            out = fn(backend, *copies)
            results.append([*(out if isinstance(out, (tuple, list)) else [out]), *copies])
        for want, got in zip(*results):
            torch.testing.assert_close(got.float(), want.float(), **tol)

    proj = rand(7, B, 2 * C).to(dtype)[..., :C]  # strided rows
    params = dict(w0=rand(C), a0=rand(C), v0=rand(C), k_k=rand(C), k_a=rand(C), r_k=rand(H, N), ln_weight=rand(C),
                  ln_bias=rand(C), ln_eps=16e-5, decay_bound=0.6065306597126334)
    for first in (True, False):
        both(lambda be, v_first, s: rwkv7_decode_step(*proj, v_first, state=s, is_first=first, backend=be, **params),
             rand(B, C).to(dtype), rand(B, H, N, N))
    time_decay = rand(C) - 2
    both(lambda be, s: rwkv6_decode_step(*proj[:5], time_decay=time_decay, u=params["r_k"],
                                         ln_weight=params["ln_weight"], ln_bias=params["ln_bias"], ln_eps=64e-5,
                                         state=s, backend=be), rand(B, H, N, N))
    for HQ, HK, K, M in ((2, 2, 32, 8), (4, 2, 16, 20)):
        width = HQ * K + 2 * HK * K + HK * M
        q, k, v, f = rand(B, width + 8).to(dtype)[:, :width].split(
            [HQ * K, HK * K, HK * K, HK * M], dim=1)
        f = f * 4  # forget gates from near 0 to near 1
        both(lambda be, sk, sv: gsa_decode_step(q, k, v, f, normalizer=8.0, state_k=sk, state_v=sv, backend=be),
             rand(B, HK, K, M), rand(B, HK, M, K))


REPEATS = 1000


@pytest.mark.gpu
@torch.no_grad()
def test_decode_kernels_give_the_same_bits_on_every_launch():
    """Each decode_step kernel loads its state tiles and overwrites them within one program (the
    layer-0 RWKV7 kernel also writes v_first): REPEATS launches of each from the same state and
    inputs, at the 1B models' head shapes in bf16 with 16 sequences, give bitwise-equal outputs
    and states. A warp that read a state element after another warp of its program had overwritten
    it would change one of them now and then."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen, device="cuda")  # noqa: E731
    bf16 = torch.bfloat16
    B, H, N = 16, 32, 64  # RWKV6 and RWKV7 1B: 32 heads of 64 channels
    C = H * N
    r, k, v, w_lora, a_lora, v_lora, g = (rand(B, C).to(bf16) for _ in range(7))
    rwkv7 = dict(w0=rand(C), a0=rand(C), v0=rand(C), k_k=rand(C), k_a=rand(C), r_k=rand(H, N), ln_weight=rand(C),
                 ln_bias=rand(C), ln_eps=64e-5, decay_bound=0.6065306597126334)
    rwkv6 = dict(time_decay=rand(C) - 2, u=rand(H, N), ln_weight=rand(C), ln_bias=rand(C), ln_eps=64e-5)
    HK, K, M = 4, 512, 64  # GSA 1B: 4 heads of 512 channels, 64 slots
    q, gk, gv, f = (rand(B, HK * width).to(bf16) for width in (K, K, K, M))
    cases = {
        "rwkv7 layer 0": (lambda s: rwkv7_decode_step(r, k, v, w_lora, a_lora, None, g, s[1], state=s[0],
                                                      is_first=True, **rwkv7),
                          [rand(B, H, N, N), torch.zeros(B, C, dtype=bf16, device="cuda")]),
        "rwkv7": (lambda s: rwkv7_decode_step(r, k, v, w_lora, a_lora, v_lora, g, s[1], state=s[0], is_first=False,
                                              **rwkv7),
                  [rand(B, H, N, N), rand(B, C).to(bf16)]),
        "rwkv6": (lambda s: rwkv6_decode_step(r, k, v, g, w_lora, state=s[0], **rwkv6), [rand(B, H, N, N)]),
        "gsa": (lambda s: gsa_decode_step(q, gk, gv, f * 4, normalizer=8.0, state_k=s[0], state_v=s[1]),
                [rand(B, HK, K, M), rand(B, HK, M, K)]),
    }
    for name, (step, start) in cases.items():
        buffers = [t.clone() for t in start]
        first = None
        for i in range(REPEATS):
            for buffer, t in zip(buffers, start):
                buffer.copy_(t)
            # the copies finish before the launch: on Hopper a decode kernel loads its state before it
            # waits on the kernel ahead of it (flame.ops.dependent_launch), which in a decoding step
            # never writes that state
            torch.cuda.synchronize()
            results = [step(buffers), *buffers]
            if first is None:
                first = [t.clone() for t in results]
            for j, (got, want) in enumerate(zip(results, first)):
                assert torch.equal(got, want), f"{name}: launch {i} differs from launch 0 in result {j} " \
                                               "(0: the output, then the state buffers)"


@pytest.mark.skipif(not triton_interpreter_enabled(), reason="Triton kernels on CPU need TRITON_INTERPRET=1")
@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_decode_step_on_the_triton_kernels_under_the_interpreter(family):
    """The model's decode step on the Triton kernels against its PyTorch twin's eager recurrent
    step (the same weights), from the twin's prefilled state."""
    model, twin = trained_like(family).eval(), trained_like(family, backend="triton").eval()
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(8))
    assert_steps_follow(model, Decoder(twin, 2), ids, 5, tol=1e-4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests compile the kernels for real")
def test_decode_kernels_compile_for_sm90():
    """The interpreter runs kernels as Python; the GPU compiler may reject what it accepts
    (tests/inference/sm90_decode.py compiles each specialization the 340M models launch)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "tests.inference.sm90_decode"], cwd=Path(__file__).resolve().parents[2],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"decode kernels that do not compile for sm_90:\n{run.stdout}\n{run.stderr[-3000:]}"


def gpu_model(family: str, dtype: torch.dtype = torch.bfloat16):
    """A 340M-size model (the shipped config's shape) with random weights on CUDA: the official
    init, every parameter then perturbed so that the zero-initialised projections count."""
    from flame.config import load_config
    from tests.models.helpers import build_on_meta

    args = load_config(["--config", str(Path(__file__).resolve().parents[2] / "configs" / f"{family}_340M.toml")]).model
    model = build_on_meta(args, seed=0, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen, device="cuda"))
    return model.to(dtype).eval()


def relative_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_cuda_graph_step_equals_the_eager_step_in_bf16(family):
    """32 greedy tokens: the captured graph and the same step run eagerly give the same tokens; the
    step is as close to the fp32 model as bf16 forward_with_state is (its logits' relative RMS error
    against fp32, teacher-forced on the graphed tokens, at most 1.5x forward_with_state's, which
    is about 1e-2 per 6 layers), and each graphed token is the fp32 model's argmax up to near-ties
    within the bf16 logits' own error (the fp32 logit of the token at most 4x the row's RMS error
    below the fp32 maximum; two bf16 computations of a near-tie may pick either side of it)."""
    model = gpu_model(family)
    prompt = torch.randint(0, model.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0)).cuda()
    graphed = generate(model, prompt, max_new_tokens=32, temperature=0, graph=True)
    assert decoder_for(model, 4, graph=True).graphed, "the CUDA graph capture failed (see the warning)"
    eager = generate(model, prompt, max_new_tokens=32, temperature=0, graph=False)
    assert torch.equal(graphed, eager)

    reference = gpu_model(family, torch.float32)
    logits, state = model.forward_with_state(prompt, last_only=True)
    ref_logits, ref_state = reference.forward_with_state(prompt, last_only=True)
    decoder = decoder_for(model, 4, graph=True)
    decoder.load(state)
    step_logits = logits[:, -1].float()  # the first new token comes from the prefill's logits
    for t in range(32):  # teacher-forced on the graphed tokens
        if t:
            decoder.tokens.copy_(graphed[:, t - 1])
            step_logits = decoder.step().float()
            logits, state = model.forward_with_state(graphed[:, t - 1:t], state)
            ref_logits, ref_state = reference.forward_with_state(graphed[:, t - 1:t], ref_state)
            ref = ref_logits[:, -1].float()
            step_err, bf16_err = relative_rms(step_logits, ref), relative_rms(logits[:, -1], ref)
            assert step_err <= 1.5 * bf16_err + 1e-3, (
                f"{family} token {t}: the step's error against fp32 {step_err:.2e}, forward_with_state's {bf16_err:.2e}")
        ref = ref_logits[:, -1].float()
        row_err = (step_logits - ref).pow(2).mean(-1).sqrt()
        gap = ref.max(-1).values - ref.gather(1, graphed[:, t, None])[:, 0]
        assert (gap <= 4 * row_err).all(), (
            f"{family} token {t}: the fp32 logit of the chosen token is {gap.max():.3g} below the maximum, "
            f"beyond 4x the row's error {row_err.min():.3g}")
    release_decoders(model)


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_decoding_tokens_never_waits_for_the_device(family):
    """The per-token work of generate (graph replay, sampling with every option, repetition
    bookkeeping) runs under torch's sync debug mode "error": no host sync."""
    from flame.inference.generation import sample_next

    model = trained_like(family, device="cuda", backend="triton").to(torch.bfloat16)
    prompt = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0)).cuda()
    logits, state = prefill(model, prompt)
    decoder = decoder_for(model, 2)
    assert decoder.graphed
    decoder.load(state)
    seen = torch.zeros(2, 256, dtype=torch.bool, device="cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            token = sample_next(logits, 0.8, 0.9, 20, generator, seen, 1.2)
            seen.scatter_(1, token[:, None], True)
            decoder.tokens.copy_(token)
            logits = decoder.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    release_decoders(model)
