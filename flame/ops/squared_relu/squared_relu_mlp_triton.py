"""The channel mix's two products around relu(.)^2 with the activation in the product's epilogue.

One tiled matrix product c = a @ b (fp32 accumulation over K), two epilogues:
- SQRELU: y = relu(c)^2, the forward's key product and activation in one pass: the pre-activation
  x W_k^T never reaches memory;
- SQRELU_GRAD: dk = 2 sqrt(y) c, the backward's dy = dout W_v and the activation's gradient in one
  pass (relu(k) = sqrt(y) for y >= 0): dy never reaches memory.
Both round once, from fp32, to the output dtype. Tiles move through tensor-memory-access
descriptors (their zero fill covers the edges of M, N and K). The programs are persistent, one
per SM, each walking output tiles in groups of GROUP_M tile rows so that the tiles running at
once share their b columns in L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..common.chunk_triton.intra import INTERPRET, mm

SQRELU = 0
SQRELU_GRAD = 1

# Tiles and launch settings (module constants so that a benchmark can sweep them).
BLOCK_M = 128
BLOCK_N = 256
BLOCK_K = 64
GROUP_M = 8
NUM_WARPS = 8
NUM_STAGES = 3
PERSISTENT = True


@triton.jit
def _dot_acc(a, b, acc, DT: tl.constexpr):
    """acc + a @ b with fp32 accumulation: the chunk kernels' `mm` for fp32 operands and under the
    interpreter; on the GPU the accumulator goes into the tensor-core product itself."""
    if DT == tl.float32 or INTERPRET:
        return acc + mm(a, b, DT)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _matmul_epilogue_kernel(a_desc, b_desc, y_desc, out_desc, M, N, K,
                            EPILOGUE: tl.constexpr, B_TRANSPOSED: tl.constexpr, DT: tl.constexpr,
                            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    per_group = GROUP * tiles_n
    for tile in range(tl.program_id(0), tiles_m * tiles_n, tl.num_programs(0)):
        first_m = (tile // per_group) * GROUP
        rows_in_group = min(tiles_m - first_m, GROUP)
        off_m = (first_m + (tile % per_group) % rows_in_group) * BM
        off_n = ((tile % per_group) // rows_in_group) * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            b_a = a_desc.load([off_m, k0])
            if B_TRANSPOSED:
                acc = _dot_acc(b_a, b_desc.load([off_n, k0]).T, acc, DT)
            else:
                acc = _dot_acc(b_a, b_desc.load([k0, off_n]), acc, DT)
        if EPILOGUE == 0:
            r = tl.maximum(acc, 0.0)
            result = r * r
        else:
            result = 2.0 * tl.sqrt(y_desc.load([off_m, off_n]).to(tl.float32)) * acc
        out_desc.store([off_m, off_n], result.to(out_desc.dtype))


_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy of it where its data does not start on 16 bytes, as a descriptor's base must (a
    view into a larger buffer can start anywhere)."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


def matmul_epilogue(a: torch.Tensor, b: torch.Tensor, epilogue: int, y: torch.Tensor | None = None,
                    b_transposed: bool = False) -> torch.Tensor:
    """epilogue(a @ b) as a new [M, N] tensor of a's dtype, for a [M, K] row-major and b [K, N]
    row-major, or b given as its transpose [N, K] row-major (b_transposed: an nn.Linear weight):
    SQRELU relu(a @ b)^2; SQRELU_GRAD 2 sqrt(y) (a @ b), y [M, N] row-major."""
    M, K = a.shape
    N = b.shape[0] if b_transposed else b.shape[1]
    out = torch.empty(M, N, device=a.device, dtype=a.dtype)
    if M == 0 or N == 0:
        return out
    a, b = _aligned(a), _aligned(b)
    a_desc = TensorDescriptor.from_tensor(a, [BLOCK_M, BLOCK_K])
    b_desc = TensorDescriptor.from_tensor(b, [BLOCK_N, BLOCK_K] if b_transposed else [BLOCK_K, BLOCK_N])
    out_desc = TensorDescriptor.from_tensor(out, [BLOCK_M, BLOCK_N])
    y_desc = out_desc if y is None else TensorDescriptor.from_tensor(_aligned(y), [BLOCK_M, BLOCK_N])
    tiles = triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N)
    if PERSISTENT and a.device.type == "cuda":
        tiles = min(tiles, torch.cuda.get_device_properties(a.device).multi_processor_count)
    _matmul_epilogue_kernel[(tiles,)](
        a_desc, b_desc, y_desc, out_desc, M, N, K, EPILOGUE=epilogue, B_TRANSPOSED=b_transposed,
        DT=_TL[a.dtype], BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, GROUP=GROUP_M,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out


@torch.library.custom_op("flame::squared_relu_mlp_fwd", mutates_args=())
def _fwd_op(x: torch.Tensor, w_key: torch.Tensor, w_value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = matmul_epilogue(x, w_key, SQRELU, b_transposed=True)
    return y @ w_value.t(), y


@_fwd_op.register_fake
def _(x, w_key, w_value):
    return x.new_empty(x.shape[0], w_value.shape[0]), x.new_empty(x.shape[0], w_key.shape[0])


@torch.library.custom_op("flame::squared_relu_mlp_bwd", mutates_args=())
def _bwd_op(dout: torch.Tensor, x: torch.Tensor, y: torch.Tensor, w_key: torch.Tensor,
            w_value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dk = matmul_epilogue(dout, w_value, SQRELU_GRAD, y)
    return dk @ w_key, dk.t() @ x, dout.t() @ y


@_bwd_op.register_fake
def _(dout, x, y, w_key, w_value):
    return torch.empty_like(x), torch.empty_like(w_key), torch.empty_like(w_value)


def _setup_context(ctx, inputs, output):
    x, w_key, w_value = inputs
    ctx.save_for_backward(x, output[1], w_key, w_value)


def _backward(ctx, dout, dy):
    x, y, w_key, w_value = ctx.saved_tensors
    # y is an internal output (saved for the backward, never used by the caller): dy is None or zeros
    return torch.ops.flame.squared_relu_mlp_bwd(dout.contiguous(), x, y, w_key, w_value)


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def squared_relu_mlp_triton(x: torch.Tensor, w_key: torch.Tensor, w_value: torch.Tensor) -> torch.Tensor:
    """x [M, C] -> relu(x w_key^T)^2 w_value^T [M, C_out]; the inputs contiguous, of one 16-bit dtype
    (or fp32 under the interpreter), widths multiples of 8 (16-byte rows for the descriptors)."""
    return torch.ops.flame.squared_relu_mlp_fwd(x, w_key, w_value)[0]
