"""Backend resolution and input validation of the public ops: every error is clear and names the problem."""

import pytest
import torch

from flame.ops import (chunk_gsa, chunk_rwkv6, chunk_rwkv7, fused_recurrent_gsa, fused_recurrent_rwkv6,
                       fused_recurrent_rwkv7, set_value_checks)
from flame.ops.utils.backend import resolve_backend
from flame.ops.utils.checks import value_checks_enabled
from tests.ops.inputs import make_cu_seqlens, make_gsa_inputs, make_rwkv6_inputs, make_rwkv7_inputs


@pytest.fixture
def value_checks_off():
    set_value_checks(False)
    yield
    set_value_checks(True)


# ---------------------------------------------------------------------------------------------
# backend resolution

def test_auto_picks_triton_for_cuda_and_torch_for_cpu():
    assert resolve_backend("auto", torch.device("cpu"), "op") == "torch"
    assert resolve_backend("auto", torch.device("cuda", 0), "op") == "triton"
    assert resolve_backend("torch", torch.device("cuda", 0), "op") == "torch"
    assert resolve_backend("triton", torch.device("cuda", 0), "op") == "triton"


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("triton", torch.device("cpu"), "op") == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        resolve_backend("triton", torch.device("cpu"), "chunk_rwkv6")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="backend='torch'"):
        resolve_backend("triton", torch.device("cpu"), "chunk_rwkv6")


def test_triton_on_other_devices_is_an_error():
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        resolve_backend("triton", torch.device("meta"), "op")


@pytest.mark.parametrize("bad", ["cuda", "Torch", "", None, 1])
def test_unknown_backend_lists_the_choices(bad):
    with pytest.raises(ValueError, match="'auto', 'triton', 'torch'"):
        resolve_backend(bad, torch.device("cpu"), "op")


@pytest.mark.parametrize("op,make", [
    (chunk_rwkv6, lambda: make_rwkv6_inputs(1, 8, 1, 4, 4)),
    (fused_recurrent_rwkv7, lambda: make_rwkv7_inputs(1, 8, 1, 4, 4)),
    (chunk_gsa, lambda: make_gsa_inputs(1, 8, 1, 4, 4, 4)),
])
def test_public_ops_reject_an_unknown_backend(op, make):
    with pytest.raises(ValueError, match=f"{op.__name__}: backend must be one of"):
        op(**make(), backend="cuda")


# ---------------------------------------------------------------------------------------------
# RWKV6 validation (chunk and fused_recurrent share it)

RWKV6_OPS = [chunk_rwkv6, fused_recurrent_rwkv6]


def _rwkv6(**changes):
    x = make_rwkv6_inputs(2, 8, 2, 4, 6)
    x.update(changes)
    return x


def _rwkv6_cases():
    base = make_rwkv6_inputs(2, 8, 2, 4, 6)
    r, k, v, w, u, h0 = (base[n] for n in ("r", "k", "v", "w", "u", "initial_state"))
    return [
        ("r_not_tensor", dict(r=r.tolist()), TypeError, "r must be a torch.Tensor"),
        ("r_3d", dict(r=r[0]), ValueError, r"r must be a 4-D tensor \[B, T, H, K\]"),
        ("k_other_K", dict(k=torch.randn(2, 8, 2, 5)), ValueError, "k must have last dim 4"),
        ("v_other_T", dict(v=torch.randn(2, 9, 2, 6)), ValueError, "must share B=2 and T=8"),
        ("w_other_heads", dict(w=torch.randn(2, 8, 3, 4).clamp(max=0)), ValueError, "w has 3 heads"),
        ("u_shape", dict(u=torch.randn(2, 5)), ValueError, r"u must have shape \[H, K\] = \(2, 4\)"),
        ("u_1d", dict(u=torch.randn(4)), ValueError, "u must be a 2-D tensor"),
        ("int_dtype", dict(r=r.long(), k=k.long(), v=v.long(), w=w.long()), TypeError, "floating dtype"),
        ("device", dict(u=u.to("meta")), ValueError, "every tensor must be on one device"),
        ("scale_tensor", dict(scale=torch.tensor(1.0)), TypeError, "scale must be a Python number"),
        ("scale_nan", dict(scale=float("nan")), ValueError, "scale must be finite"),
        ("flag", dict(output_final_state=1), TypeError, "output_final_state must be a bool"),
        ("state_shape", dict(initial_state=h0[:, :, :, :5]), ValueError,
         r"initial_state must have shape \[N, H, K, V\] = \(2, 2, 4, 6\)"),
        ("state_dtype", dict(initial_state=h0.long()), TypeError, "initial_state must have a floating dtype"),
        ("state_device", dict(initial_state=h0.to("meta")), ValueError, "initial_state is on meta"),
        ("cu_with_B2", dict(cu_seqlens=make_cu_seqlens([3, 5])), ValueError, "packed into B == 1"),
    ]


