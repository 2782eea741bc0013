"""The transformer's feed-forward network: hidden -> mlp_dim -> GeLU -> hidden."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from megajax.layers import initializers


class Mlp(nn.Module):
  mlp_dim: int
  use_bias: bool = True
  init_std: float = 0.02
  out_init_std: float = 0.02
  dtype: jnp.dtype = jnp.bfloat16
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    # x: [b, s, hidden]
    hidden = x.shape[-1]
    h = nn.Dense(self.mlp_dim, use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype,
                 kernel_init=initializers.normal(self.init_std, ("embed", "mlp")),
                 bias_init=initializers.zeros(("mlp",)), name="wi")(x)          # [b, s, mlp]
    h = nn.gelu(h, approximate=True)
    return nn.Dense(hidden, use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype,
                    kernel_init=initializers.normal(self.out_init_std, ("mlp", "embed")),
                    bias_init=initializers.zeros(("embed",)), name="wo")(h)     # [b, s, hidden]
