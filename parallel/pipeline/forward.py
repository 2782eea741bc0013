"""The pipeline's forward pass alone: the loss sums of a batch on the pp mesh (held-out
evaluation), no backward, no gradients, no stash.

The same chunk programs as the executor (tables.Program: embeds?, ends in the loss?, the
windows of its k layers, one compiled body each), run in v rounds of a GPipe sweep, one
lax.scan of v * (m + p - 1) ticks:

  round r, tick t: stage s runs its local chunk r (global chunk r*p + s) on microbatch t - s
                   (idle outside [0, m)), then sends the output to stage s+1 on a ppermute ring.

Stage p-1's output in round r is the input of global chunk (r+1)*p, stage 0's next round:
stage 0 keeps those arrivals, one slot per microbatch, until that round reads them (with
v = 1 they are never read). The last chunk ends in the head and the loss sums, which are
what the sweep returns. Every tick's switch picks idle | a chunk program, so the bubbles
compute nothing; the ring runs every tick, outside the branches (a collective cannot sit in
one), and idle ticks send zeros.
"""

from __future__ import annotations

import dataclasses

import jax
from jax import lax
import jax.numpy as jnp

from megajax.model import ModelConfig
from megajax.parallel import collectives
from megajax.parallel.mesh import CP, DP, PP, TP, to_varying
from megajax.parallel.pipeline.executor import STAT_NAMES, stage_params
from megajax.parallel.pipeline.slots import chunk_forward, matching, row_at, rows_at, with_row_at
from megajax.parallel.pipeline.stacking import LAYERS, compute_rows, stacked_layer_order
from megajax.parallel.pipeline.tables import Program
from megajax.parallel.tensor_parallel import Overlap
from megajax.reference_step import split_microbatches


def chunk_programs(c: ModelConfig, stages: int, virtual_stages: int) -> list[Program]:
  """Each global chunk's program, in chunk order (the executor's, tables.Tables.build)."""
  chunks = stages * virtual_stages
  k = len(stacked_layer_order(c.num_layers, stages, virtual_stages)) // chunks   # (checks the cut)
  return [Program(g == 0, g == chunks - 1, tuple(c.layer_window(g * k + j) for j in range(k)))
          for g in range(chunks)]


def pipeline_loss_sums(params, batch, layouts, stages: int, virtual_stages: int, microbatches: int,
                       c: ModelConfig, overlap: Overlap, z_loss: float = 0.0, bucket_bytes: int = 0) -> dict:
  """This device's loss statistics {"nll_sum", "z_sum", "tokens"} over its dp shard of the
  batch, summed over dp and pp: the forward of megajax.parallel.pipeline.pipeline_gradients
  (`bucket_bytes`: its dp all-gathers', parallel.dp_bucket_mb)."""
  p, v, m = stages, virtual_stages, microbatches
  programs = chunk_programs(c, p, v)
  k = c.num_layers // (p * v)
  distinct = list(dict.fromkeys(programs))
  # (round, stage) -> 1 + its chunk's program among the distinct ones (branch 0 idles).
  branch_of = jnp.asarray([[1 + distinct.index(programs[r * p + s]) for s in range(p)] for r in range(v)],
                          jnp.int32)
  overlap = dataclasses.replace(overlap, ring=False)   # no ppermute inside a stage's branch
  full = stage_params(params, layouts, c.compute_dtype, bucket_bytes=bucket_bytes)
  full = {**full, LAYERS: compute_rows(full[LAYERS], c)}       # what the chunks read, once a step
  stage = lax.axis_index(PP)
  split = split_microbatches(batch, m)                  # [m, b, S]
  b, seq = split["inputs"].shape[1:]
  message = to_varying(jnp.zeros((b, seq // lax.axis_size(TP), c.hidden_dim), c.compute_dtype), (DP, PP, CP, TP))
  zero_stats = {name: to_varying(jnp.zeros((), jnp.float32), (DP, PP, CP)) for name in STAT_NAMES}

  def branch(program: Program):
    shared_names = (("embedding",) if program.first else ()) + (
        ("final_norm", "embedding" if c.tie_embeddings else "head") if program.last else ())
    forward = chunk_forward(program, c, overlap, z_loss)

    def run(layers, x, mb):
      out, stats = forward(layers, {name: full[name] for name in shared_names}, x, mb)
      if program.last:
        return message, matching({name: stats[name] for name in STAT_NAMES}, zero_stats)
      return matching(out, message), zero_stats
    return run

  branches = [lambda layers, x, mb: (message, zero_stats)] + [branch(program) for program in distinct]
  ring = [(i, (i + 1) % p) for i in range(p)]
  span = m + p - 1                                      # ticks per round

  def tick(carry, t):
    received, arrivals, stats = carry
    round_, local = t // span, t % span
    index = local - stage                               # the microbatch this stage runs now
    held = jnp.clip(index, 0, m - 1)
    mb = jax.tree.map(lambda x: row_at(x, held), split)
    first_row = round_ * k
    layers = jax.tree.map(lambda x: rows_at(x, first_row, k), full[LAYERS])
    x = jnp.where(stage == 0, row_at(arrivals, held), received)
    which = jnp.where((index >= 0) & (index < m), branch_of[round_, stage], 0)
    out, new_stats = lax.switch(which, branches, layers, x, mb)
    stats = matching(jax.tree.map(jnp.add, stats, new_stats), zero_stats)
    with jax.named_scope("pp send-recv"):
      received = lax.ppermute(out, PP, ring)
    # Stage 0 keeps what stage p-1 sent (its microbatch local - (p-1)) for the next round.
    arrived = local - (p - 1)
    slot = jnp.clip(arrived, 0, m - 1)
    keep = (stage == 0) & (arrived >= 0) & (arrived < m)
    arrivals = with_row_at(arrivals, jnp.where(keep, received, row_at(arrivals, slot)), slot)
    return (received, arrivals, stats), None

  arrivals = jnp.broadcast_to(message, (m, *message.shape))
  (_, _, stats), _ = lax.scan(tick, (message, arrivals, zero_stats), jnp.arange(v * span))
  return {name: collectives.psum(value, (DP, PP, CP)) for name, value in stats.items()}
