"""Input validation of the public ops: clear errors before any kernel runs.

Shape, dtype, device and layout checks are always on and cost no device sync. Value checks (every
log-decay is <= 0, cu_seqlens is a valid offset vector, RWKV7's gate_lower_bound holds) need one
host sync per call; they are on by default and switched off globally by `set_value_checks(False)`.

Layout rule: every [B, T, H, D] argument is token-major. A head-first tensor [B, H, T, D] passed by
mistake is detected when its head count disagrees with another argument: the other token-major
tensors, u [H, K] (RWKV6), the initial state [N, H, K, V], or the query/key head ratio (GSA). When
every tensor is head-first and nothing else fixes H (RWKV7 without an initial state), the mistake
cannot be seen from shapes alone.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)

_value_checks = True

_LAYOUT_HINT = (
    "flame ops take token-major [B, T, H, D] tensors; a head-first [B, H, T, D] tensor must be "
    "transposed first (x.transpose(1, 2))"
)


def set_value_checks(enabled: bool) -> None:
    """Switch the value checks (log-decay <= 0, cu_seqlens values, gate bound) on or off for every op."""
    global _value_checks
    _value_checks = bool(enabled)


def value_checks_enabled() -> bool:
    return _value_checks


@contextmanager
def value_checks_off():
    """The value checks switched off inside: each costs a device sync (a stall per step, and no
    CUDA graph capture) and raises on a NaN decay. Training switches them off because its step
    checks its own loss and gradients; inference because a trained model's decays are valid."""
    previous = value_checks_enabled()
    set_value_checks(False)
    try:
        yield
    finally:
        set_value_checks(previous)


def _shape(x: torch.Tensor) -> str:
    return str(tuple(x.shape))


def _check_tensor(op: str, name: str, x, ndim: int, layout: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor {layout}, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{op}: {name} must be a {ndim}-D tensor {layout}, got shape {_shape(x)}")


def _check_float_dtypes(op: str, tensors: dict[str, torch.Tensor], same: bool) -> None:
    for name, x in tensors.items():
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{op}: {name} must have a floating dtype (float32, float16, bfloat16 or float64), "
                            f"got {x.dtype}")
    if same:
        _require_one(op, tensors, "dtype", TypeError, f"{', '.join(tensors)} must share one dtype", "is")


def _check_devices(op: str, tensors: dict[str, torch.Tensor]) -> None:
    _require_one(op, tensors, "device", ValueError, "every tensor must be on one device", "is on")


def _require_one(op: str, tensors: dict[str, torch.Tensor], attribute: str, error: type[Exception],
                 rule: str, verb: str) -> None:
    """Raise `error` naming the first tensor whose `attribute` differs from the first tensor's."""
    names = list(tensors)
    first = getattr(tensors[names[0]], attribute)
    for name in names[1:]:
        value = getattr(tensors[name], attribute)
        if value != first:
            raise error(f"{op}: {rule}; {names[0]} {verb} {first} but {name} {verb} {value}")


def _check_token_major(op: str, ref_name: str, ref: torch.Tensor, tensors: dict[str, torch.Tensor],
                       heads: int | None = None, dims: dict[str, int] | None = None) -> None:
    """Every tensor of `tensors` is [B, T, heads or ref's H, dims[name] or ref's D] like `ref`."""
    B, T, H = ref.shape[:3]
    for name, x in tensors.items():
        want_h = H if heads is None else heads
        if x.shape[0] != B or x.shape[1] != T:
            raise ValueError(f"{op}: {name} has shape {_shape(x)} but {ref_name} has {_shape(ref)}: they must share "
                             f"B={B} and T={T} ([B, T, H, D] layout). {_LAYOUT_HINT}")
        if x.shape[2] != want_h:
            raise ValueError(f"{op}: {name} has {x.shape[2]} heads (dim 2 of {_shape(x)}) but {ref_name} implies "
                             f"{want_h}. {_LAYOUT_HINT}")
        if dims is not None and name in dims and x.shape[3] != dims[name]:
            raise ValueError(f"{op}: {name} must have last dim {dims[name]}, got shape {_shape(x)}")


def _check_scale(op: str, scale) -> None:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{op}: scale must be a Python number, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"{op}: scale must be finite, got {scale}")


