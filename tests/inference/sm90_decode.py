"""Compile the decoding step's Triton kernels (flame.ops.norm_mix and the families' decode_step)
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
    from flame.ops.gsa.decode_step_triton import gsa_decode_step_triton
    from flame.ops.norm_mix.norm_mix_triton import norm_mix_triton, shift_lerp_triton
    from flame.ops.rwkv6.decode_step_triton import rwkv6_decode_step_triton
    from flame.ops.rwkv7.decode_step_triton import rwkv7_decode_step_triton

    launches = record_launches()
    B, C, H, N = 4, 1024, 16, 64
    bf16 = torch.bfloat16
    rows = lambda n=1: torch.zeros(n, B, C, dtype=bf16)  # noqa: E731
    vec = lambda: torch.zeros(C, dtype=bf16)  # noqa: E731
    x, prev = rows()[0], rows()[0]
    wide = torch.zeros(B, 4 * C, dtype=bf16)[:, :C]  # a view of a wider matmul output
    for mu, add, gate, keep_delta in ((rows(6)[:, 0], None, None, False),          # RWKV7 layer 0's time mix
                                      (rows(6)[:, 0], wide, None, False),          # RWKV7's time mix
                                      (rows(1)[:, 0], wide, wide, True),           # RWKV6's time mix
                                      (rows(2)[:, 0], x, None, False)):            # a channel mix
        norm_mix_triton(x, vec(), vec(), 1e-5, "layer", add, gate, prev, mu, False, keep_delta)
    norm_mix_triton(x, vec(), vec(), 1e-5, "layer", wide, wide, None, None, False, False)  # the final norm
    norm_mix_triton(x, vec(), None, 1e-6, "rms", wide, None, None, None, False, False)  # GSA's block norms
    norm_mix_triton(x, vec(), None, 1e-6, "rms", None, None, None, None, True, False)  # GSA's output norm
    shift_lerp_triton(x, x, torch.zeros(5, C, dtype=bf16), rows(5))

    proj, lora = rows(3), rows(4)
    per_head = torch.zeros(H, N, dtype=bf16)
    state = torch.zeros(B, H, N, N)
    for first, gate_bias in ((True, torch.zeros(C)), (False, torch.zeros(C))):
        rwkv7_decode_step_triton(*proj, lora[2], lora[1], lora[0], lora[3], x.clone(), vec(), vec(), vec(), vec(),
                                 vec(), per_head, vec(), vec(), 64e-5, state, 0.6065, first, gate_bias)
    rwkv6_decode_step_triton(*proj, lora[0], lora[1], vec(), per_head, vec(), vec(), 64e-5, state)

    for HQ, HK, K, M in ((4, 4, 256, 64), (4, 2, 256, 64)):  # the 340M GSA, and grouped queries
        qkvf = torch.zeros(B, HQ * K + 2 * HK * K + HK * M, dtype=bf16)
        q, k, v, f = qkvf.split([HQ * K, HK * K, HK * K, HK * M], dim=1)
        gsa_decode_step_triton(q, k, v, f, 8.0, torch.zeros(B, HK, K, M), torch.zeros(B, HK, M, K))
    return launches


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") != "1", "the sm_90 compile check needs TRITON_INTERPRET unset"
    sys.exit(1 if compile_all(decode_launches()) else 0)
