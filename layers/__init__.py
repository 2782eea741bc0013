"""Model building blocks (Flax): attention with its back ends, the MLP, the norms, initializers.

`ATTENTION_IMPLS` maps `model.attention_impl` to an attention function: `xla` (the reference
every kernel is tested against), `pallas` (our sliding-window kernels, `kernels/`) and
`cudnn` (jax.nn.dot_product_attention, the comparator). `NORM_MODULES` maps `model.norm`
(layernorm, rmsnorm) to its module, `MLP_ACTIVATIONS` `model.mlp` to its activation. What each
block, norm, MLP and attention family is (its norms, fused operands, parameters, planner
terms) is stated once in `families.py`.
"""

from megajax.layers.attention import (ATTENTION_IMPLS, Attention, cudnn_attention, rotary_embedding,
                                     sliding_window_mask, xla_attention)
from megajax.layers.families import ATTENTION_FUSED, BLOCK_FAMILIES, MLP_FAMILIES, NORM_FAMILIES
from megajax.layers.mlp import MLP_ACTIVATIONS, Mlp, gelu, swiglu
from megajax.layers.norms import NORM_MODULES, layer_norm, rms_norm

__all__ = ["ATTENTION_FUSED", "ATTENTION_IMPLS", "Attention", "BLOCK_FAMILIES", "MLP_ACTIVATIONS", "MLP_FAMILIES", "Mlp",
           "NORM_FAMILIES", "NORM_MODULES", "cudnn_attention",
           "gelu", "layer_norm", "rms_norm", "rotary_embedding", "sliding_window_mask", "swiglu", "xla_attention"]
