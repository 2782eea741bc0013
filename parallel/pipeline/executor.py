"""The pipeline executor inside the one shard_map step: a static schedule run tick by tick.

The layers are cut into p * v chunks of k layers (stacking.py: the stacked parameter
layout); stage s holds chunks s, s+p, ... The embedding runs in the first chunk, the final
norm, head and loss in the last.

Per device the step is one lax.scan over the executor's ticks (schedule.paired_timeline):
each tick a forward slot, then a backward slot, each a lax.switch over
  idle | a chunk program's forward          idle | a chunk program's backward
chosen by the stage's row of static tables (tables.py). A chunk program is (first?, last?,
the windows of its k layers): one compiled body per distinct program, so every window stays
static.
Two separate ppermute rings over pp carry the tick's messages: the forward slot's
activation to stage s+1, issued before the backward slot and depending on the forward
alone, with nothing in the backward slot depending on it (MegaScale's decoupled
send/recv: the scheduler may run it during the backward), and the backward slot's input
cotangent to stage s-1. The rings run every tick (a collective cannot sit in a branch);
idle slots send zeros. The last chunk's forward slot idles: its backward slot runs the loss's
forward and backward together and counts the statistics.

  backward = parallel.pipeline_recompute=False (the GPU default): the pullback of the chunk's
             forward rebuilt from the residuals its forward slot kept (residuals.py: what
             model.remat saves, as without a pipeline; weight casts and position tables are
             rebuilt, not kept per microbatch). No forward runs twice.
             parallel.pipeline_recompute=True (the CPU default): jax.vjp of the chunk program on
             its stashed input, the forward rerun (the low-memory option: one input kept per
             microbatch-chunk; on CPU also the faster one, config.pipeline_recompute).
  stash    = [slots + 1, b, s/tp, hidden]: a received activation waits in its slot from
             arrival to its forward (to its backward when rerun, and for the last chunk);
             slots are assigned in Python, the extra one is a trash slot for ticks with
             nothing to keep. Same for received cotangents. Arrivals are written at the end
             of the tick, after all of its reads.
  residuals = per group of mesh axes the values vary over, [slots + 1, words] uint16: a
             forward's residuals, packed, from its tick's end to its backward (the schedule's
             in-flight microbatch-chunks: Tables.residual_slots).
  grads    = w.r.t. the gathered leaves, some in the compute dtype (zero.gathers_in_compute_dtype),
             always summed in fp32:
             grad_sync="step" (the default): each backward's gradients are added in fp32 to
             this stage's full local gradients (shaped like the gathered stage parameters)
             at the chunk's rows, and reduce-scattered over dp once (below).
             grad_sync="microbatch": reduce-scattered over dp right away (ZeRO-2) and added
             to this stage's shard. Either way embedding / head gradients are summed over pp
             at the end (only their stages have any). The backward switch returns only its
             slot's gradients (the chunk's k rows, the shared leaves; zeros when idle) and the
             tick adds them to the carry outside it: accumulators handed through the switch
             were copied whole in every branch on XLA:GPU (docs/deviceless.md).

ZeRO per model chunk (MegaScale's dp overlap; dp_edge_pieces): before the scan only the
first local chunk's rows and the shared leaves are gathered. The scan runs in three parts:
its head, the leading ticks in which every stage runs only its first chunk (the warm-up's
start and its bubble), gathers the other chunks' rows in pieces, one per tick; its tail, the
trailing ticks where again only first chunks run, reduce-scatters their summed gradients
("step"), final by then; the steady ticks between carry no dp collective. A piece's
collective sits outside the tick's switches, so XLA:GPU may run it under them. The first
chunk's rows and the shared leaves are reduce-scattered after the scan. Each part's switches
compile only the programs its tables select.

On XLA:CPU (`ordered_collectives`, ParallelStep sets it from the mesh's platform) the tick runs
(the head's gather or the tail's reduce-scatter, each leaf's after another's,) forward slot,
backward slot, forward send, backward send, in that order: its executor may start
independent collectives (a send, a branch's tp all-gather) in different orders on
different devices, and the rendezvous then waits until it aborts (seen under load: 2 of 3
loaded runs of a dp2-pp2-tp2 case before, 0 of 6 after). Optimization barriers do not survive
XLA:CPU's passes, so the order is a data dependency (`mesh.after`). XLA:GPU runs one schedule on
every device, so there the sends stay decoupled.

Lockstep SPMD compromises (docs/parallelism.md has the measured costs): every stage walks the
same ticks; inside a branch, collective matmul runs as chunked collectives instead of ppermute
rings (a collective-permute spans every device of the program, a branch only one stage's);
a forward slot's residuals are copied into their slot (the switch returns them).
"""

