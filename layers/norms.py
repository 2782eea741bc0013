"""The normalizations (model.norm), statistics in fp32 whatever the compute dtype.

  layernorm  y = (x - mean(x)) / sqrt(var(x) + eps) * scale + bias   (GPT, MegaScale)
  layernorm_nobias   the same without the bias                       (Cohere)
  rmsnorm    y = x / sqrt(mean(x^2) + eps) * scale                   (Llama, Mistral: no bias)
"""

import flax.linen as nn
import jax.numpy as jnp

from megajax.layers import initializers


def layer_norm(epsilon: float, dtype: jnp.dtype, param_dtype: jnp.dtype, name: str) -> nn.LayerNorm:
  return nn.LayerNorm(epsilon=epsilon, dtype=dtype, param_dtype=param_dtype, name=name,
                      scale_init=initializers.ones(("embed",)), bias_init=initializers.zeros(("embed",)))


def layer_norm_nobias(epsilon: float, dtype: jnp.dtype, param_dtype: jnp.dtype, name: str) -> nn.LayerNorm:
  return nn.LayerNorm(epsilon=epsilon, use_bias=False, dtype=dtype, param_dtype=param_dtype, name=name,
                      scale_init=initializers.ones(("embed",)))


def rms_norm(epsilon: float, dtype: jnp.dtype, param_dtype: jnp.dtype, name: str) -> nn.RMSNorm:
  return nn.RMSNorm(epsilon=epsilon, dtype=dtype, param_dtype=param_dtype, name=name,
                    scale_init=initializers.ones(("embed",)))


# model.norm -> the module's constructor (keys: families.NORM_FAMILIES).
NORM_MODULES = {"layernorm": layer_norm, "layernorm_nobias": layer_norm_nobias, "rmsnorm": rms_norm}