@pytest.mark.parametrize("op", RWKV6_OPS)
@pytest.mark.parametrize("case", _rwkv6_cases(), ids=lambda c: c[0])
def test_rwkv6_bad_inputs(op, case):
    _, changes, error, message = case
    with pytest.raises(error, match=message):
        op(**_rwkv6(**changes))


def _varlen6(**changes):
    x = make_rwkv6_inputs(1, 8, 2, 4, 6, initial_state=False)
    x.update(changes)
    return x


@pytest.mark.parametrize("op", RWKV6_OPS)
@pytest.mark.parametrize("cu,error,message", [
    ([3, 5], None, None),
    (torch.tensor([0.0, 8.0]), ValueError, "1-D int32 or int64"),
    (torch.tensor([[0, 8]]), ValueError, "1-D int32 or int64"),
    (torch.tensor([0]), ValueError, r"N\+1 >= 2 offsets"),
    (torch.tensor([1, 8]), ValueError, "must start at 0"),
    (torch.tensor([0, 7]), ValueError, "must end at T=8"),
    (torch.tensor([0, 5, 3, 8]), ValueError, "non-decreasing"),
])
def test_rwkv6_cu_seqlens(op, cu, error, message):
    if isinstance(cu, list):
        cu = make_cu_seqlens(cu, dtype=torch.int64)
        o, h = op(**_varlen6(), cu_seqlens=cu, output_final_state=True)
        assert h.shape == (2, 2, 4, 6)
        return
    with pytest.raises(error, match=message):
        op(**_varlen6(), cu_seqlens=cu)


def test_cu_seqlens_must_be_a_tensor():
    with pytest.raises(TypeError, match="cu_seqlens must be a 1-D integer torch.Tensor"):
        chunk_rwkv6(**_varlen6(), cu_seqlens=[0, 8])


def test_varlen_initial_state_needs_one_state_per_sequence():
    cu = make_cu_seqlens([3, 5])
    with pytest.raises(ValueError, match=r"\(2, 2, 4, 6\), got \(1, 2, 4, 6\)"):
        chunk_rwkv6(**_varlen6(initial_state=torch.zeros(1, 2, 4, 6)), cu_seqlens=cu)


@pytest.mark.parametrize("op", RWKV6_OPS)
def test_rwkv6_value_checks(op, value_checks_off):
    """Positive or NaN log-decays and bad cu_seqlens values pass when value checks are off."""
    assert not value_checks_enabled()
    x = _varlen6(w=torch.full((1, 8, 2, 4), 0.5))
    op(**x, cu_seqlens=torch.tensor([0, 5, 3, 8]))
    set_value_checks(True)
    with pytest.raises(ValueError, match="w must be a log-decay"):
        op(**x)
    x["w"] = torch.full((1, 8, 2, 4), float("nan"))
    with pytest.raises(ValueError, match=r"\(64 NaN\)"):
        op(**x)


# ---------------------------------------------------------------------------------------------
# RWKV7 validation

RWKV7_OPS = [chunk_rwkv7, fused_recurrent_rwkv7]


@pytest.mark.parametrize("op", RWKV7_OPS)
@pytest.mark.parametrize("name", ["w", "k", "a", "b"])
def test_rwkv7_key_tensors_must_match_r(op, name):
    x = make_rwkv7_inputs(2, 8, 2, 4, 6)
    x[name] = torch.zeros(2, 8, 2, 5)
    with pytest.raises(ValueError, match=f"{name} must have last dim 4"):
        op(**x)