from __future__ import annotations

import dataclasses

import jax
from jax import lax
import jax.numpy as jnp

from megajax.model import ModelConfig
from megajax.parallel import collectives, zero
from megajax.parallel.mesh import CP, DP, PP, TP, after, after_by_one_element, to_varying, varying_axes
from megajax.parallel.pipeline.slots import Slots, row_at, rows_at, with_row_at, with_rows_at
from megajax.parallel.pipeline.stacking import LAYERS, compute_rows
from megajax.parallel.pipeline.tables import Tables, dp_pieces
from megajax.parallel.tensor_parallel import Overlap
from megajax.reference_step import split_microbatches

STAT_NAMES = ("nll_sum", "z_sum", "tokens")
# The tick's two switches, by name in the compiled program's metadata (op_name): what reads
# the HLO (megajax.observe.hlo) weighs each branch by how often the tables select it.
FORWARD_SLOT, BACKWARD_SLOT = "pp forward slot", "pp backward slot"


def _written_after(residuals: dict, backward_out, never) -> dict:
  """The forward slot's residual vectors, each made to wait for the backward slot's output
  (XLA:CPU). The tick reads the backward's slot of a residual buffer and writes the forward's
  slot of the same buffer; unordered, XLA:CPU's copy insertion (which, unlike XLA:GPU's, runs
  no LoopScheduleLinearizer) copies the whole buffer twice per tick to keep the read safe.
  Once the write depends on what consumed the read, the buffer is updated in place (the
  default 2x2x2 job: 0.25 -> 0.18 s a step, 29.9 -> 23.0 MiB of temporaries). Each waits on
  an output that varies over no more mesh axes than it does (an order must not widen a value's
  type); a group no output fits is left unordered."""
  outputs = jax.tree.leaves(backward_out)

  def wait(value):
    fits = [out for out in outputs if varying_axes(out) | varying_axes(never) <= varying_axes(value)]
    return after(value, fits[0], never) if fits else value
  return {key: wait(value) for key, value in residuals.items()}


def _with_rows(first, rows: int):
  """[rows, ...] typed like `first` (dtype, the mesh axes it varies over), `first`'s rows on top."""
  out = to_varying(jnp.zeros((rows, *first.shape[1:]), first.dtype), tuple(varying_axes(first)))
  return out.at[:first.shape[0]].set(first)


def _assemble_rows(first, rows: int, pieces, starts: tuple):
  """_with_rows, then piece i of `pieces` [n, size, ...] from row len(first) + starts[i] (in
  order; where pieces overlap they hold the same values)."""
  out, k, size = _with_rows(first, rows), first.shape[0], pieces.shape[1]
  for i, start in enumerate(starts):
    out = out.at[k + start:k + start + size].set(pieces[i])
  return out


def stage_params(params, layouts, compute_dtype=None, in_turn=None, bucket_bytes: int = 0):
  """ZeRO gather -> this stage's rows and this tp rank's shards, marked per device on pp like
  everything a stage computes: a pp-invariant input's gradient would otherwise be summed
  over pp inside the backward, a collective only its stage runs. `compute_dtype`, `in_turn`,
  `bucket_bytes`: megajax.parallel.zero.gather_params'."""
  return jax.tree.map(lambda x: to_varying(x, (PP,)),
                      zero.gather_params(params, layouts, compute_dtype, in_turn, bucket_bytes))


