"""The optimizer: LAMB (MegaScale's choice for 4x batches) or AdamW, from optax parts.

LAMB = clip -> Adam moments -> + weight decay -> x trust ratio ||w|| / ||u|| -> x -lr.
Weight decay and the trust ratio apply to matrices (kernels, embeddings) only: biases and
LayerNorm scales keep plain Adam steps (optax.lamb's `mask` covers only the decay).

The two steps that need norms (global-norm clipping, the trust ratio) take `TensorNorms`
when the tensors are sharded: the 3D step passes ones that sum each leaf's local squares
over the mesh axes the leaf is split on, so LAMB sees the norms of the whole tensors and
the sharded update equals the single-device one. Without them they are optax's own.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

# Leaf names of the parameters that get weight decay and a trust ratio.
MATRIX_PARAM_NAMES = ("kernel", "embedding", "head")


def matrix_mask(params):
  """True for weight matrices, False for biases and norm scales (by parameter name)."""
  def is_matrix(path, _):
    return getattr(path[-1], "key", None) in MATRIX_PARAM_NAMES
  return jax.tree_util.tree_map_with_path(is_matrix, params)


def learning_rate_schedule(optimizer, steps: int) -> optax.Schedule:
  """Linear warmup to the peak, cosine decay to end_lr_ratio * peak at the last of `steps`
  (train.steps); `optimizer`: the config's optimizer section.

  Indexed by optax's update count (0 for the first update); the curve is read at count + 1
  so the first update is not spent at learning rate 0 and the last one lands on the end value.
  """
  o = optimizer
  curve = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=o.learning_rate, warmup_steps=o.warmup_steps,
      decay_steps=steps, end_value=o.learning_rate * o.end_lr_ratio)
  return lambda count: curve(count + 1)


class TensorNorms(NamedTuple):
  """Squared L2 norms of whole tensors, computed from whatever shards a device holds."""
  per_tensor: Callable[[optax.Updates], optax.Updates]  # tree -> each tensor's squared norm,
                                                         # broadcastable against its leaf
  total: Callable[[optax.Updates], jax.Array]           # tree -> the squared global norm


def global_norm(tree, norms: TensorNorms) -> jax.Array:
  return jnp.sqrt(norms.total(tree))


def clip_by_global_norm(max_norm: float, norms: TensorNorms) -> optax.GradientTransformation:
  """optax.clip_by_global_norm, with the norm taken by `norms`."""
  def update_fn(updates, state, params=None):
    del params
    norm = global_norm(updates, norms)
    keep = norm < max_norm
    return jax.tree.map(lambda t: jnp.where(keep, t, (t / norm.astype(t.dtype)) * max_norm), updates), state
  return optax.GradientTransformation(optax.init_empty_state, update_fn)


def scale_by_trust_ratio(mask_fn, norms: TensorNorms) -> optax.GradientTransformation:
  """optax.masked(optax.scale_by_trust_ratio(), mask_fn), with the norms taken by `norms`."""
  def update_fn(updates, state, params):
    param_norms = jax.tree.map(jnp.sqrt, norms.per_tensor(params))
    update_norms = jax.tree.map(jnp.sqrt, norms.per_tensor(updates))

    def scale(update, param_norm, update_norm, masked):
      ratio = jnp.where((param_norm == 0.0) | (update_norm == 0.0), 1.0, param_norm / update_norm)
      return update * ratio.astype(update.dtype) if masked else update
    return jax.tree.map(scale, updates, param_norms, update_norms, mask_fn(params)), state
  return optax.GradientTransformation(optax.init_empty_state, update_fn)


def make_optimizer(optimizer, steps: int, norms: TensorNorms | None = None) -> optax.GradientTransformation:
  """LAMB or AdamW as the optimizer section says, over `steps` (train.steps). `norms`: the
  whole-tensor norms of sharded leaves (see above)."""
  o = optimizer
  schedule = learning_rate_schedule(optimizer, steps)
  if norms is None:
    clip = optax.clip_by_global_norm(o.grad_clip_norm)
    trust_ratio = optax.masked(optax.scale_by_trust_ratio(), matrix_mask)
  else:
    clip = clip_by_global_norm(o.grad_clip_norm, norms)
    trust_ratio = scale_by_trust_ratio(matrix_mask, norms)
  clip = [clip] if o.grad_clip_norm > 0 else []
  if o.name == "lamb":
    return optax.chain(
        *clip,
        optax.scale_by_adam(b1=o.b1, b2=o.b2, eps=o.eps),
        optax.add_decayed_weights(o.weight_decay, mask=matrix_mask),
        trust_ratio,
        optax.scale_by_learning_rate(schedule))
  if o.name == "adamw":
    return optax.chain(
        *clip,
        optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=matrix_mask))
  raise ValueError(f"optimizer.name={o.name!r}")  # validate() rejects this before we get here.
