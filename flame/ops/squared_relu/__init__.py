"""The RWKV channel mixes' key product, squared ReLU and value product, relu(x W_k^T)^2 W_v^T, as one op
whose Triton form computes the activation in the products' epilogues."""

from .squared_relu_mlp import squared_relu_mlp

__all__ = ["squared_relu_mlp"]
