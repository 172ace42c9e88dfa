"""Activation checkpointing: which activations a block keeps for its backward and which it
recomputes there (training.activation_checkpoint).

"full" recomputes the whole block and "selective" every second matmul (torchtitan's FullAC and
SelectiveAC); "elementwise", flame's own policy (`keep_matmuls_and_attention`), keeps the outputs of
the matrix products and of flame's ops and recomputes the elementwise glue between them.
`flame.train.parallelize` applies it first, before compile and FSDP.
"""

from __future__ import annotations

import torch
from torch import nn

from flame.train.compile_cache import source_fingerprint


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Wrap each block of `model.layers` for recomputation in the backward: "full" (the whole
    block), "selective" (torchtitan's op policy: every second matmul), or "elementwise" (only
    the elementwise glue, `keep_matmuls_and_attention`)."""
    if mode == "none":
        return
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    if mode == "full":
        FullAC(FullAC.Config()).apply(model)
    elif mode == "selective":
        SelectiveAC(SelectiveAC.Config(force_recompute_mm_shapes_by_fqns=[])).apply(model)
    elif mode == "elementwise":
        for index, block in enumerate(model.layers):
            model.layers[index] = recompute_elementwise(block)
    else:
        raise ValueError(
            f"training.activation_checkpoint must be 'none', 'full', 'selective' or 'elementwise', "
            f"got {mode!r}"
        )


_NORMS = ("flame::norm_fwd", "flame::add_norm_fwd")
_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten.linear.default}


def keep_matmuls_and_attention(ctx, func, *args, **kwargs):
    """The "elementwise" policy: a block saves for its backward the outputs of its matrix
    products, of flame's ops (namespace `flame`) but its norms, and of autocast's casts of its
    parameters, and recomputes the rest (norms, gates, activations). Of the token-shift lerps
    (`token_shift_mix`), it recomputes those whose recomputation moves fewer than two tensors per
    output it spares (RWKV7's six static lerps: one read and six writes for six outputs; the
    two of RWKV6's channel mix), and keeps the others (a single lerp; RWKV6's five data-dependent
    ones, which read x and five offsets).
    Compiled, the recomputation runs inside the backward's fused kernels, which read the saved
    matmul outputs anyway: about half the activation memory for a few percent of GPU time
    (bench/RESULTS.md, whole training step). The bf16 weight copies are kept: recomputed, each
    would be a kernel of its own that reads the fp32 weight again in every micro-batch's backward."""
    from torch.utils.checkpoint import CheckpointPolicy

    if func.name() == "flame::token_shift_mix_fwd" and not _lerps_worth_saving(*args[:3]):
        return CheckpointPolicy.PREFER_RECOMPUTE
    if func.name() in _NORMS:  # elementwise: one or two reads, one or two writes
        return CheckpointPolicy.PREFER_RECOMPUTE
    if func in _MATMULS or func.namespace == "flame":
        return CheckpointPolicy.MUST_SAVE
    if func in _CASTS and _is_parameter(args[0]):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _lerps_worth_saving(x, mu, m) -> bool:
    """Whether recomputing token_shift_mix(x, mu, m) would move at least two tensors per output:
    it reads x and the N_M offsets m and writes N outputs."""
    outputs, offsets = mu.shape[0], (m.shape[0] if m is not None else 0)
    return 1 + offsets + outputs >= 2 * outputs


_CASTS = {torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default}


def _is_parameter(t) -> bool:
    """Whether `t` is a module parameter: the nn.Parameter itself in eager mode; under torch.compile
    the functional wrapper of the fake tensor that Dynamo marks as a parameter (`_is_param`)."""
    if isinstance(t, nn.Parameter):
        return True
    from torch._subclasses.functional_tensor import FunctionalTensor

    if isinstance(t, FunctionalTensor):
        t = torch._from_functional_tensor(t.elem)
    return bool(getattr(t, "_is_param", False))


def recompute_elementwise(block: nn.Module) -> nn.Module:
    """`block` wrapped so that its backward recomputes the elementwise ops (`keep_matmuls_and_attention`)."""
    from functools import partial

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    context_fn = partial(create_selective_checkpoint_contexts, keep_matmuls_and_attention)
    context_fn.cache_hash = source_fingerprint()  # torch's compile cache keys the policy on it
    return checkpoint_wrapper(block, preserve_rng_state=False, context_fn=context_fn)
