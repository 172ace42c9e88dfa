"""flame: pretraining for linear-attention language models (RWKV6, RWKV7, GSA)."""

__version__ = "0.1.0"