def sum_over_stages(grads: dict, stats: dict):
  """Gradient shards of the non-block leaves (used by the first / last stage only) and the
  loss statistics, summed over pp (and the statistics over dp)."""
  grads = {name: g if name == LAYERS else jax.tree.map(lambda x: lax.psum(x, PP), g) for name, g in grads.items()}
  return grads, {name: collectives.psum(value, (DP, PP, CP)) for name, value in stats.items()}


def dp_edge_pieces(tables: Tables, dp: int, grad_sync: str) -> tuple:
  """The other chunks' rows (all but the first local chunk's) as the tick scan moves them
  over dp: ((rows per gather piece, their first rows), (the same for the reduce-scatters)),
  one piece per tick of the scan's head and tail (tables.dp_pieces); none with dp = 1, one
  chunk, or (reduce-scatters) grad_sync="microbatch"."""
  rest = (tables.schedule.virtual_stages - 1) * tables.layers_per_chunk if dp > 1 else 0
  lead, trail = tables.first_chunk_only_ticks()
  return dp_pieces(rest, lead), dp_pieces(rest, trail if grad_sync == "step" else 0)


def pipeline_gradients(params, batch, layouts, tables: Tables, c: ModelConfig, overlap: Overlap,
                       z_loss: float, probes=None, grad_sync: str = "step", ordered_collectives: bool = False,
                       bucket_bytes: int = 0):
  """This device's summed gradient shards (ZeRO-2, pipeline layout) and loss stats over the
  whole batch (summed over dp and pp). `grad_sync` (megajax.config.GRAD_SYNC_CHOICES): the dp
  reduce-scatter once per step, or after each backward. `probes`
  (megajax.observe.probes, bound to the step; the batch then has "rows"): perturb_at="stage:<s>"
  perturbs what stage s sends on. `ordered_collectives` (XLA:CPU): the tick's collectives in
  one order on every device: the head's or tail's dp collective, forward slot, backward
  slot, then the two sends (see the module docstring). `bucket_bytes` (parallel.dp_bucket_mb):
  the most one dp all-gather or reduce-scatter carries (0: one per leaf).

  ZeRO over dp per chunk (MegaScale's dp overlap): the first local chunk's rows and the shared
  leaves are gathered before the tick scan; the other chunks' rows in pieces, one per tick of
  the scan's head (the ticks in which every stage runs only its first chunk: the warm-up's
  start, its bubble included); with grad_sync="step" their gradients are reduce-scattered in
  pieces over the tail (the cool-down's end, where only first chunks run), the first chunk's
  and the shared leaves' after the scan. A piece's collective sits outside the tick's
  switches, so it may run under them."""
  overlap = dataclasses.replace(overlap, ring=False)   # no ppermute inside a stage's branch
  stage = lax.axis_index(PP)
  microbatches = split_microbatches(batch, tables.schedule.microbatches)   # [m, b, S]
  gather, scatter = dp_edge_pieces(tables, lax.axis_size(DP), grad_sync)
  full = _first_chunk_gathered(params, layouts, tables, c, bool(gather[1]), bucket_bytes)
  never = microbatches["inputs"][0, 0, 0] < 0     # token ids are never negative: false at run time
  carry, slots = _start(params, full, microbatches, layouts, tables, c, overlap, z_loss, grad_sync, bucket_bytes,
                        stage)
  ticks = _TickScan(slots, stage, probes, ordered_collectives, never, gather, scatter)
  carry, full = ticks.head(carry, full, params)
  carry = ticks.steady(carry, full)
  carry, pieces = ticks.tail(carry, full)
  grads = carry["grads"]
  if grad_sync == "step":
    grads = _step_reduce_scatter(grads, params, slots, scatter[1], pieces)
  return sum_over_stages(grads, carry["stats"])


