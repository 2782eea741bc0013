"""The optimizer: LAMB (MegaScale's choice for 4x batches) or AdamW, from optax parts.

LAMB = clip -> Adam moments -> + weight decay -> x trust ratio ||w|| / ||u|| -> x -lr.
Weight decay and the trust ratio apply to matrices (kernels, embeddings) only: biases and
LayerNorm scales keep plain Adam steps (optax.lamb's `mask` covers only the decay).
"""

from __future__ import annotations

import jax
import ml_collections
import optax

# Leaf names of the parameters that get weight decay and a trust ratio.
MATRIX_PARAM_NAMES = ("kernel", "embedding", "head")


def matrix_mask(params):
  """True for weight matrices, False for biases and norm scales (by parameter name)."""
  def is_matrix(path, _):
    return getattr(path[-1], "key", None) in MATRIX_PARAM_NAMES
  return jax.tree_util.tree_map_with_path(is_matrix, params)


def learning_rate_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
  """Linear warmup to the peak, cosine decay to end_lr_ratio * peak at the last step.

  Indexed by optax's update count (0 for the first update); the curve is read at count + 1
  so the first update is not spent at learning rate 0 and the last one lands on the end value.
  """
  o = config.optimizer
  curve = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=o.learning_rate, warmup_steps=o.warmup_steps,
      decay_steps=config.train.steps, end_value=o.learning_rate * o.end_lr_ratio)
  return lambda count: curve(count + 1)


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  o = config.optimizer
  schedule = learning_rate_schedule(config)
  clip = [optax.clip_by_global_norm(o.grad_clip_norm)] if o.grad_clip_norm > 0 else []
  if o.name == "lamb":
    return optax.chain(
        *clip,
        optax.scale_by_adam(b1=o.b1, b2=o.b2, eps=o.eps),
        optax.add_decayed_weights(o.weight_decay, mask=matrix_mask),
        optax.masked(optax.scale_by_trust_ratio(), matrix_mask),
        optax.scale_by_learning_rate(schedule))
  if o.name == "adamw":
    return optax.chain(
        *clip,
        optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=matrix_mask))
  raise ValueError(f"optimizer.name={o.name!r}")  # validate() rejects this before we get here.
