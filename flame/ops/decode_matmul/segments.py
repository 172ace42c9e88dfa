"""The output segments of a decode_matmul launch: which input each part of the output reads and
which activation it applies (shared by the PyTorch form and the Triton kernel's tile table)."""

from __future__ import annotations

from typing import NamedTuple

ACTIVATIONS = (None, "tanh", "sigmoid", "sqrelu", "swiglu")


class Segment(NamedTuple):
    """`width` output columns computed from input `source` (a row of the input stack, or a lerp)
    with activation `act` (one of ACTIVATIONS); their weight rows are the next `width` rows of the
    concatenated weight (2 x width for "swiglu")."""
    width: int
    source: int = 0
    act: str | None = None

    @property
    def weight_rows(self) -> int:
        return 2 * self.width if self.act == "swiglu" else self.width
