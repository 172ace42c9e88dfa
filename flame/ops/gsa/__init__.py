"""GSA ops: public chunk_gsa / fused_recurrent_gsa and the naive_gsa oracle."""

from .chunk import chunk_gsa
from .fused_recurrent import fused_recurrent_gsa
from .naive import naive_gsa

__all__ = ["chunk_gsa", "fused_recurrent_gsa", "naive_gsa"]
