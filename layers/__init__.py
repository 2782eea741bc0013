"""Model building blocks (Flax): attention with its back ends, the MLP, the norms, initializers.

`ATTENTION_IMPLS` maps `model.attention_impl` to an attention function: `xla` (the reference
every kernel is tested against), `pallas` (our sliding-window kernels, `kernels/`) and
`cudnn` (jax.nn.dot_product_attention, the comparator). `NORM_MODULES` maps `model.norm`
(layernorm, rmsnorm) to its module; `MLP_INPUTS` and `MLP_ACTIVATIONS` define `model.mlp`'s
families (gelu, swiglu).
"""

from megajax.layers.attention import (ATTENTION_IMPLS, Attention, cudnn_attention, rotary_embedding,
                                     sliding_window_mask, xla_attention)
from megajax.layers.mlp import MLP_ACTIVATIONS, MLP_INPUTS, Mlp, gelu, swiglu
from megajax.layers.norms import NORM_MODULES, layer_norm, rms_norm

__all__ = ["ATTENTION_IMPLS", "Attention", "MLP_ACTIVATIONS", "MLP_INPUTS", "Mlp", "NORM_MODULES", "cudnn_attention",
           "gelu", "layer_norm", "rms_norm", "rotary_embedding", "sliding_window_mask", "swiglu", "xla_attention"]
