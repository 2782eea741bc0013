"""The transformer's feed-forward network (model.mlp), in two families:

  gelu        wo(gelu(wi(x)))                 GPT, MegaScale: hidden -> mlp_dim -> hidden, GeLU's tanh form
  gelu_exact  the same with the erf GeLU      GPT-NeoX / Pythia checkpoints (Hugging Face "gelu")
  swiglu      wo(silu(wi_gate(x)) * wi_up(x)) Llama, Mistral: two input projections of mlp_dim

A family is its input projections (families.MLP_FAMILIES) and the activation of their
outputs (MLP_ACTIVATIONS); the 3D step (megajax.parallel.tensor_parallel) reads both, so it computes
what this module does on its shard of the mlp units. The activation runs in the compute
dtype, like the linears around it.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from megajax.layers import initializers
from megajax.layers.families import MLP_FAMILIES


def gelu(h: jax.Array) -> jax.Array:
  return nn.gelu(h, approximate=True)


def gelu_exact(h: jax.Array) -> jax.Array:
  return nn.gelu(h, approximate=False)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
  return nn.silu(gate) * up


# model.mlp -> the activation of its input projections' outputs (keys: families.MLP_FAMILIES,
# whose rows name the projections, in the order the 3D step fuses them into its column matmul).
MLP_ACTIVATIONS = {"gelu": gelu, "gelu_exact": gelu_exact, "swiglu": swiglu}


class Mlp(nn.Module):
  mlp_dim: int
  family: str = "gelu"
  use_bias: bool = True
  init_std: float = 0.02
  out_init_std: float = 0.02
  dtype: jnp.dtype = jnp.bfloat16
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    # x: [b, s, hidden]; tensor parallelism splits the mlp units (the "mlp" logical axis).
    projections = [nn.Dense(self.mlp_dim, use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype,
                            kernel_init=initializers.normal(self.init_std, ("embed", "mlp")),
                            bias_init=initializers.zeros(("mlp",)), name=name)(x)   # [b, s, mlp] each
                   for name in MLP_FAMILIES[self.family].inputs]
    h = MLP_ACTIVATIONS[self.family](*projections)
    return nn.Dense(x.shape[-1], use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype,
                    kernel_init=initializers.normal(self.out_init_std, ("mlp", "embed")),
                    bias_init=initializers.zeros(("embed",)), name="wo")(h)     # [b, s, hidden]
