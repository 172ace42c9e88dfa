"""Comparison helpers shared by all op tests (the metric of docs/kernels.md#test-metric)."""

import torch


def rel_rms_error(ref: torch.Tensor, out: torch.Tensor) -> float:
    """RMS(ref - out) / RMS(ref), computed in float64."""
    ref = ref.detach().double()
    out = out.detach().double()
    denom = ref.pow(2).mean().sqrt().clamp_min(1e-30)
    return ((ref - out).pow(2).mean().sqrt() / denom).item()


def assert_finite(name: str, t: torch.Tensor | None) -> None:
    if t is None:
        return
    bad = ~torch.isfinite(t)
    assert not bad.any(), f"{name}: {int(bad.sum())} non-finite values of {t.numel()}"


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, ratio: float, atol: float = 1e-6) -> None:
    """Pass if max|ref - out| <= atol; otherwise require finiteness and relative RMS error < ratio."""
    assert ref.shape == out.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    assert_finite(name, out)
    diff = (ref.detach().double() - out.detach().double()).abs().max().item()
    if diff <= atol:
        return
    err = rel_rms_error(ref, out)
    assert err < ratio, f"{name}: relative RMS error {err:.3e} >= {ratio:.1e} (max abs diff {diff:.3e})"
