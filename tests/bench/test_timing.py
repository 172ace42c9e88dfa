"""The grouping of a profiler trace's kernels by kind (bench/timing.py), as bench.train_step and
bench.rwkvlm's profiles report them."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from bench.timing import kernel_base_name, kernel_kind, kernel_times


def test_kernel_base_name_drops_return_type_namespace_templates_and_arguments():
    assert kernel_base_name("void forward_kernel<64>(int, float const*)") == "forward_kernel"
    assert kernel_base_name("_bwd_maps_kernel") == "_bwd_maps_kernel"
    assert kernel_base_name("tmix_mix6_forward_kernel(__nv_bfloat16*, int)") == "tmix_mix6_forward_kernel"
    assert kernel_base_name("void (anonymous namespace)::l2wrap_ce_forward_v2_kernel<c10::BFloat16, 512>"
                            "(c10::BFloat16 const*, long const*)") == "l2wrap_ce_forward_v2_kernel"
    assert kernel_base_name("(anonymous namespace)::relu_sq_inplace_vec2_kernel(c10::BFloat16*, long)") == \
        "relu_sq_inplace_vec2_kernel"


def test_kernel_kind_by_name_and_by_mark():
    attention, loss = {"forward_kernel", "_bwd_maps_kernel"}, {"l2wrap_ce_forward_v2_kernel"}
    assert kernel_kind("void forward_kernel<64>(int)", attention, loss) == "attention"
    assert kernel_kind("_bwd_maps_kernel", attention, loss) == "attention"
    assert kernel_kind("void l2wrap_ce_forward_v2_kernel(float*)", attention, loss) == "loss"
    assert kernel_kind("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", attention, loss) == "matmul"
    assert kernel_kind("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<X>(Y)",
                       attention, loss) == "optimizer"
    assert kernel_kind("tmix_mix6_forward_kernel", attention, loss) == "other"


def _event(name: str, start: float, end: float, device=torch.autograd.DeviceType.CUDA):
    return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end),
                           is_user_annotation=False)


def test_kernel_times_per_step_by_kind_by_kernel_and_busy_time():
    events = [_event("void forward_kernel<64>(int)", 0, 1000), _event("nvjet_x", 500, 1500),
              _event("forward_kernel_cpu_side", 0, 9000, torch.autograd.DeviceType.CPU),
              _event("ProfilerStep#1", 0, 9000), _event("void forward_kernel<64>(int)", 3000, 4000),
              _event("tiny", 5000, 5010)]
    prof = SimpleNamespace(events=lambda: events)
    got = kernel_times(prof, steps=2, attention={"forward_kernel"}, loss=set())
    assert got["gpu_ms_per_step"] == {"matmul": 0.5, "attention": 1.0, "loss": 0.0, "optimizer": 0.0,
                                      "other": 0.005}
    assert got["gpu_busy_ms_per_step"] == (1500 + 1000 + 10) / 1e3 / 2
    # per kernel name, largest first, and only those of at least 0.05 ms per step
    assert got["top_kernels_ms_per_step"] == [("void forward_kernel<64>(int)", 1.0), ("nvjet_x", 0.5)]
