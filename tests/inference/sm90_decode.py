"""Compile the decoding step's Triton kernels (flame.ops.decode_matmul and the families' decode_step)
for an H100 (sm_90) on a machine without GPU, in the specializations the 340M models launch, with
tests/ops/sm90_compile.py's recorder and compiler.

    python -m tests.inference.sm90_decode      (TRITON_INTERPRET unset)

prints one line per compiled kernel (registers, spills, shared memory) and exits non-zero when
any fails.
"""

import os
import sys

import torch

from tests.ops.sm90_compile import compile_all, record_launches


def decode_launches():
    """The launches of one decoding step of each 340M family at batch 4, in bf16, on CPU tensors."""
    import flame.ops.decode_matmul.decode_matmul_triton  # noqa: F401 - its kernel is recorded
    from flame.ops.gsa.decode_step_triton import gsa_decode_step_triton
    from flame.ops.rwkv6.decode_step_triton import rwkv6_decode_step_triton
    from flame.ops.rwkv7.decode_step_triton import rwkv7_decode_step_triton

    launches = record_launches()
    B, C, H, N = 4, 1024, 16, 64
    bf16 = torch.bfloat16
    rows = lambda n=1: torch.zeros(n, B, C, dtype=bf16)  # noqa: E731
    vec = lambda: torch.zeros(C, dtype=bf16)  # noqa: E731
    x = rows()[0]

    proj, lora = rows(3), rows(4)
    per_head = torch.zeros(H, N, dtype=bf16)
    state = torch.zeros(B, H, N, N)
    for first in (True, False):
        rwkv7_decode_step_triton(*proj, lora[2], lora[1], lora[0], lora[3], x.clone(), vec(), vec(), vec(), vec(),
                                 vec(), per_head, vec(), vec(), 64e-5, state, 0.6065, first)
    rwkv6_decode_step_triton(*proj, lora[0], lora[1], vec(), per_head, vec(), vec(), 64e-5, state)

    for HQ, HK, K, M in ((4, 4, 256, 64), (4, 2, 256, 64)):  # the 340M GSA, and grouped queries
        qkvf = torch.zeros(B, HQ * K + 2 * HK * K + HK * M, dtype=bf16)
        q, k, v, f = qkvf.split([HQ * K, HK * K, HK * K, HK * M], dim=1)
        gsa_decode_step_triton(q, k, v, f, 8.0, torch.zeros(B, HK, K, M), torch.zeros(B, HK, M, K))
    decode_matmul_launches()
    # On CPU tensors the kernels record plain launches; an H100 launches them as programmatic
    # dependents (flame.ops.utils.dependent_launch), the specialization compiled here.
    return [(kernel, {**values, "PDL": True} if "PDL" in values else values, options)
            for kernel, values, options in launches]


def decode_matmul_launches() -> None:
    """decode_matmul's launches in a decoding step of each 340M family, at batch 1 and 4 (the GEMV
    path) and 17 and 64 (the tl.dot path), in bf16."""
    from flame.ops.decode_matmul import Segment
    from flame.ops.decode_matmul.decode_matmul_triton import decode_matmul_triton

    C, R = 1024, 160
    bf16 = torch.bfloat16
    vec = lambda n=C: torch.zeros(n, dtype=bf16)  # noqa: E731
    for B in (1, 4, 17, 64):
        x, prev, h = (torch.zeros(B, C, dtype=bf16) for _ in range(3))

        def call(inputs, segments, norm=None, silu=False, mu=None, mix=None, h_out=None, gate=None, commit=False):
            rows = sum(s.weight_rows for s in segments)
            weight = torch.zeros(rows, inputs.shape[-1], dtype=bf16)
            residual = x if commit or gate is not None or (norm and silu) else None
            decode_matmul_triton(inputs, weight, segments, norm, vec(inputs.shape[-1]) if norm else None,
                                 vec(inputs.shape[-1]) if norm else None, 1e-5, silu, prev if mu is not None else None,
                                 mu, mix, h_out, residual, gate, (h, prev) if commit else None)

        stack = lambda p, k: torch.zeros(B, p * k, dtype=bf16).unflatten(1, (p, k)).transpose(0, 1)  # noqa: E731
        # RWKV7: r, k, v and the LoRAs' first matrices; their second; output; channel mix
        call(x, (Segment(C, 0), Segment(C, 1), Segment(C, 2), Segment(R, 2), Segment(R, 3), Segment(R, 4, "tanh"),
                 Segment(R, 5, "sigmoid")), "layer", mu=torch.zeros(6, C, dtype=bf16), h_out=h)
        call(stack(4, R), tuple(Segment(C, i) for i in range(4)))
        call(stack(1, C), (Segment(C),), commit=True)
        call(x, (Segment(4 * C, 0, "sqrelu"),), "layer", mu=torch.zeros(1, C, dtype=bf16), h_out=h)
        call(stack(1, 4 * C), (Segment(C),), commit=True)
        # RWKV6: the mix LoRA, the data-dependent lerps' projections, the decay LoRA, the gated channel mix
        call(x, (Segment(160, 0, "tanh"),), "layer", mu=torch.zeros(1, C, dtype=bf16), h_out=h)
        call(stack(5, 32), tuple(Segment(C, i) for i in range(5)))
        call(x, (*(Segment(C, i) for i in range(1, 5)), Segment(64, 0, "tanh")), "layer",
             mu=torch.zeros(5, C, dtype=bf16), mix=stack(5, C))
        call(stack(1, 64), (Segment(C),))
        call(x, (Segment(3584, 0, "sqrelu"), Segment(C, 1)), "layer", mu=torch.zeros(2, C, dtype=bf16), h_out=h)
        call(stack(1, 3584), (Segment(C),), gate=torch.zeros(B, 2 * C, dtype=bf16)[:, C:], commit=True)
        # GSA: q, k, v, f; the output norm of silu(o) into the residual; swiglu; down into the residual
        call(x, (Segment(3 * C + 256),), "rms")
        call(x, (Segment(C),), "rms", silu=True)
        call(x, (Segment(2816, 0, "swiglu"),), "rms")
        call(stack(1, 2816), (Segment(C),), gate=None, commit=False)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") != "1", "the sm_90 compile check needs TRITON_INTERPRET unset"
    sys.exit(1 if compile_all(decode_launches()) else 0)
