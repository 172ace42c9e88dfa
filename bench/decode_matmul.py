"""Speed of flame.ops.decode_matmul on one CUDA GPU against the PyTorch composition it replaces in
a decoding step (norm_mix, torch.bmm / nn.Linear on cuBLAS, the activations), at the 340M
models' shapes (hidden 1024), bf16, batch 1, 8 and 64:

    python -m bench.decode_matmul
    python -m bench.decode_matmul --batch-sizes 1,8,64,256 --cases rwkv7_in,ffn

Cases (what one sub-layer of a decoding step launches):
- rwkv7_in: RWKV7's norm, six token-shift lerps, r/k/v and the four LoRAs' first matrices with
  tanh/sigmoid. Composition: norm_mix, bmm (r, k, v), bmm (LoRA firsts), tanh_, sigmoid_.
- lora_out: RWKV7's four LoRA second matrices (rank 160 -> 1024 each): bmm.
- ffn: RWKV7's channel mix: norm_mix (+ residual add), key Linear, squared_relu, value Linear.
- out_residual: the output projection and the residual add: Linear, then the add (in the next
  norm_mix in the composition; here an add_).
- gsa_mlp: GSA's RMSNorm, gate/up, silu(gate) * up, down: norm_mix, Linear, silu * up, Linear.
- gemv_*: one plain projection (N x K) against F.linear, with the achieved weight bandwidth.

Times are medians of `triton.testing.do_bench` (microseconds per call, one call = the whole case);
`ratio` = fused / composition (< 1: the fused launches are faster).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.timing import require_cuda
from flame.ops.decode_matmul import Segment, decode_matmul
from flame.ops.norm_mix import norm_mix
from flame.ops.squared_relu import squared_relu

C, RANK, FFN = 1024, 160, 4096


def _w(*shape, device):
    return (torch.randn(*shape, device=device) / shape[-1] ** 0.5).to(torch.bfloat16)


def case_rwkv7_in(B, device):
    x, prev, h = (torch.randn(B, C, device=device, dtype=torch.bfloat16) for _ in range(3))
    ln_w, ln_b = torch.ones(C, device=device), torch.zeros(C, device=device)
    mu = torch.rand(6, C, device=device, dtype=torch.bfloat16)
    rkv, lora_in = _w(3, C, C, device=device), _w(4, C, RANK, device=device)
    attn_in = torch.cat([rkv.flatten(0, 1), lora_in.transpose(1, 2).flatten(0, 1)])
    segments = (Segment(C, 0), Segment(C, 1), Segment(C, 2), Segment(RANK, 2), Segment(RANK, 3),
                Segment(RANK, 4, "tanh"), Segment(RANK, 5, "sigmoid"))

    def composed():
        lerps = norm_mix(x, ln_w, ln_b, 1e-5, previous=prev.clone(), mu=mu)
        torch.bmm(lerps[0:3], rkv.transpose(1, 2))
        hidden = torch.bmm(lerps[2:6], lora_in)
        hidden[2].tanh_()
        hidden[3].sigmoid_()

    def fused():
        decode_matmul(x, attn_in, segments, norm="layer", norm_weight=ln_w, norm_bias=ln_b, eps=1e-5, previous=prev,
                      mu=mu, h_out=h)
    return composed, fused, attn_in.numel() * 2


def case_lora_out(B, device):
    hidden = torch.randn(4, B, RANK, device=device, dtype=torch.bfloat16)
    lora_out = _w(4, RANK, C, device=device)
    flat = lora_out.transpose(1, 2).flatten(0, 1).contiguous()
    segments = tuple(Segment(C, i) for i in range(4))
    return (lambda: torch.bmm(hidden, lora_out)), (lambda: decode_matmul(hidden, flat, segments)), flat.numel() * 2


def case_ffn(B, device):
    x, prev, h, add = (torch.randn(B, C, device=device, dtype=torch.bfloat16) for _ in range(4))
    ln_w, ln_b = torch.ones(C, device=device), torch.zeros(C, device=device)
    mu = torch.rand(1, C, device=device, dtype=torch.bfloat16)
    key, value = _w(FFN, C, device=device), _w(C, FFN, device=device)

    def composed():
        lerps = norm_mix(x, ln_w, ln_b, 1e-5, add=add, previous=prev.clone(), mu=mu)
        F.linear(squared_relu(F.linear(lerps[0], key)), value)

    def fused():
        k = decode_matmul(x, key, (Segment(FFN, 0, "sqrelu"),), norm="layer", norm_weight=ln_w, norm_bias=ln_b,
                          eps=1e-5, previous=prev, mu=mu, h_out=h)
        decode_matmul(k[None], value, residual=x, commit=(h, prev))
    return composed, fused, (key.numel() + value.numel()) * 2


def case_out_residual(B, device):
    x, y, h, prev = (torch.randn(B, C, device=device, dtype=torch.bfloat16) for _ in range(4))
    out = _w(C, C, device=device)
    return (lambda: x.add_(F.linear(y, out))), (lambda: decode_matmul(y[None], out, residual=x, commit=(h, prev))), \
        out.numel() * 2


def case_gsa_mlp(B, device):
    width = 2816
    x = torch.randn(B, C, device=device, dtype=torch.bfloat16)
    rms_w = torch.ones(C, device=device)
    gate_up, down = _w(2 * width, C, device=device), _w(C, width, device=device)

    def composed():
        h = norm_mix(x, rms_w, None, 1e-6, norm="rms")
        gate, up = F.linear(h, gate_up).chunk(2, dim=1)
        x.add_(F.linear(F.silu(gate) * up, down))

    def fused():
        hidden = decode_matmul(x, gate_up, (Segment(width, 0, "swiglu"),), norm="rms", norm_weight=rms_w, eps=1e-6)
        decode_matmul(hidden[None], down, residual=x)
    return composed, fused, (gate_up.numel() + down.numel()) * 2


def gemv_case(N, K):
    def build(B, device):
        x = torch.randn(1, B, K, device=device, dtype=torch.bfloat16)
        w = _w(N, K, device=device)
        return (lambda: F.linear(x[0], w)), (lambda: decode_matmul(x, w)), w.numel() * 2
    return build


CASES = {"rwkv7_in": case_rwkv7_in, "lora_out": case_lora_out, "ffn": case_ffn, "out_residual": case_out_residual,
         "gsa_mlp": case_gsa_mlp, "gemv_1024x1024": gemv_case(1024, 1024), "gemv_4096x1024": gemv_case(4096, 1024),
         "gemv_1024x4096": gemv_case(1024, 4096)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="1,8,64")
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args(argv)
    require_cuda("bench.decode_matmul")
    from triton.testing import do_bench

    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16; microseconds per call (median)")
    print(f"{'case':<16} {'B':>4} {'composed':>10} {'fused':>10} {'ratio':>6} {'fused weight GB/s':>18}")
    for name in args.cases.split(","):
        for B in (int(b) for b in args.batch_sizes.split(",")):
            torch.manual_seed(0)
            composed, fused, weight_bytes = CASES[name](B, device)
            with torch.no_grad():
                t_comp = do_bench(composed, return_mode="median") * 1e3
                t_fused = do_bench(fused, return_mode="median") * 1e3
            print(f"{name:<16} {B:>4} {t_comp:>10.1f} {t_fused:>10.1f} {t_fused / t_comp:>6.2f} "
                  f"{weight_bytes / t_fused / 1e3:>18.0f}")


if __name__ == "__main__":
    main()
