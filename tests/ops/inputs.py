"""Random inputs for the op tests of every family, shared by the PyTorch and Triton tests.

Each `make_<family>_inputs` returns a dict whose keys are the op's argument names, so a test calls
`op(**inputs, scale=..., output_final_state=True)`. Values are drawn in float64 on the CPU from a
seeded generator, then cast to `dtype` and moved to `device`: the same seed gives the same numbers
(up to rounding) in every dtype and on every device. With `requires_grad=True` every floating
tensor (states included) is a leaf that requires grad.

Decay modes (`decay=`), for the log-decay w (RWKV6, RWKV7) or the slot log-forget g (GSA):
- "normal":    the family's own layer distribution (RWKV6: logsigmoid(randn), per-step decays
               ~0.3..1; RWKV7: -0.6065 * sigmoid(randn); GSA: logsigmoid(randn) / 8);
- "weak":      logsigmoid(randn) / 10 (decays close to 1);
- "strong":    logsigmoid(randn) (for GSA and RWKV7, whose layers decay less);
- "extreme":   logsigmoid(randn) / 0.1 (mean about -8 per step, tail to about -40);
- "wide":      -exp(U(-6, 5)) (down to about -150 per step);
- "zero":      exactly 0 everywhere (decay 1);
- "half_zero": "normal" with 50% of the entries set exactly to 0;
- a float c <= 0: the constant c everywhere (e.g. -1e3 for a decay that underflows).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = [
    "DECAY_MODES", "RWKV7_LOG_DECAY_BOUND", "grad_leaves", "loss_of", "make_cu_seqlens", "make_gsa_inputs",
    "make_inputs", "make_rwkv6_inputs", "make_rwkv7_inputs", "random_lengths", "random_like", "rwkv7_a_b",
    "split_sequences", "to_reference", "varlen_state", "forward_backward", "assert_results_close", "assert_inputs_unchanged",
]

RWKV7_LOG_DECAY_BOUND = -0.6065306597126334  # -exp(-0.5): the RWKV7 layer's log-decay lies in (bound, 0]

DECAY_MODES = ("normal", "weak", "strong", "extreme", "wide", "zero", "half_zero")


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def _log_decay(gen: torch.Generator, shape: tuple[int, ...], decay: str | float, normal) -> torch.Tensor:
    """A log-decay tensor (<= 0) of `shape` in float64; `normal` draws the family's own distribution."""
    if isinstance(decay, (int, float)) and not isinstance(decay, bool):
        if decay > 0:
            raise ValueError(f"a constant log-decay must be <= 0, got {decay}")
        return torch.full(shape, float(decay), dtype=torch.float64)
    if decay == "normal":
        return normal(_randn(gen, *shape))
    if decay == "weak":
        return F.logsigmoid(_randn(gen, *shape)) / 10
    if decay == "strong":
        return F.logsigmoid(_randn(gen, *shape))
    if decay == "extreme":
        return F.logsigmoid(_randn(gen, *shape)) / 0.1
    if decay == "wide":
        return -torch.exp(torch.rand(*shape, generator=gen, dtype=torch.float64) * 11 - 6)
    if decay == "zero":
        return torch.zeros(shape, dtype=torch.float64)
    if decay == "half_zero":
        w = normal(_randn(gen, *shape))
        keep = torch.rand(*shape, generator=gen, dtype=torch.float64) < 0.5
        return torch.where(keep, w, torch.zeros_like(w))
    raise ValueError(f"unknown decay mode {decay!r}; choose one of {DECAY_MODES} or a float <= 0")


def _finish(tensors: dict, dtype: torch.dtype, device, requires_grad: bool, state_dtype: torch.dtype | None) -> dict:
    """Cast to dtype (states to state_dtype), move to device, and make the leaves require grad."""
    state_dtype = state_dtype or (torch.float64 if dtype == torch.float64 else torch.float32)

    def convert(x: torch.Tensor, to: torch.dtype) -> torch.Tensor:
        x = x.to(device=device, dtype=to)
        return x.requires_grad_(requires_grad)

    out = {}
    for name, x in tensors.items():
        if x is None:
            out[name] = None
        elif name == "initial_state":
            out[name] = tuple(convert(h, state_dtype) for h in x) if isinstance(x, tuple) else convert(x, state_dtype)
        else:
            out[name] = convert(x, dtype)
    return out


