"""Model building blocks (Flax): attention with its back ends, MLP, LayerNorm, initializers.

`ATTENTION_IMPLS` maps `model.attention_impl` to an attention function: `xla` (the reference
every kernel is tested against), `pallas` (our sliding-window kernels, `kernels/`) and
`cudnn` (jax.nn.dot_product_attention, the comparator).
"""

from megajax.layers.attention import (ATTENTION_IMPLS, Attention, cudnn_attention, rotary_embedding,
                                     sliding_window_mask, xla_attention)
from megajax.layers.mlp import Mlp
from megajax.layers.norms import layer_norm

__all__ = ["ATTENTION_IMPLS", "Attention", "Mlp", "cudnn_attention", "layer_norm", "rotary_embedding", "sliding_window_mask",
           "xla_attention"]
