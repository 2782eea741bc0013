"""Model building blocks: attention (with its reference and kernel back ends), MLP, norms."""

from megajax.layers.attention import (ATTENTION_IMPLS, Attention, cudnn_attention, rotary_embedding,
                                     sliding_window_mask, xla_attention)
from megajax.layers.mlp import Mlp
from megajax.layers.norms import layer_norm

__all__ = ["ATTENTION_IMPLS", "Attention", "Mlp", "cudnn_attention", "layer_norm", "rotary_embedding", "sliding_window_mask",
           "xla_attention"]