def make_rwkv6_inputs(
    B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype = torch.float32, device="cpu",
    decay: str | float = "normal", seed: int = 0, initial_state: bool = True, requires_grad: bool = False,
    state_dtype: torch.dtype | None = None,
) -> dict:
    """Inputs of chunk_rwkv6: r, k, w [B,T,H,K], v [B,T,H,V], u [H,K], initial_state [B,H,K,V] (or None).

    For varlen tests build with B=1 and pass `num_states=len(cu_seqlens)-1` through
    `varlen_state` below. The state is float32 (float64 when dtype is float64) unless state_dtype.
    """
    gen = _generator(seed)
    tensors = {
        "r": _randn(gen, B, T, H, K),
        "k": _randn(gen, B, T, H, K),
        "v": _randn(gen, B, T, H, V),
        "w": _log_decay(gen, (B, T, H, K), decay, lambda x: F.logsigmoid(x)),
        "u": _randn(gen, H, K) * 0.5,
        "initial_state": _randn(gen, B, H, K, V) if initial_state else None,
    }
    return _finish(tensors, dtype, device, requires_grad, state_dtype)


def rwkv7_a_b(gen: torch.Generator, shape: tuple[int, ...], mode: str = "layer") -> tuple[torch.Tensor, torch.Tensor]:
    """a and b of RWKV7 in float64, as the layer builds them from kappa_hat (unit norm per head).

    mode "layer": a = -kappa_hat, b = kappa_hat * alpha with alpha in (0, 1);
    mode "delta": a = -kappa_hat, b = kappa_hat (the delta rule with beta = 1);
    mode "zero_b": a = -kappa_hat, b = 0 (the op reduces to inclusive gated linear attention).
    """
    kappa = _randn(gen, *shape)
    kappa_hat = kappa / kappa.norm(dim=-1, keepdim=True)
    alpha = torch.sigmoid(_randn(gen, *shape))
    if mode == "layer":
        return -kappa_hat, kappa_hat * alpha
    if mode == "delta":
        return -kappa_hat, kappa_hat.clone()
    if mode == "zero_b":
        return -kappa_hat, torch.zeros_like(kappa_hat)
    raise ValueError(f"unknown RWKV7 a/b mode {mode!r}; choose 'layer', 'delta' or 'zero_b'")


def make_rwkv7_inputs(
    B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype = torch.float32, device="cpu",
    decay: str | float = "normal", seed: int = 0, initial_state: bool = True, requires_grad: bool = False,
    ab: str = "layer", state_dtype: torch.dtype | None = None,
) -> dict:
    """Inputs of chunk_rwkv7: r, w, k, a, b [B,T,H,K], v [B,T,H,V], initial_state [B,H,K,V] (or None).

    "normal" decay is the layer's w = -0.6065 * sigmoid(randn); `ab` is a mode of `rwkv7_a_b`.
    k is scaled by K^-1/2 so that the state stays O(1) over long sequences, as in the layer.
    """
    gen = _generator(seed)
    r = _randn(gen, B, T, H, K)
    w = _log_decay(gen, (B, T, H, K), decay, lambda x: RWKV7_LOG_DECAY_BOUND * torch.sigmoid(x))
    k = _randn(gen, B, T, H, K) / math.sqrt(K)
    v = _randn(gen, B, T, H, V)
    a, b = rwkv7_a_b(gen, (B, T, H, K), ab)
    h0 = _randn(gen, B, H, K, V) if initial_state else None
    tensors = {"r": r, "w": w, "k": k, "v": v, "a": a, "b": b, "initial_state": h0}
    return _finish(tensors, dtype, device, requires_grad, state_dtype)


def make_gsa_inputs(
    B: int, T: int, H: int, K: int, V: int, M: int, dtype: torch.dtype = torch.float32, device="cpu",
    decay: str | float = "normal", seed: int = 0, initial_state: bool = True, requires_grad: bool = False,
    HQ: int | None = None, state_dtype: torch.dtype | None = None,
) -> dict:
    """Inputs of chunk_gsa: q [B,T,HQ,K], k [B,T,H,K], v [B,T,H,V], s, g [B,T,H,M],
    initial_state = (hk [B,H,K,M], hv [B,H,M,V]) or None.

    "normal" decay is the layer's g = logsigmoid(randn) / 8; s = 1 - exp(g) always (so s is 0 where
    g is 0). q and k go through swish like the layer's feature map; HQ defaults to H.
    """
    HQ = H if HQ is None else HQ
    if HQ % H:
        raise ValueError(f"HQ={HQ} must be a multiple of H={H}")
    gen = _generator(seed)
    q = F.silu(_randn(gen, B, T, HQ, K))
    k = F.silu(_randn(gen, B, T, H, K))
    v = _randn(gen, B, T, H, V)
    g = _log_decay(gen, (B, T, H, M), decay, lambda x: F.logsigmoid(x) / 8)
    s = -torch.expm1(g)
    state = (_randn(gen, B, H, K, M), _randn(gen, B, H, M, V)) if initial_state else None
    tensors = {"q": q, "k": k, "v": v, "s": s, "g": g, "initial_state": state}
    return _finish(tensors, dtype, device, requires_grad, state_dtype)