def _check_flag(op: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{op}: {name} must be a bool, got {type(value).__name__}")


def _check_cu_seqlens(op: str, cu_seqlens, ref_name: str, ref: torch.Tensor) -> int:
    """Shape checks of cu_seqlens; returns the number of states N (B without cu_seqlens)."""
    if cu_seqlens is None:
        return ref.shape[0]
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{op}: cu_seqlens must be a 1-D integer torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in INDEX_DTYPES:
        raise ValueError(f"{op}: cu_seqlens must be a 1-D int32 or int64 tensor, got shape "
                         f"{_shape(cu_seqlens)} and dtype {cu_seqlens.dtype}")
    if cu_seqlens.numel() < 2:
        raise ValueError(f"{op}: cu_seqlens must hold N+1 >= 2 offsets [0, ..., T], got {cu_seqlens.numel()}")
    if ref.shape[0] != 1:
        raise ValueError(f"{op}: with cu_seqlens the sequences are packed into B == 1, but {ref_name} has "
                         f"B={ref.shape[0]} (shape {_shape(ref)})")
    if cu_seqlens.device != ref.device:
        raise ValueError(f"{op}: cu_seqlens is on {cu_seqlens.device} but {ref_name} is on {ref.device}")
    return cu_seqlens.numel() - 1


def _check_state(op: str, name: str, h, shape: tuple[int, ...], layout: str, device: torch.device) -> None:
    _check_tensor(op, name, h, len(shape), layout)
    if h.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: {name} must have a floating dtype, got {h.dtype}")
    if tuple(h.shape) != shape:
        hint = f" {_LAYOUT_HINT}" if h.shape[1] != shape[1] else ""
        raise ValueError(f"{op}: {name} must have shape {layout} = {shape}, got {_shape(h)}.{hint}")
    if h.device != device:
        raise ValueError(f"{op}: {name} is on {h.device} but the inputs are on {device}")


def _run_value_checks(op: str, checks: list[tuple[torch.Tensor, callable]]) -> None:
    """Each check is (0-d bool tensor that is True when fine, message builder). One host sync."""
    if not checks:
        return
    oks = torch.stack([ok for ok, _ in checks]).tolist()
    for ok, (_, message) in zip(oks, checks):
        if not ok:
            raise ValueError(f"{op}: {message()}")


def _log_decay_check(name: str, x: torch.Tensor) -> tuple[torch.Tensor, callable]:
    x = x.detach()

    def message() -> str:
        bad = ~(x <= 0)
        nan = int(torch.isnan(x).sum())
        top = x[bad & ~torch.isnan(x)]
        worst = f", the largest is {top.max().item():.4g}" if top.numel() else ""
        return (f"{name} must be a log-decay (<= 0 everywhere: the decay is exp({name}) in (0, 1]); found "
                f"{int(bad.sum())} positive or NaN entries ({nan} NaN){worst}. Pass the log of the decay, "
                f"e.g. -exp(x) or logsigmoid(x), not the decay itself")
    return (x <= 0).all(), message


def _cu_seqlens_checks(cu_seqlens, T: int) -> list[tuple[torch.Tensor, callable]]:
    if cu_seqlens is None:
        return []
    cu = cu_seqlens.detach()
    return [
        (cu[0] == 0, lambda: f"cu_seqlens must start at 0, got {cu[0].item()}"),
        (cu[-1] == T, lambda: f"cu_seqlens must end at T={T} (the packed length), got {cu[-1].item()}"),
        ((cu[1:] >= cu[:-1]).all(), lambda: f"cu_seqlens must be non-decreasing, got {cu.tolist()}"),
    ]


def check_rwkv6_inputs(op, r, k, v, w, u, scale, initial_state, output_final_state, cu_seqlens) -> None:
    """Validate the arguments of chunk_rwkv6 / fused_recurrent_rwkv6 (see checks module docstring)."""
    for name, x in (("r", r), ("k", k), ("w", w), ("v", v)):
        _check_tensor(op, name, x, 4, "[B, T, H, K]" if name != "v" else "[B, T, H, V]")
    _check_tensor(op, "u", u, 2, "[H, K]")
    B, T, H, K = r.shape
    _check_token_major(op, "r", r, {"k": k, "w": w, "v": v}, dims={"k": K, "w": K})
    if tuple(u.shape) != (H, K):
        raise ValueError(f"{op}: u must have shape [H, K] = {(H, K)} (from r {_shape(r)}), got {_shape(u)}. "
                         f"{_LAYOUT_HINT}")
    _check_float_dtypes(op, {"r": r, "k": k, "v": v, "w": w}, same=True)
    _check_float_dtypes(op, {"u": u}, same=False)
    _check_devices(op, {"r": r, "k": k, "v": v, "w": w, "u": u})
    _check_scale(op, scale)
    _check_flag(op, "output_final_state", output_final_state)
    N = _check_cu_seqlens(op, cu_seqlens, "r", r)
    if initial_state is not None:
        _check_state(op, "initial_state", initial_state, (N, H, K, v.shape[-1]), "[N, H, K, V]", r.device)
    if _value_checks:
        _run_value_checks(op, [_log_decay_check("w", w)] + _cu_seqlens_checks(cu_seqlens, T))


def check_rwkv7_inputs(op, r, w, k, v, a, b, scale, initial_state, output_final_state, cu_seqlens,
                       gate_lower_bound) -> None:
    """Validate the arguments of chunk_rwkv7 / fused_recurrent_rwkv7 (see checks module docstring)."""
    for name, x in (("r", r), ("w", w), ("k", k), ("v", v), ("a", a), ("b", b)):
        _check_tensor(op, name, x, 4, "[B, T, H, K]" if name != "v" else "[B, T, H, V]")
    B, T, H, K = r.shape
    _check_token_major(op, "r", r, {"w": w, "k": k, "a": a, "b": b, "v": v}, dims=dict.fromkeys("wkab", K))
    tensors = {"r": r, "w": w, "k": k, "v": v, "a": a, "b": b}
    _check_float_dtypes(op, tensors, same=True)
    _check_devices(op, tensors)
    _check_scale(op, scale)
    _check_flag(op, "output_final_state", output_final_state)
    if gate_lower_bound is not None:
        if isinstance(gate_lower_bound, bool) or not isinstance(gate_lower_bound, (int, float)):
            raise TypeError(f"{op}: gate_lower_bound must be None or a Python number, got "
                            f"{type(gate_lower_bound).__name__}")
        if not (math.isfinite(gate_lower_bound) and gate_lower_bound < 0):
            raise ValueError(f"{op}: gate_lower_bound must be a finite negative number, got {gate_lower_bound}")
    N = _check_cu_seqlens(op, cu_seqlens, "r", r)
    if initial_state is not None:
        _check_state(op, "initial_state", initial_state, (N, H, K, v.shape[-1]), "[N, H, K, V]", r.device)
    if _value_checks:
        checks = [_log_decay_check("w", w)] + _cu_seqlens_checks(cu_seqlens, T)
        if gate_lower_bound is not None:
            wd = w.detach()
            checks.append(((wd >= gate_lower_bound).all(), lambda: (
                f"w must respect gate_lower_bound={gate_lower_bound} (w >= bound everywhere), but its minimum "
                f"is {wd.min().item():.4g}")))
        _run_value_checks(op, checks)


def check_gsa_inputs(op, q, k, v, s, g, scale, initial_state, output_final_state, cu_seqlens) -> None:
    """Validate the arguments of chunk_gsa / fused_recurrent_gsa (see checks module docstring)."""
    if g is None:
        raise ValueError(f"{op}: g=None (gates derived from s, the ABC mode) is not defined in flame; pass the "
                         "slot log-forget g [B, T, H, M], e.g. logsigmoid(f) / 8, with s = 1 - exp(g)")
    for name, x, layout in (("q", q, "[B, T, HQ, K]"), ("k", k, "[B, T, H, K]"), ("v", v, "[B, T, H, V]"),
                            ("s", s, "[B, T, H, M]"), ("g", g, "[B, T, H, M]")):
        _check_tensor(op, name, x, 4, layout)
    B, T, H, K = k.shape
    M = s.shape[-1]
    _check_token_major(op, "k", k, {"v": v, "s": s, "g": g}, dims={"g": M})
    HQ = q.shape[2]
    if q.shape[0] != B or q.shape[1] != T:
        raise ValueError(f"{op}: q has shape {_shape(q)} but k has {_shape(k)}: they must share B={B} and T={T}. "
                         f"{_LAYOUT_HINT}")
    if HQ % H:
        raise ValueError(f"{op}: q has {HQ} heads, which is not a multiple of the {H} key/value heads of k "
                         f"(grouped queries need HQ = G * H). {_LAYOUT_HINT}")
    if q.shape[3] != K:
        raise ValueError(f"{op}: q and k must share the key dim K={K}; q has shape {_shape(q)}")
    tensors = {"q": q, "k": k, "v": v, "s": s, "g": g}
    _check_float_dtypes(op, tensors, same=True)
    _check_devices(op, tensors)
    _check_scale(op, scale)
    _check_flag(op, "output_final_state", output_final_state)
    N = _check_cu_seqlens(op, cu_seqlens, "k", k)
    if initial_state is not None:
        if not isinstance(initial_state, (tuple, list)) or len(initial_state) != 2:
            raise TypeError(f"{op}: initial_state must be None or the pair (hk [N, H, K, M], hv [N, H, M, V]), "
                            f"got {type(initial_state).__name__}")
        hk, hv = initial_state
        _check_state(op, "initial_state[0] (hk)", hk, (N, H, K, M), "[N, H, K, M]", k.device)
        _check_state(op, "initial_state[1] (hv)", hv, (N, H, M, v.shape[-1]), "[N, H, M, V]", k.device)
    if _value_checks:
        _run_value_checks(op, [_log_decay_check("g", g)] + _cu_seqlens_checks(cu_seqlens, T))
