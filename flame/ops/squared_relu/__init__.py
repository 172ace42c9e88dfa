"""The squared ReLU of the RWKV channel mixes, relu(x)^2, with a backward that reads only its output."""

from .squared_relu import squared_relu

__all__ = ["squared_relu"]