def make_inputs(family: str, B: int, T: int, H: int, K: int, V: int, M: int | None = None, HQ: int | None = None,
                **kwargs) -> dict:
    """make_<family>_inputs for family "rwkv6", "rwkv7" or "gsa"; the slot count M (required) and
    the query heads HQ shape GSA only and are ignored by the RWKV families."""
    if family == "gsa":
        if M is None:
            raise ValueError("GSA inputs need the slot count M")
        return make_gsa_inputs(B, T, H, K, V, M, HQ=HQ, **kwargs)
    if family == "rwkv6":
        return make_rwkv6_inputs(B, T, H, K, V, **kwargs)
    if family == "rwkv7":
        return make_rwkv7_inputs(B, T, H, K, V, **kwargs)
    raise ValueError(f"unknown family {family!r}; choose 'rwkv6', 'rwkv7' or 'gsa'")


# ---------------------------------------------------------------------------------------------
# varlen helpers

def make_cu_seqlens(lengths: list[int], device="cpu", dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """cu_seqlens [N+1] = [0, l0, l0+l1, ...] for the given sequence lengths."""
    if any(n < 0 for n in lengths):
        raise ValueError(f"sequence lengths must be >= 0, got {lengths}")
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return torch.tensor(offsets, dtype=dtype, device=device)


def random_lengths(total: int, num_seqs: int, seed: int = 0, min_len: int = 1) -> list[int]:
    """num_seqs random lengths (each >= min_len) that sum to total."""
    if num_seqs * min_len > total:
        raise ValueError(f"cannot split {total} tokens into {num_seqs} sequences of >= {min_len}")
    gen = _generator(seed)
    cuts = torch.randperm(total - num_seqs * min_len + num_seqs - 1, generator=gen)[: num_seqs - 1].sort().values
    bars = [-1] + cuts.tolist() + [total - num_seqs * min_len + num_seqs - 1]
    return [bars[i + 1] - bars[i] - 1 + min_len for i in range(num_seqs)]


def varlen_state(inputs: dict, num_seqs: int, seed: int = 1) -> dict:
    """A copy of `inputs` (built with B=1) whose initial state has one entry per sequence."""
    gen = _generator(seed)

    def draw(h: torch.Tensor) -> torch.Tensor:
        x = _randn(gen, num_seqs, *h.shape[1:]).to(device=h.device, dtype=h.dtype)
        return x.requires_grad_(h.requires_grad)

    out = dict(inputs)
    h = inputs["initial_state"]
    if h is not None:
        out["initial_state"] = tuple(draw(x) for x in h) if isinstance(h, tuple) else draw(h)
    return out


def split_sequences(x: torch.Tensor, cu_seqlens: torch.Tensor) -> list[torch.Tensor]:
    """The per-sequence slices [1, T_i, ...] of a packed tensor x [1, T, ...]."""
    bounds = cu_seqlens.tolist()
    return [x[:, bounds[i]: bounds[i + 1]] for i in range(len(bounds) - 1)]


# ---------------------------------------------------------------------------------------------
# reference copies and output gradients

def to_reference(inputs: dict, dtype: torch.dtype = torch.float64) -> dict:
    """Detached copies of every floating tensor in `inputs`, cast to dtype, requiring grad: the
    inputs of the naive fp64 oracle on exactly the values the op under test saw."""
    def convert(x):
        if isinstance(x, tuple):
            return tuple(convert(h) for h in x)
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.detach().to(dtype).requires_grad_(True)
        return x
    return {name: convert(x) for name, x in inputs.items()}


def grad_leaves(inputs: dict) -> dict[str, torch.Tensor]:
    """name -> tensor for every tensor in `inputs` that requires grad (state pairs as name.0, name.1)."""
    leaves = {}
    for name, x in inputs.items():
        if isinstance(x, tuple):
            for i, h in enumerate(x):
                if h.requires_grad:
                    leaves[f"{name}.{i}"] = h
        elif isinstance(x, torch.Tensor) and x.requires_grad:
            leaves[name] = x
    return leaves


def random_like(x, seed: int):
    """A seeded random tensor (or tuple of tensors) like x, e.g. an output or final-state gradient."""
    gen = _generator(seed)
    if isinstance(x, tuple):
        return tuple(_randn(gen, *h.shape).to(device=h.device, dtype=h.dtype) for h in x)
    return _randn(gen, *x.shape).to(device=x.device, dtype=x.dtype)


def loss_of(o: torch.Tensor, final_state, do: torch.Tensor, dht) -> torch.Tensor:
    """<o, do> + <final_state, dht>: backward of this gives the gradients for (do, dht)."""
    loss = (o.double() * do.double()).sum()
    if final_state is not None and dht is not None:
        pairs = zip(final_state, dht) if isinstance(final_state, tuple) else [(final_state, dht)]
        for h, dh in pairs:
            loss = loss + (h.double() * dh.double()).sum()
    return loss


# ---------------------------------------------------------------------------------------------
# running an op forward and backward, and comparing results

def forward_backward(op, inputs: dict, seed: int = 7, with_dht: bool = True, **kwargs):
    """Run op(**inputs, output_final_state=True, **kwargs), then backward with a seeded random do
    and (if with_dht) a seeded random final-state gradient.

    Returns (o, final_state, grads) with grads a dict name -> gradient of every leaf that requires
    grad (None where the op does not depend on it). Uses torch.autograd.grad, so no .grad field of
    the inputs is touched.
    """
    o, final_state = op(**inputs, output_final_state=True, **kwargs)
    do = random_like(o, seed)
    dht = random_like(final_state, seed + 1) if with_dht else None
    leaves = grad_leaves(inputs)
    grads = torch.autograd.grad(loss_of(o, final_state, do, dht), list(leaves.values()), allow_unused=True)
    return o, final_state, dict(zip(leaves, grads))


def assert_results_close(ref, out, ratio: float, label: str = "", atol: float = 1e-6) -> None:
    """Compare two forward_backward results: o, the final state(s) and every gradient, each with
    assert_close(ratio, atol) (atol matters where the reference is ~0, e.g. dw under decays of -1e3)."""
    from tests.ops.assertions import assert_close

    (o_ref, h_ref, g_ref), (o_out, h_out, g_out) = ref, out
    assert_close(f"{label}o", o_ref, o_out, ratio, atol)
    if h_ref is not None:
        pairs = zip(h_ref, h_out) if isinstance(h_ref, tuple) else [(h_ref, h_out)]
        for i, (a, b) in enumerate(pairs):
            assert_close(f"{label}final_state[{i}]", a, b, ratio, atol)
    assert set(g_ref) == set(g_out), f"{label}gradients of {sorted(g_out)} != reference {sorted(g_ref)}"
    for name in g_ref:
        assert g_out[name] is not None, f"{label}no gradient for {name}"
        assert_close(f"{label}d{name}", g_ref[name], g_out[name], ratio, atol)


def assert_inputs_unchanged(op, inputs: dict, **kwargs) -> None:
    """Chunked and recurrent kernels disagreeing
    (docs/known-failures.md#chunked-and-recurrent-kernels-disagree): neither the forward nor the backward of
    op may modify any input tensor.

    Runs forward and backward (with a final-state gradient) and compares every input, bit for bit,
    with a copy taken before. Works for any backend= passed in kwargs.
    """
    def snapshot():
        copies = {}
        for name, x in inputs.items():
            for i, t in enumerate(x if isinstance(x, tuple) else (x,)):
                if isinstance(t, torch.Tensor):
                    copies[f"{name}[{i}]"] = t.detach().clone()
        return copies

    def compare(before, stage):
        after = snapshot()
        for name, x in before.items():
            assert torch.equal(x, after[name]), f"{name} was modified by the {stage}"

    before = snapshot()
    o, final_state = op(**inputs, output_final_state=True, **kwargs)
    compare(before, "forward")
    leaves = grad_leaves(inputs)
    loss = loss_of(o, final_state, random_like(o, 3), random_like(final_state, 4))
    torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    compare(before, "backward")