def _first_chunk_gathered(params, layouts, tables: Tables, c: ModelConfig, in_pieces: bool, bucket_bytes: int):
  """The stage's parameters gathered before the tick scan: the shared leaves, and the first
  local chunk's rows (every chunk's when the other chunks' are not gathered `in_pieces`),
  the layers in their compute form (what the chunks read, once a step)."""
  k = tables.layers_per_chunk
  first_rows = {**params, LAYERS: jax.tree.map(lambda x: x[:k] if in_pieces else x, params[LAYERS])}
  full = stage_params(first_rows, layouts, c.compute_dtype, bucket_bytes=bucket_bytes)
  return {**full, LAYERS: compute_rows(full[LAYERS], c)}


def _start(params, full, microbatches, layouts, tables: Tables, c: ModelConfig, overlap: Overlap, z_loss: float,
           grad_sync: str, bucket_bytes: int, stage):
  """The tick scan's first carry (stash, cotangents, gradient accumulators, stats, residual
  buffers) and the step's Slots."""
  b, seq = microbatches["inputs"].shape[1:]

  def activation_buffer(slots):
    shape = (slots, b, seq // lax.axis_size(TP), c.hidden_dim)
    return to_varying(jnp.zeros(shape, c.compute_dtype), (DP, PP, CP, TP))

  zero_stat = to_varying(jnp.zeros((), jnp.float32), (DP, PP, CP))
  # "step": full local fp32 sums, typed like the gathered stage parameters; "microbatch": the
  # 1/dp shards, typed like the master shards (varying over pp as a stage computes).
  # The layers' gradients are taken w.r.t. their compute form and accumulated in it ("step"),
  # then cut into the parameters' (parameter_rows) for the reduce-scatter.
  gathered_like = jax.tree.map(lambda x: to_varying(x, (PP,)), zero.gathered_zeros(params, layouts, c.compute_dtype))
  layer_like = gathered_like[LAYERS]
  gathered_like = {**gathered_like, LAYERS: compute_rows(layer_like, c)}
  carry = dict(
      stash=activation_buffer(tables.stash_slots + 1),
      cotangents=activation_buffer(tables.cotangent_slots + 1),
      grads=(zero.gradient_accumulators(gathered_like) if grad_sync == "step"
             else jax.tree.map(lambda x: to_varying(jnp.zeros_like(x), (PP,)), params)),
      stats={name: zero_stat for name in STAT_NAMES})
  slots = Slots(params, full, microbatches, layouts, tables, c, overlap, z_loss, grad_sync, bucket_bytes,
                gathered_like, layer_like, activation_buffer(1)[0], stage)
  if not tables.recompute:
    carry["residuals"] = slots.residual_buffers()
  return carry, slots


def _step_reduce_scatter(grads, params, slots: Slots, scatter_starts: tuple, pieces):
  """grad_sync="step": one dp reduce-scatter per leaf and piece for the step (before the pp
  sum: on shards) of what the tail did not scatter, the tail's pieces put in their rows."""
  tail, k = bool(scatter_starts), slots.k
  first_chunk = {**grads, LAYERS: slots.parameter_grads(jax.tree.map(lambda x: x[:k] if tail else x, grads[LAYERS]))}
  grads = zero.reduce_scatter_grads(first_chunk, slots.layouts, slots.bucket_bytes)
  if tail:
    grads = {**grads, LAYERS: jax.tree.map(lambda first, shard, piece: _assemble_rows(first, shard.shape[0], piece,
                                                                                      scatter_starts),
                                           grads[LAYERS], params[LAYERS], pieces)}
  return grads


class _TickScan:
  """The tick scan in its three parts: head (gathering the other chunks' rows), steady, tail
  (reduce-scattering their gradients); each part's switches compile only the programs its
  tables select. `gather`, `scatter`: dp_edge_pieces' (rows a piece, their first rows)."""

  def __init__(self, slots: Slots, stage, probes, ordered_collectives: bool, never, gather: tuple, scatter: tuple):
    self.slots, self.tables, self.stage, self.probes = slots, slots.tables, stage, probes
    self.ordered_collectives, self.never = ordered_collectives, never
    self.gather, self.scatter = gather, scatter
    self.k = slots.k

  def tick(self, carry, rows, forwards, backwards, dp_collective=None):
    """One tick; `dp_collective` (the head's gather, the tail's reduce-scatter) runs first on
    CPU, the forward slot waiting for it (XLA:GPU may run it under both slots)."""
    slots, never, p = self.slots, self.never, self.tables.schedule.stages
    op = {name: row_at(table, self.stage) for name, table in rows.items()}
    stash, cotangents = carry["stash"], carry["cotangents"]
    if self.ordered_collectives and dp_collective is not None:
      stash = after(stash, dp_collective, never)
    # Forward slot, then its send. Nothing the backward slot reads depends on the send (the
    # arrival is written at the tick's end), so the collective can run during the backward:
    # decoupled send/recv. Unconditional, so it stays outside any branch (idle ticks send zeros).
    with jax.named_scope(FORWARD_SLOT):
      activation, residuals = lax.switch(op["f_branch"], forwards, stash, op, slots.microbatch(op["f_microbatch"]))
    if self.probes is not None and self.probes.perturb_site == "stage":
      activation = self.probes.perturb_sent(activation, self.stage, op["f_chunk"],
                                            slots.microbatch(op["f_microbatch"])["rows"], p, self.k)
    send_forward = lambda x: lax.ppermute(x, PP, [(i, (i + 1) % p) for i in range(p)])
    send_backward = lambda x: lax.ppermute(x, PP, [(i, (i - 1) % p) for i in range(p)])
    cotangents_in, backward_op = cotangents, op
    if self.ordered_collectives:   # the backward slot after the forward slot (its collectives too),
      # through the one received cotangent it reads: a select of that row, not of every slot's.
      # (On GPUs the branch reads its row itself: read out here, it is one more buffer.)
      received = after(row_at(cotangents, op["b_ct_slot"]), activation, never)
      cotangents_in, backward_op = received[None], dict(op, b_ct_slot=jnp.zeros_like(op["b_ct_slot"]))
    else:
      with jax.named_scope("pp send-recv"):
        activation = send_forward(activation)
    # The backward's residuals read before the switch: a branch given the whole buffer
    # makes XLA copy it.
    kept = {key: row_at(buffer, op["b_res_slot"]) for key, buffer in carry.get("residuals", {}).items()}
    with jax.named_scope(BACKWARD_SLOT):
      chunk_grads, stats, cotangent = lax.switch(op["b_branch"], backwards, stash, cotangents_in, kept,
                                                 carry["stats"], backward_op, slots.microbatch(op["b_microbatch"]))
      grads = slots.add_chunk_grads(carry["grads"], chunk_grads, op)
    backward_out = (cotangent, grads)
    with jax.named_scope("pp send-recv"):
      if self.ordered_collectives:  # both sends after the backward slot, the forward's first
        activation = send_forward(after_by_one_element(activation, backward_out, never))
        cotangent = after_by_one_element(cotangent, activation, never)
      cotangent = send_backward(cotangent)
    # Arrivals are written at the tick's end, after every read of the tick.
    new = dict(stash=with_row_at(stash, activation, op["recv_fwd"]),
               cotangents=with_row_at(cotangents, cotangent, op["recv_bwd"]),
               grads=grads, stats=stats)
    if "residuals" in carry:
      if self.ordered_collectives:
        residuals = _written_after(residuals, backward_out, never)
      new["residuals"] = {key: with_row_at(buffer, residuals[key], op["f_res_slot"])
                          for key, buffer in carry["residuals"].items()}
    return new

  def segment(self, first_tick, last_tick):
    """Ticks [first_tick, last_tick) of the stage tables: (as scanned arrays, as numpy)."""
    per_stage = self.tables.per_stage
    return ({name: jnp.asarray(table[first_tick:last_tick]) for name, table in per_stage.items()},
            {name: table[first_tick:last_tick] for name, table in per_stage.items()})

  def head(self, carry, full, params):
    """The scan's head: each tick also gathers a piece of the other chunks' rows (first, on CPU),
    which the scan stacks; only the first chunk's rows are read meanwhile. -> (carry, the
    stage's parameters with every chunk's rows)."""
    gather_rows, gather_starts = self.gather
    if not gather_starts:
      return carry, full
    k, slots = self.k, self.slots
    c = slots.c
    rest = (self.tables.schedule.virtual_stages - 1) * k                      # rows of the other chunks
    head_rows, head_table = self.segment(0, len(gather_starts))
    reads = ((head_table["f_branch"] == 0) | (head_table["f_chunk"] == 0),
             (head_table["b_branch"] == 0) | (head_table["b_chunk"] == 0))
    assert reads[0].all() and reads[1].all(), "the head's ticks read only first chunks (Tables.first_chunk_only_ticks)"
    forwards, backwards = slots.branches(full[LAYERS], head_table)

    def head_tick(carry_and_layers, xs):
      carry, layers = carry_and_layers
      rows, start = xs
      first_row = k + start
      shards = jax.tree.map(lambda x: rows_at(x, first_row, gather_rows), params[LAYERS])
      piece = stage_params({LAYERS: shards}, {LAYERS: slots.layouts[LAYERS]}, c.compute_dtype,
                           in_turn=self.never if self.ordered_collectives else None,
                           bucket_bytes=slots.bucket_bytes)[LAYERS]
      # Into the stage's rows at once (no branch reads them before the head ends).
      layers = jax.tree.map(lambda buffer, rows: with_rows_at(buffer, rows, first_row), layers,
                            compute_rows(piece, c))
      return (self.tick(carry, rows, forwards, backwards, piece), layers), None
    layers = jax.tree.map(lambda first: _with_rows(first, k + rest), full[LAYERS])
    (carry, layers), _ = lax.scan(head_tick, (carry, layers), (head_rows, jnp.asarray(gather_starts, jnp.int32)))
    return carry, {**full, LAYERS: layers}

  def steady(self, carry, full):
    """The ticks between head and tail: no dp collective."""
    head, tail = len(self.gather[1]), len(self.scatter[1])
    rows, table = self.segment(head, self.tables.ticks - tail)
    forwards, backwards = self.slots.branches(full[LAYERS], table)
    carry, _ = lax.scan(lambda carry, rows: (self.tick(carry, rows, forwards, backwards), None), carry, rows)
    return carry

  def tail(self, carry, full):
    """The scan's tail: each tick also reduce-scatters a piece of the other chunks' summed rows,
    final since the tail began (only first chunks run there). -> (carry, the pieces)."""
    scatter_rows, scatter_starts = self.scatter
    if not scatter_starts:
      return carry, None
    k, slots, ticks = self.k, self.slots, self.tables.ticks
    tail_rows, tail_table = self.segment(ticks - len(scatter_starts), ticks)
    forwards, backwards = slots.branches(full[LAYERS], tail_table)

    def tail_tick(carry, xs):
      rows, start = xs
      first_row = k + start
      sums = slots.parameter_grads(jax.tree.map(lambda x: rows_at(x, first_row, scatter_rows), carry["grads"][LAYERS]))
      piece = zero.reduce_scatter_grads({LAYERS: sums}, {LAYERS: slots.layouts[LAYERS]}, slots.bucket_bytes,
                                        ordered=True if self.ordered_collectives else None)[LAYERS]
      return self.tick(carry, rows, forwards, backwards, piece), piece
    return lax.scan(tail_tick, carry, (tail_rows, jnp.asarray(scatter_starts, jnp.int32)))
