"""The GPT decoder: embeddings -> N blocks -> final norm -> logits.

The blocks (model.block), with N a norm (model.norm: LayerNorm or RMSNorm) and MLP the
feed-forward network (model.mlp: GeLU or SwiGLU):
parallel (MegaScale's PTB, one shared norm):
    y = x + Attn(N(x)) + MLP(N(x))
parallel_two_norms (GPT-NeoX / GPT-J's parallel residual, a norm per branch):
    y = x + Attn(N1(x)) + MLP(N2(x))
serial (GPT / Megatron / Llama pre-norm):
    z = x + Attn(N1(x));  y = z + MLP(N2(z))

Parameters are fp32 (param_dtype), matmuls run in compute_dtype, logits are fp32.

Which code trains: not these Flax modules' __call__. Training runs the 3D-parallel forward
pass (megajax.parallel.tensor_parallel, inside megajax.parallel.ParallelStep) on the very
parameter pytree `init_params` returns, each device holding its shards; that path is tested
equal to this module (loss, gradients, parameters after steps) on every mesh shape. This
module defines the parameters (names, shapes, initializers, logical axes), and is the model
of the Python API and of the single-device reference step (megajax.reference_step).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from megajax.layers import NORM_MODULES, Attention, Mlp, initializers
from megajax.sections import ModelConfig   # the model section resolved (typed once, there)


def _attention(config: ModelConfig, window: int | None) -> Attention:
  # GPT-2: residual-output projections scaled by 1/sqrt(2 * layers) keep the stream's variance flat.
  return Attention(
      num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
      window=window, rope_theta=config.rope_theta, rope=window is not None or config.global_rope, use_bias=config.use_bias, qkv_bias=config.qkv_bias,
      init_std=config.init_std, out_init_std=config.init_std / math.sqrt(2 * config.num_layers), impl=config.attention_impl,
      dtype=config.compute_dtype, param_dtype=config.param_dtype, name="attention")


def _mlp(config: ModelConfig) -> Mlp:
  return Mlp(mlp_dim=config.mlp_dim, family=config.mlp, use_bias=config.use_bias, init_std=config.init_std,
             out_init_std=config.init_std / math.sqrt(2 * config.num_layers),
             dtype=config.compute_dtype, param_dtype=config.param_dtype, name="mlp")


def norm(config: ModelConfig, name: str) -> nn.Module:
  """The model's norm (model.norm) named `name`; the 3D step applies these very modules."""
  return NORM_MODULES[config.norm](config.layernorm_epsilon, config.compute_dtype, config.param_dtype, name)


class ParallelBlock(nn.Module):
  config: ModelConfig
  window: int | None

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    h = norm(self.config, "norm")(x)                                      # [b, s, hidden]
    return x + _attention(self.config, self.window)(h, positions, segment_ids) + _mlp(self.config)(h)


class ParallelTwoNormsBlock(nn.Module):
  config: ModelConfig
  window: int | None

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    attended = _attention(self.config, self.window)(norm(self.config, "attention_norm")(x), positions, segment_ids)
    return x + attended + _mlp(self.config)(norm(self.config, "mlp_norm")(x))


class SerialBlock(nn.Module):
  config: ModelConfig
  window: int | None

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    z = x + _attention(self.config, self.window)(norm(self.config, "attention_norm")(x), positions, segment_ids)
    return z + _mlp(self.config)(norm(self.config, "mlp_norm")(z))


# model.block -> the Flax block (keys: megajax.config.BLOCK_CHOICES; the 3D step's sharded
# blocks are megajax.parallel.tensor_parallel.BLOCK_FUNCTIONS).
BLOCK_MODULES = {"parallel": ParallelBlock, "parallel_two_norms": ParallelTwoNormsBlock, "serial": SerialBlock}
# The name the 3D step's parallel linears give their outputs (megajax.parallel.collective_matmul):
# their backward is written out (a custom_vjp), which hides the dot inside from a policy that
# looks for dots, so "dots" saves them by this name.
PROJECTION_OUTPUT = "projection"
# model.remat -> what a recomputed block saves for its backward ("none": no recomputation).
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
        jax.checkpoint_policies.save_only_these_names(PROJECTION_OUTPUT)),
}


