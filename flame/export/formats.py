"""`is_foreign_weights` under the name flame.train.trainer imports it; the readers of exported
weights are flame.weights.foreign."""

from flame.weights.foreign import is_foreign_weights

__all__ = ["is_foreign_weights"]
