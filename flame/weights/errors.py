"""The one error of a failed read of weights on disk, and the one-line form of a cause."""

from __future__ import annotations

MESSAGE_LIMIT = 500
"""Characters of a cause's first line kept in an error message."""


class WeightsError(RuntimeError):
    """Weights on disk cannot be read or used: a checkpoint or an export that is missing,
    incomplete, corrupt, of another format or of another model. The message says which and why."""


def first_line(err: BaseException) -> str:
    """The first line of `err`'s message, at most MESSAGE_LIMIT characters ("" when empty)."""
    text = str(err).strip()
    return text.splitlines()[0][:MESSAGE_LIMIT] if text else ""


__all__ = ["MESSAGE_LIMIT", "WeightsError", "first_line"]