class GPT(nn.Module):
  """tokens int32[b, s] -> logits float32[b, s, vocab].

  Packed rows (several documents per row) pass segment_ids int32[b, s] (each token's
  document, non-decreasing along a row: attention stays within a document) and positions
  int32[b, s] (each token's position within its document, for the rotary embedding).
  Without them a row is one document: positions 0, 1, ... s - 1."""

  config: ModelConfig

  @nn.compact
  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None) -> jax.Array:
    c = self.config
    batch, seq = tokens.shape
    embedding = self.param("embedding", initializers.normal(c.init_std, ("vocab", "embed")),
                           (c.vocab_size, c.hidden_dim), c.param_dtype)
    x = jnp.take(embedding, tokens, axis=0).astype(c.compute_dtype)       # [b, s, hidden]
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(seq), (batch, seq))

    block_cls = BLOCK_MODULES[c.block]
    if c.remat != "none":
      block_cls = nn.remat(block_cls, policy=REMAT_POLICIES[c.remat])
    for layer in range(c.num_layers):
      x = block_cls(c, c.layer_window(layer), name=f"layer_{layer}")(x, positions, segment_ids)

    x = norm(c, "final_norm")(x)
    if c.tie_embeddings:
      head = embedding.T                                                  # [hidden, vocab]
    else:
      head = self.param("head", initializers.normal(c.init_std, ("embed", "vocab")),
                        (c.hidden_dim, c.vocab_size), c.param_dtype)
    # fp32 accumulation and output: the softmax over a large vocab is sensitive to bf16 rounding.
    logits = jnp.einsum("bsh,hv->bsv", x, head.astype(c.compute_dtype),
                        preferred_element_type=jnp.float32)               # [b, s, vocab]
    return logits * c.logit_scale if c.logit_scale != 1.0 else logits


@functools.partial(jax.jit, static_argnums=0)
def init_params(model: GPT, rng: jax.Array) -> dict:
  """Initializes the parameters as a plain pytree (logical-axis boxes removed): the pytree of
  `model.init`, each layer from its own key.

  The layers are initialized by one block's init vmapped over their keys, not layer by layer:
  every initializer draws its own threefry stream, so a program that unrolls the layers grows
  with depth (configs/default.py's model at 24 layers, XLA:CPU: 1,907 fusions and 22.4 s to
  compile unrolled, 283 and 8.8 s vmapped; the tests' 8-layer pipeline model at -O0: 7.3 s ->
  3.3 s), and this program compiles in every fresh state (ParallelStep.init_state, each device
  its shards). All layers have one parameter tree (a layer's window is not a parameter).
  Jitted as a whole, also when called outside a jit: its values are the same in every program
  that initializes the model (op by op, rounding could differ by an ulp)."""
  c = model.config
  shell_rng, layers_rng = jax.random.split(rng)
  tokens = jnp.zeros((1, c.seq_len), jnp.int32)
  # Embedding, final norm and head: the model without its layers.
  params = dict(nn.unbox(GPT(dataclasses.replace(c, num_layers=0)).init(shell_rng, tokens)["params"]))
  block = BLOCK_MODULES[c.block](c, c.layer_window(0))
  x, positions = jnp.zeros((1, c.seq_len, c.hidden_dim), c.compute_dtype), jnp.zeros((1, c.seq_len), jnp.int32)
  init_layer = lambda key: nn.unbox(block.init(key, x, positions)["params"])
  stacked = jax.vmap(init_layer)(jax.random.split(layers_rng, c.num_layers))
  for layer in range(c.num_layers):
    params[f"layer_{layer}"] = jax.tree.map(lambda leaf, i=layer: leaf[i], stacked)
  return params


def logical_axes(model: GPT) -> dict:
  """The logical axis names of every parameter (a pytree of PartitionSpecs), from shapes only."""
  tokens = jax.ShapeDtypeStruct((1, model.config.seq_len), jnp.int32)
  abstract = jax.eval_shape(model.init, jax.random.key(0), tokens)
  return nn.get_partition_spec(abstract)["params"]


def count_params(params) -> int:
  return sum(x.size for x in jax.tree.leaves(params))
