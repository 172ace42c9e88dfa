"""GSA ops."""

from .naive import naive_gsa

__all__ = ["naive_gsa"]
