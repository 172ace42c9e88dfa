"""Programmatic dependent launch: a decoding step's next kernel starts while the one before runs.

A decoding step is a chain of short kernels, each reading what the one before wrote. Launched
plainly, a kernel's programs start only once the one before has finished, and then wait on their
first loads from memory: at one token per sequence that latency is most of a kernel's time. On
Hopper and later GPUs a kernel launched with `launch_pdl=True` may start as soon as every program
of the kernel before it has signalled (`griddepcontrol.launch_dependents`); it first loads what no
earlier kernel of the chain writes (its weights, its own recurrent state), then waits
(`griddepcontrol.wait`) until the kernel before has finished and its writes are visible, and only
then reads its inputs and writes anything. CUDA graphs keep these launch edges when they capture
the stream.

The rule every kernel launched this way keeps: before `wait_for_producers`, load only tensors
that no kernel of the step writes, and store nothing.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .backend import triton_interpreter_enabled

ENV_SWITCH = "FLAME_DEPENDENT_LAUNCH"
"""Set to 0 to launch the decoding kernels plainly (one after the other, as on GPUs before Hopper)."""


@functools.cache
def _supported(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def dependent_launch(device: torch.device) -> bool:
    """Whether kernels on `device` launch as programmatic dependents: CUDA GPUs of compute
    capability 9.0 or later, not under Triton's interpreter, unless FLAME_DEPENDENT_LAUNCH=0."""
    if device.type != "cuda" or triton_interpreter_enabled() or os.environ.get(ENV_SWITCH, "1") == "0":
        return False
    return _supported(device)


@triton.jit
def wait_for_producers(PDL: tl.constexpr):
    """With PDL: wait until the kernel before has finished and its writes are visible, then let the
    next kernel start its own loads of constants. Without: nothing (a plain launch already waited)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def launch_options(pdl: bool) -> dict:
    """The launch keyword of a kernel with a PDL constexpr: {"launch_pdl": True} or nothing."""
    return {"launch_pdl": True} if pdl else {}
