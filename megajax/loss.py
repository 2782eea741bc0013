"""Next-token cross-entropy with a loss mask and an optional z-loss (PaLM), in fp32.

Losses are returned as *sums* over masked tokens with the token count beside them, so
gradient accumulation over microbatches divides once by the global count and equals the
full-batch gradient exactly.
"""

import jax
import jax.numpy as jnp


def cross_entropy_sums(logits: jax.Array, targets: jax.Array, loss_mask: jax.Array,
                       z_loss: float = 0.0) -> tuple[jax.Array, dict]:
  """logits f32[b, s, vocab], targets int32[b, s], loss_mask [b, s] -> (objective sum, stats)."""
  logits = logits.astype(jnp.float32)
  mask = loss_mask.astype(jnp.float32)
  log_normalizer = jax.nn.logsumexp(logits, axis=-1)                          # [b, s]
  target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  nll_sum = jnp.sum((log_normalizer - target_logits) * mask)
  z_sum = jnp.sum(jnp.square(log_normalizer) * mask)
  stats = {"nll_sum": nll_sum, "z_sum": z_sum, "tokens": jnp.sum(mask)}
  return nll_sum + z_loss * z_sum, stats


def cross_entropy(logits: jax.Array, targets: jax.Array, loss_mask: jax.Array,
                  z_loss: float = 0.0) -> jax.Array:
  """Mean objective per masked token."""
  total, stats = cross_entropy_sums(logits, targets, loss_mask, z_loss)
  return total / jnp.maximum(stats["tokens"], 1.0)