@pytest.mark.parametrize("op", RWKV7_OPS)
def test_rwkv7_state_and_dtype(op):
    x = make_rwkv7_inputs(2, 8, 2, 4, 6)
    with pytest.raises(ValueError, match=r"initial_state must have shape \[N, H, K, V\] = \(2, 2, 4, 6\)"):
        op(**{**x, "initial_state": torch.zeros(2, 2, 6, 4)})
    # mixed dtypes compute in the promoted dtype, exactly as the inputs cast up front
    mixed = op(**{**x, "a": x["a"].half()})
    cast = op(**{**x, "a": x["a"].half().float()})
    torch.testing.assert_close(mixed[0], cast[0], rtol=0, atol=0)
    assert mixed[0].dtype == torch.float32


@pytest.mark.parametrize("op", RWKV7_OPS)
def test_rwkv7_autocast_computes_in_the_autocast_dtype(op):
    x = make_rwkv7_inputs(2, 8, 2, 4, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, _ = op(**{**x, "r": x["r"].bfloat16()})  # bf16 activations beside fp32 ones, as autocast makes
    cast = {n: (t.bfloat16() if n in "rwkvab" else t) for n, t in x.items()}
    ref, _ = op(**cast)
    assert o.dtype == torch.bfloat16
    torch.testing.assert_close(o, ref, rtol=0, atol=0)


@pytest.mark.parametrize("op", RWKV7_OPS)
def test_rwkv7_gate_lower_bound(op):
    x = make_rwkv7_inputs(1, 8, 2, 4, 4)       # w in (-0.6066, 0]
    op(**x, gate_lower_bound=-0.61)
    with pytest.raises(ValueError, match="finite negative number"):
        op(**x, gate_lower_bound=0.5)
    with pytest.raises(TypeError, match="gate_lower_bound must be None or a Python number"):
        op(**x, gate_lower_bound="-0.6")
    with pytest.raises(ValueError, match="w must respect gate_lower_bound=-0.01"):
        op(**x, gate_lower_bound=-0.01)


# ---------------------------------------------------------------------------------------------
# GSA validation

GSA_OPS = [chunk_gsa, fused_recurrent_gsa]


@pytest.mark.parametrize("op", GSA_OPS)
def test_gsa_rejects_missing_gate(op):
    x = make_gsa_inputs(1, 8, 2, 4, 4, 3)
    with pytest.raises(ValueError, match="g=None .* is not defined"):
        op(**{**x, "g": None})


@pytest.mark.parametrize("op", GSA_OPS)
@pytest.mark.parametrize("changes,error,message", [
    (dict(q=torch.randn(1, 8, 3, 4)), ValueError, "q has 3 heads, which is not a multiple of the 2"),
    (dict(q=torch.randn(1, 8, 4, 5)), ValueError, "q and k must share the key dim K=4"),
    (dict(q=torch.randn(1, 9, 2, 4)), ValueError, "must share B=1 and T=8"),
    (dict(s=torch.randn(1, 8, 3, 3)), ValueError, "s has 3 heads"),
    (dict(g=torch.zeros(1, 8, 2, 4)), ValueError, "g must have last dim 3"),
    (dict(initial_state=torch.zeros(1, 2, 4, 3)), TypeError, r"initial_state must be None or the pair"),
    (dict(initial_state=(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))), ValueError,
     r"initial_state\[0\] \(hk\) must have shape \[N, H, K, M\] = \(1, 2, 4, 3\)"),
    (dict(initial_state=(torch.zeros(1, 2, 4, 3), torch.zeros(1, 2, 4, 3))), ValueError,
     r"initial_state\[1\] \(hv\) must have shape \[N, H, M, V\] = \(1, 2, 3, 4\)"),
    (dict(g=torch.full((1, 8, 2, 3), 0.1)), ValueError, "g must be a log-decay"),
])
def test_gsa_bad_inputs(op, changes, error, message):
    x = make_gsa_inputs(1, 8, 2, 4, 4, 3)
    with pytest.raises(error, match=message):
        op(**{**x, **changes})


@pytest.mark.parametrize("op", GSA_OPS)
def test_gsa_grouped_queries_accepted(op):
    x = make_gsa_inputs(1, 8, 2, 4, 5, 3, HQ=6)
    o, (hk, hv) = op(**x, output_final_state=True)
    assert o.shape == (1, 8, 6, 5) and hk.shape == (1, 2, 4, 3) and hv.shape == (1, 2, 3, 5)
