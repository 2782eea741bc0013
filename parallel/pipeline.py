"""Pipeline parallelism inside the one shard_map step: a static schedule run tick by tick.

The layers are cut into p * v chunks of k layers; stage s holds chunks s, s+p, ... (local
chunk c is global chunk c*p + s). The embedding runs in the first chunk, the final norm,
head and loss in the last. In the state, the blocks' parameters are stacked: one leaf per
parameter with a leading axis of L rows split over pp, stage s holding rows s*v*k ..
(s+1)*v*k - 1 (`stacked_layer_order`). `to_model_params` gives back the model's pytree.

Per device the step is one lax.scan over the executor's ticks (schedule.paired_timeline):
each tick a forward slot, then a backward slot, each a lax.switch over
  idle | a chunk program's forward          idle | a chunk program's backward
chosen by the stage's row of static tables. A chunk program is (first?, last?, the windows
of its k layers): one compiled body per distinct program, so every window stays static.
Two separate ppermute rings over pp carry the tick's messages: the forward slot's
activation to stage s+1, issued before the backward slot and depending on the forward
alone, with nothing in the backward slot depending on it (MegaScale's decoupled
send/recv: the scheduler may run it during the backward), and the backward slot's input
cotangent to stage s-1. The rings run every tick (a collective cannot sit in a branch);
idle slots send zeros. The last chunk's forward slot idles: its backward recomputes the
loss and counts the statistics.

  backward = jax.vjp of the chunk program on its stashed input (the forward is recomputed:
             the stash holds one activation per microbatch-chunk in flight, not residuals).
  stash    = [slots + 1, b, s/tp, hidden]: a received activation waits in its slot from
             arrival to its backward; slots are assigned in Python, the extra one is a trash
             slot for ticks with nothing to keep. Same for received cotangents. Arrivals
             are written at the end of the tick, after all of its reads.
  grads    = each backward's gradients are reduce-scattered over dp right away (ZeRO-2) and
             added to this stage's shard at the chunk's rows; embedding / head gradients
             are summed over pp at the end (only their stages have any).

Lockstep SPMD compromises (WORKSPACE.md has the measured costs): the backward recomputes
the forward; every stage walks the same ticks; inside a branch, collective matmul runs as
chunked collectives instead of ppermute rings (a collective-permute spans every device of
the program, a branch only one stage's).
"""

from __future__ import annotations

import dataclasses

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from megajax.model import ModelConfig
from megajax.parallel import sharding
from megajax.parallel.mesh import DP, PP, TP, to_varying, varying_axes
from megajax.parallel.schedule import BACKWARD, FORWARD, Schedule, paired_timeline
from megajax.parallel.tensor_parallel import (Overlap, apply_block, head_loss_sums, positions_of,
                                              vocab_parallel_embed)
from megajax.step import split_microbatches

LAYERS = "layers"   # the stacked blocks' subtree in the pipeline layout
STAT_NAMES = ("nll_sum", "z_sum", "tokens")


# --- The stacked parameter layout.

def stacked_layer_order(num_layers: int, stages: int, virtual_stages: int) -> list[int]:
  """The model layer at each row of the stacked leaves: row s*v*k + c*k + j (stage s, local
  chunk c, layer j of the chunk) holds layer (c*p + s)*k + j."""
  p, v = stages, virtual_stages
  if num_layers % (p * v):
    raise ValueError(f"{num_layers} layers do not cut into pp * virtual_stages = {p * v} equal chunks "
                     "(model.num_layers must be a multiple of it)")
  k = num_layers // (p * v)
  return [(c * p + s) * k + j for s in range(p) for c in range(v) for j in range(k)]


def to_pipeline_params(params: dict, stages: int, virtual_stages: int) -> dict:
  """The model's pytree (layer_0, layer_1, ...) -> the pipeline layout (one stacked `layers`)."""
  names = [name for name in params if name.startswith("layer_")]
  order = stacked_layer_order(len(names), stages, virtual_stages)
  layers = jax.tree.map(lambda *rows: jnp.stack(rows), *[params[f"layer_{i}"] for i in order])
  return {**{k: v for k, v in params.items() if k not in names}, LAYERS: layers}


def to_model_params(params: dict, stages: int, virtual_stages: int) -> dict:
  """The pipeline layout -> the model's pytree (for export, checkpoints, comparisons)."""
  rows = jax.tree.leaves(params[LAYERS])[0].shape[0]
  model = {k: v for k, v in params.items() if k != LAYERS}
  for row, layer in enumerate(stacked_layer_order(rows, stages, virtual_stages)):
    model[f"layer_{layer}"] = jax.tree.map(lambda x, row=row: x[row], params[LAYERS])
  return model


