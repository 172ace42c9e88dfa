"""The error of an export that cannot be written."""

from __future__ import annotations

from flame.weights import WeightsError


class ExportError(WeightsError):
    """The model cannot be written in the asked format (the format cannot hold it), or the output
    cannot be written where asked. Reading the run's weights fails with a `WeightsError`."""


__all__ = ["ExportError"]
