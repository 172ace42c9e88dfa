"""flame.inference: loading, generation and evaluation of a trained model (docs/architecture.md#flameinference)."""

from flame.inference.compiled import compile_supported, compiled_blocks
from flame.inference.decoder import Decoder, decoder_for, prefill, release_decoders
from flame.inference.evaluation import evaluate, lm_metrics
from flame.inference.generation import TextStream, generate, sample_next
from flame.inference.load import InferenceError, load_for_inference, resolve_dtype

__all__ = [
    "Decoder",
    "InferenceError",
    "TextStream",
    "compile_supported",
    "compiled_blocks",
    "decoder_for",
    "evaluate",
    "generate",
    "lm_metrics",
    "load_for_inference",
    "prefill",
    "release_decoders",
    "resolve_dtype",
    "sample_next",
]
