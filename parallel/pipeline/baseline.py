"""The baseline our pipeline is measured against: GPipe by autodiff (MaxText's route).

Every stage runs its layers at every tick of a forward-only lax.scan (m + p - 1 ticks,
garbage in the bubbles), activations move one stage per tick by ppermute, and jax.grad
differentiates the whole scan. No conditionals, no hand-written backward, but autodiff
keeps every tick's residuals until the backward: activation memory grows with m. Only
`python -m megajax.launch.bench pipeline` and the tests use it; one chunk per stage (v = 1).
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp

from megajax.model import ModelConfig
from megajax.parallel import zero
from megajax.parallel.mesh import CP, DP, PP, TP, to_varying
from megajax.parallel.pipeline.executor import STAT_NAMES, stage_params, sum_over_stages
from megajax.parallel.pipeline.slots import row_at
from megajax.parallel.pipeline.stacking import LAYERS, compute_rows
from megajax.parallel.tensor_parallel import (Overlap, apply_block, head_loss_sums, positions_of,
                                              vocab_parallel_embed)
from megajax.reference_step import split_microbatches


def gpipe_autodiff_gradients(params, batch, layouts, stages: int, virtual_stages: int, microbatches: int,
                             c: ModelConfig, overlap: Overlap, z_loss: float, bucket_bytes: int = 0):
  """Same contract as megajax.parallel.pipeline.pipeline_gradients, for a pipeline with one chunk
  per stage (with more, a stage's rows are not consecutive layers); its dp collectives in
  buckets of `bucket_bytes` like the pipeline's."""
  if virtual_stages != 1:
    raise ValueError(f"virtual_stages={virtual_stages}: the GPipe-by-autodiff baseline runs one chunk per stage")
  p, m = stages, microbatches
  rows = c.num_layers // p
  if rows % len(c.window_pattern):
    raise ValueError(f"the baseline runs one program on every stage: {rows} layers per stage must be a "
                     f"multiple of window_pattern={c.window_pattern!r}")
  stage = lax.axis_index(PP)
  split = split_microbatches(batch, m)

  def objective(full):
    layers = compute_rows(full[LAYERS], c)              # each layer's compute form, once a step

    def tick(carry, t):
      received, stats = carry
      index = jnp.clip(t - stage, 0, m - 1)            # the microbatch this stage holds now
      valid = (t - stage >= 0) & (t - stage < m)
      mb = jax.tree.map(lambda x: row_at(x, index), split)
      x = jnp.where(stage == 0, vocab_parallel_embed(full["embedding"], mb["inputs"], c), received)
      positions = positions_of(mb)
      for j in range(rows):                             # row j is layer stage * rows + j
        x = apply_block(jax.tree.map(lambda a, j=j: a[j], layers), x, positions, c.layer_window(j), c,
                        overlap, mb.get("segment_ids"))
      _, step_stats = head_loss_sums(full, x, mb, c, overlap, z_loss)
      keep = (valid & (stage == p - 1)).astype(jnp.float32)
      stats = {k: stats[k] + keep * step_stats[k] for k in STAT_NAMES}
      sent = lax.ppermute(x, PP, [(i, (i + 1) % p) for i in range(p)])
      return (sent, stats), None

    b, seq = split["inputs"].shape[1:]
    received = to_varying(jnp.zeros((b, seq // lax.axis_size(TP), c.hidden_dim), c.compute_dtype), (DP, PP, CP, TP))
    zero = to_varying(jnp.zeros((), jnp.float32), (DP, PP, CP))
    (_, stats), _ = lax.scan(tick, (received, {k: zero for k in STAT_NAMES}), jnp.arange(m + p - 1))
    return stats["nll_sum"] + z_loss * stats["z_sum"], stats

  # Gathered in fp32: the tick scan sums each layer's cotangents over the ticks, which a leaf
  # gathered in the compute dtype would sum in it (the executor sums per backward, in fp32).
  grads, stats = jax.grad(objective, has_aux=True)(stage_params(params, layouts, bucket_bytes=bucket_bytes))
  return sum_over_stages(zero.reduce_scatter_grads(grads, layouts, bucket_bytes), stats)