def pipeline_layouts(layouts: dict) -> dict:
  """The model's per-parameter layouts -> the pipeline layout's (stacked blocks split over pp)."""
  rest = {k: v for k, v in layouts.items() if not k.startswith("layer_")}
  return {**rest, LAYERS: sharding.stacked_layouts(layouts["layer_0"])}


# --- The static tables a device reads each tick.

@dataclasses.dataclass(frozen=True)
class Program:
  """What one chunk computes; chunks with equal programs share one compiled body."""
  first: bool                      # embeds the tokens
  last: bool                       # ends in the head and the loss
  windows: tuple                   # each layer's attention window (None: global)


@dataclasses.dataclass(frozen=True)
class Tables:
  """A schedule compiled for the executor: its paired ticks (one forward slot, then one
  backward slot per stage) as int32 tables [ticks, stages], and the buffer sizes."""
  schedule: Schedule
  layers_per_chunk: int
  programs: tuple                  # branch i + 1 of either slot runs program i
  stash_slots: int                 # activation slots (plus one trash slot)
  cotangent_slots: int             # cotangent slots (plus one trash slot)
  per_stage: dict                  # f_/b_ branch, microbatch, chunk, in_slot; b_ct_slot; recv_fwd, recv_bwd

  @property
  def ticks(self) -> int:
    return self.per_stage["f_branch"].shape[0]

  @classmethod
  def build(cls, schedule: Schedule, c: ModelConfig) -> "Tables":
    p, v = schedule.stages, schedule.virtual_stages
    chunks = p * v
    k = len(stacked_layer_order(c.num_layers, p, v)) // chunks   # (checks the cut)
    program_of = {g: Program(g == 0, g == chunks - 1, tuple(c.layer_window(g * k + j) for j in range(k)))
                  for g in range(chunks)}
    programs = tuple(sorted(set(program_of.values()), key=lambda pr: (not pr.first, pr.last, str(pr.windows))))
    pairs = paired_timeline(schedule)                          # [p, ticks, 2]
    ticks = pairs.shape[1]
    when = {(s, op): t for s in range(p) for t in range(ticks) for op in pairs[s, t] if op is not None}

    names = ("f_branch", "f_microbatch", "f_chunk", "f_in_slot", "b_branch", "b_microbatch", "b_chunk",
             "b_in_slot", "b_ct_slot", "recv_fwd", "recv_bwd")
    tables = {name: np.zeros((ticks, p), np.int32) for name in names}
    stash_slots = cotangent_slots = 1
    for s in range(p):
      # Per tick: the slots its ops read, the slots freed after them, the arrival at its end.
      stash, cotangents = _SlotEvents(ticks), _SlotEvents(ticks)
      for t in range(ticks):
        forward, backward = pairs[s, t]
        for prefix, op in (("f_", forward), ("b_", backward)):
          if op is None:
            continue
          g = op.chunk * p + s
          key = (op.microbatch, op.chunk)
          # The last chunk's forward slot idles: its backward recomputes the loss anyway and
          # counts the statistics there.
          if not (op.kind == FORWARD and g == chunks - 1):
            tables[prefix + "branch"][t, s] = 1 + programs.index(program_of[g])
          tables[prefix + "microbatch"][t, s], tables[prefix + "chunk"][t, s] = key
          if g > 0:                                          # reads its stashed input
            stash.reads[t].append((prefix + "in_slot", key))
          if op.kind == FORWARD and g > 0:                   # the input arrives from stage s-1
            stash.arrivals[when[(s - 1) % p, dataclasses.replace(op, chunk=(g - 1) // p)]] = key
          if op.kind == BACKWARD and g > 0:
            stash.frees[t].append(key)
          if op.kind == BACKWARD and g < chunks - 1:         # its cotangent arrives from stage s+1
            cotangents.reads[t].append(("b_ct_slot", key))
            cotangents.frees[t].append(key)
            cotangents.arrivals[when[(s + 1) % p, dataclasses.replace(op, chunk=(g + 1) // p)]] = key
      stash_slots = max(stash_slots, stash.assign(s, tables, "recv_fwd"))
      cotangent_slots = max(cotangent_slots, cotangents.assign(s, tables, "recv_bwd"))
    # Ticks with no arrival write to the trash slot, one past the last real one.
    for name, trash in (("recv_fwd", stash_slots), ("recv_bwd", cotangent_slots)):
      tables[name][tables[name] < 0] = trash
    return cls(schedule, k, programs, stash_slots, cotangent_slots, tables)


class _SlotEvents:
  """One stage's use of a buffer, tick by tick; `assign` gives every held message a slot."""

  def __init__(self, ticks: int):
    self.ticks = ticks
    self.reads = [[] for _ in range(ticks)]      # (table, key) read during the tick
    self.frees = [[] for _ in range(ticks)]      # keys no longer needed after the tick's reads
    self.arrivals = {}                           # tick -> key written at the tick's end

  def assign(self, s: int, tables: dict, recv_table: str) -> int:
    """Greedy assignment; a slot freed at tick t takes the arrival at t's end. Returns the slots used."""
    free, slot_of, used = [], {}, 0
    tables[recv_table][:, s] = -1
    for t in range(self.ticks):
      for table, key in self.reads[t]:
        tables[table][t, s] = slot_of[key]
      for key in self.frees[t]:
        free.append(slot_of.pop(key))
      if t in self.arrivals:
        if not free:
          free.append(used)
          used += 1
        slot_of[self.arrivals[t]] = tables[recv_table][t, s] = free.pop()
    return used


# --- The executor, per device inside the shard_map.

def _matching(tree, like):
  """`tree` cast to the per-device (varying) axes of `like`, leaf by leaf: switch branches
  must return identically typed values."""
  return jax.tree.map(lambda x, y: to_varying(x, tuple(varying_axes(y))), tree, like)


def _shared_names(program: Program, c: ModelConfig) -> tuple:
  """The non-block parameters a chunk program uses."""
  names = ("embedding",) if program.first else ()
  if program.last:
    names += ("final_norm", "embedding" if c.tie_embeddings else "head")
  return tuple(dict.fromkeys(names))


def stage_params(params, layouts):
  """ZeRO gather -> this stage's rows and this tp rank's shards, marked per device on pp like
  everything a stage computes: a pp-invariant input's gradient would otherwise be summed
  over pp inside the backward, a collective only its stage runs."""
  return jax.tree.map(lambda x: to_varying(x, (PP,)), sharding.gather_params(params, layouts))


def sum_over_stages(grads: dict, stats: dict):
  """Gradient shards of the non-block leaves (used by the first / last stage only) and the
  loss statistics, summed over pp (and the statistics over dp)."""
  grads = {name: g if name == LAYERS else jax.tree.map(lambda x: lax.psum(x, PP), g) for name, g in grads.items()}
  return grads, {name: lax.psum(value, (DP, PP)) for name, value in stats.items()}


def pipeline_gradients(params, batch, layouts, tables: Tables, c: ModelConfig, overlap: Overlap,
                       z_loss: float, probes=None):
  """This device's summed gradient shards (ZeRO-2, pipeline layout) and loss stats over the
  whole batch (summed over dp and pp). `probes` (megajax.probes, bound to the step; the
  batch then has "rows"): perturb_at="stage:<s>" perturbs what stage s sends on."""
  p, k = tables.schedule.stages, tables.layers_per_chunk
  overlap = dataclasses.replace(overlap, ring=False)   # no ppermute inside a stage's branch
  full = stage_params(params, layouts)
  stage = lax.axis_index(PP)
  microbatches = split_microbatches(batch, tables.schedule.microbatches)   # [m, b, S]
  b, seq = microbatches["inputs"].shape[1:]

  def activation_buffer(slots):
    shape = (slots, b, seq // lax.axis_size(TP), c.hidden_dim)
    return to_varying(jnp.zeros(shape, c.compute_dtype), (DP, PP, TP))

  zero_stat = to_varying(jnp.zeros((), jnp.float32), (DP, PP))
  carry = dict(
      stash=activation_buffer(tables.stash_slots + 1),
      cotangents=activation_buffer(tables.cotangent_slots + 1),
      grads=jax.tree.map(lambda x: to_varying(jnp.zeros_like(x), (PP,)), params),
      stats={name: zero_stat for name in STAT_NAMES})
  empty_message = activation_buffer(1)[0]

  def chunk_params(chunk):
    return jax.tree.map(lambda x: lax.dynamic_slice_in_dim(x, chunk * k, k), full[LAYERS])

  def chunk_function(program: Program):
    """(chunk params [k, ...], shared params, input activation, microbatch) -> (output, stats)."""
    @jax.named_scope("forward")    # its vjp's ops: transpose(jvp(forward)), the backward
    def run(layers, shared, x, mb):
      positions = positions_of(mb["inputs"])
      if program.first:
        x = vocab_parallel_embed(shared["embedding"], mb["inputs"], c)
      for j, window in enumerate(program.windows):
        x = apply_block(jax.tree.map(lambda a, j=j: a[j], layers), x, positions, window, c, overlap)
      if program.last:
        return head_loss_sums(shared, x, mb, c, overlap, z_loss)
      return x, None
    return run

  def add_chunk_grads(grads, chunk_grads, shared_grads, chunk):
    """ZeRO-2: reduce-scatter over dp now (one call: the chunk's and the shared leaves' in one
    set, which CPU jobs across processes pack and order), add into the shard at the chunk's rows."""
    names = [LAYERS, *shared_grads]
    reduced = sharding.reduce_scatter_grads({LAYERS: chunk_grads, **shared_grads}, {n: layouts[n] for n in names})
    def add_rows(buffer, g):
      rows = lax.dynamic_slice_in_dim(buffer, chunk * k, k) + g
      return lax.dynamic_update_slice_in_dim(buffer, rows, chunk * k, axis=0)
    grads = dict(grads)
    grads[LAYERS] = jax.tree.map(add_rows, grads[LAYERS], reduced[LAYERS])
    for name in shared_grads:
      grads[name] = jax.tree.map(jnp.add, grads[name], reduced[name])
    return grads

  def forward(program: Program):
    run = chunk_function(program)
    def branch(stash, op, mb):
      shared = {name: full[name] for name in _shared_names(program, c)}
      out, _ = run(chunk_params(op["f_chunk"]), shared, stash[op["f_in_slot"]], mb)
      return _matching(out, empty_message)
    return branch

  def backward(program: Program):
    run = chunk_function(program)
    def branch(stash, cotangents, grads, stats, op, mb):
      shared = {name: full[name] for name in _shared_names(program, c)}
      loss_fn = lambda layers, shared, x: run(layers, shared, x, mb)
      # Recompute the chunk's forward from its stashed input, then its backward.
      out, vjp_fn, new_stats = jax.vjp(loss_fn, chunk_params(op["b_chunk"]), shared, stash[op["b_in_slot"]],
                                       has_aux=True)
      if program.last:     # the loss: seed its backward with 1, count its statistics
        cotangent = to_varying(jnp.ones((), out.dtype), tuple(varying_axes(out)))
        stats = _matching(jax.tree.map(jnp.add, stats, new_stats), stats)
      else:
        cotangent = cotangents[op["b_ct_slot"]]
      layer_grads, shared_grads, x_grad = vjp_fn(cotangent)
      grads = _matching(add_chunk_grads(grads, layer_grads, shared_grads, op["b_chunk"]), grads)
      return grads, stats, empty_message if program.first else _matching(x_grad, empty_message)
    return branch

  # Branch 0 idles; a last program's forward branch is never selected (see Tables.build).
  forwards = [lambda stash, op, mb: empty_message]
  backwards = [lambda stash, cotangents, grads, stats, op, mb: (grads, stats, empty_message)]
  for program in tables.programs:
    forwards.append(forward(program) if not program.last else forwards[0])
    backwards.append(backward(program))

  def microbatch(index):
    return jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, index, keepdims=False), microbatches)

  def tick(carry, rows):
    op = {name: table[stage] for name, table in rows.items()}
    stash, cotangents = carry["stash"], carry["cotangents"]
    # Forward slot, then its send. Nothing the backward slot reads depends on the send (the
    # arrival is written at the tick's end), so the collective can run during the backward:
    # decoupled send/recv. Unconditional, so it stays outside any branch (idle ticks send zeros).
    activation = lax.switch(op["f_branch"], forwards, stash, op, microbatch(op["f_microbatch"]))
    if probes is not None and probes.perturb_site == "stage":
      activation = probes.perturb_sent(activation, stage, op["f_chunk"], microbatch(op["f_microbatch"])["rows"], p, k)
    with jax.named_scope("pp send-recv"):
      activation = lax.ppermute(activation, PP, [(i, (i + 1) % p) for i in range(p)])
    grads, stats, cotangent = lax.switch(op["b_branch"], backwards, stash, cotangents, carry["grads"],
                                         carry["stats"], op, microbatch(op["b_microbatch"]))
    with jax.named_scope("pp send-recv"):
      cotangent = lax.ppermute(cotangent, PP, [(i, (i - 1) % p) for i in range(p)])
    # Arrivals are written at the tick's end, after every read of the tick.
    return dict(stash=lax.dynamic_update_index_in_dim(stash, activation, op["recv_fwd"], 0),
                cotangents=lax.dynamic_update_index_in_dim(cotangents, cotangent, op["recv_bwd"], 0),
                grads=grads, stats=stats), None

  carry, _ = lax.scan(tick, carry, {name: jnp.asarray(table) for name, table in tables.per_stage.items()})

  return sum_over_stages(carry["grads"], carry["stats"])
