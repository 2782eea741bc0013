"""LayerNorm with statistics in fp32 whatever the compute dtype."""

import flax.linen as nn
import jax.numpy as jnp

from megajax.layers import initializers


def layer_norm(epsilon: float, dtype: jnp.dtype, param_dtype: jnp.dtype, name: str) -> nn.LayerNorm:
  return nn.LayerNorm(epsilon=epsilon, dtype=dtype, param_dtype=param_dtype, name=name,
                      scale_init=initializers.ones(("embed",)), bias_init=initializers.zeros(("embed",)))
