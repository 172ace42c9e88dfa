"""The squared ReLU of the RWKV channel mixes, relu(x)^2, with a backward that reads only its output;
and the channel mix's key product, squared ReLU and value product as one op."""

from .squared_relu import squared_relu
from .squared_relu_mlp import squared_relu_mlp

__all__ = ["squared_relu", "squared_relu_mlp"]
