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
from megajax.parallel.mesh import DP, PP, TP, after, after_by_one_element, to_varying, varying_axes
from megajax.parallel.pipeline.residuals import SplitChunk, group_dtype
from megajax.parallel.pipeline.stacking import LAYERS, compute_rows, parameter_rows
from megajax.parallel.pipeline.tables import Program, Tables, dp_pieces
from megajax.parallel.tensor_parallel import (Overlap, apply_block, head_loss_sums, positions_of,
                                              vocab_parallel_embed)
from megajax.reference_step import split_microbatches

STAT_NAMES = ("nll_sum", "z_sum", "tokens")
# The tick's two switches, by name in the compiled program's metadata (op_name): what reads
# the HLO (megajax.observe.hlo) weighs each branch by how often the tables select it.
FORWARD_SLOT, BACKWARD_SLOT = "pp forward slot", "pp backward slot"


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


def _group_key(group: tuple) -> str:
  """A residual buffer's name in the carry: the mesh axes its values vary over, their width."""
  axes, width = group
  return f"{','.join(axes) or 'invariant'}:{width * 8}bit"


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


# Every traced index below is a slot, chunk, row or microbatch read from the tables: never
# negative. Without allow_negative_indices=False, lax wraps each traced start around (a
# compare, an add and a select per index, in every branch of every tick): the tests' 2x2x2
# step lowered to 13,164 StableHLO ops with them, 10,832 without.
def rows_at(x, start, size: int):
  """x[start:start + size] (axis 0), `start` traced."""
  return lax.dynamic_slice_in_dim(x, start, size, allow_negative_indices=False)


def row_at(x, index):
  """x[index] (axis 0), `index` traced."""
  return lax.dynamic_index_in_dim(x, index, keepdims=False, allow_negative_indices=False)


def with_rows_at(x, rows, start):
  """x with x[start:start + len(rows)] = rows (axis 0), `start` traced."""
  return lax.dynamic_update_slice_in_dim(x, rows, start, 0, allow_negative_indices=False)


def with_row_at(x, row, index):
  """x with x[index] = row (axis 0), `index` traced."""
  return lax.dynamic_update_index_in_dim(x, row, index, 0, allow_negative_indices=False)


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
  return grads, {name: collectives.psum(value, (DP, PP)) for name, value in stats.items()}


def chunk_forward(program: Program, c: ModelConfig, overlap: Overlap, z_loss: float):
  """One chunk's forward: (chunk params [k, ...], shared params, input activation, microbatch)
  -> (output activation, None), or on the last chunk the head's (loss sum, stats). Shared by
  the executor (whose vjp of it is the backward) and the forward-only pipeline (forward.py)."""
  @jax.named_scope("forward")    # its vjp's ops: transpose(jvp(forward)), the backward
  def run(layers, shared, x, mb):
    positions = positions_of(mb)             # a microbatch carries the batch's keys, packed ones too
    if program.first:
      x = vocab_parallel_embed(shared["embedding"], mb["inputs"], c)
    for j, window in enumerate(program.windows):
      x = apply_block(jax.tree.map(lambda a, j=j: a[j], layers), x, positions, window, c, overlap,
                      mb.get("segment_ids"))
    if program.last:
      return head_loss_sums(shared, x, mb, c, overlap, z_loss)
    return x, None
  return run


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
  the most one dp all-gather or reduce-scatter carries (0: one per leaf)."""
  p, k = tables.schedule.stages, tables.layers_per_chunk
  overlap = dataclasses.replace(overlap, ring=False)   # no ppermute inside a stage's branch
  stage = lax.axis_index(PP)
  microbatches = split_microbatches(batch, tables.schedule.microbatches)   # [m, b, S]
  b, seq = microbatches["inputs"].shape[1:]

  # ZeRO over dp per chunk (MegaScale's dp overlap): the first local chunk's rows and the
  # shared leaves are gathered before the tick scan; the other chunks' rows in pieces, one per
  # tick of the scan's head (the ticks in which every stage runs only its first chunk: the
  # warm-up's start, its bubble included); with grad_sync="step" their gradients are
  # reduce-scattered in pieces over the tail (the cool-down's end, where only first chunks
  # run), the first chunk's and the shared leaves' after the scan. A piece's collective sits
  # outside the tick's switches, so it may run under them.
  (gather_rows, gather_starts), (scatter_rows, scatter_starts) = dp_edge_pieces(tables, lax.axis_size(DP), grad_sync)
  rest = (tables.schedule.virtual_stages - 1) * k                      # rows of the other chunks
  first_rows = {**params, LAYERS: jax.tree.map(lambda x: x[:k] if gather_starts else x, params[LAYERS])}
  full = stage_params(first_rows, layouts, c.compute_dtype, bucket_bytes=bucket_bytes)
  full = {**full, LAYERS: compute_rows(full[LAYERS], c)}       # what the chunks read, once a step
  never = microbatches["inputs"][0, 0, 0] < 0     # token ids are never negative: false at run time

  def activation_buffer(slots):
    shape = (slots, b, seq // lax.axis_size(TP), c.hidden_dim)
    return to_varying(jnp.zeros(shape, c.compute_dtype), (DP, PP, TP))

  zero_stat = to_varying(jnp.zeros((), jnp.float32), (DP, PP))
  # "step": full local fp32 sums, typed like the gathered stage parameters; "microbatch": the
  # 1/dp shards, typed like the master shards (varying over pp as a stage computes).
  # The layers' gradients are taken w.r.t. their compute form and accumulated in it ("step"),
  # then cut into the parameters' (parameter_rows) for the reduce-scatter.
  gathered_like = jax.tree.map(lambda x: to_varying(x, (PP,)), zero.gathered_zeros(params, layouts, c.compute_dtype))
  layer_like = gathered_like[LAYERS]
  gathered_like = {**gathered_like, LAYERS: compute_rows(layer_like, c)}
  parameter_grads = lambda rows: parameter_rows(rows, layer_like, c)
  carry = dict(
      stash=activation_buffer(tables.stash_slots + 1),
      cotangents=activation_buffer(tables.cotangent_slots + 1),
      grads=(zero.gradient_accumulators(gathered_like) if grad_sync == "step"
             else jax.tree.map(lambda x: to_varying(jnp.zeros_like(x), (PP,)), params)),
      stats={name: zero_stat for name in STAT_NAMES})
  empty_message = activation_buffer(1)[0]

  def microbatch(index):
    return jax.tree.map(lambda x: row_at(x, index), microbatches)

  def chunk_params(layers, chunk):
    start = chunk * k
    return jax.tree.map(lambda x: rows_at(x, start, k), layers)

  # A backward slot's gradients: the chunk's k rows and every shared leaf any program uses, in
  # the master dtype (as they come from the vjp, a leaf gathered in the compute dtype converted:
  # what its cast's transpose did before), typed like the gathered parameters. The switch
  # returns them and the tick adds them to the carry outside it: an accumulator handed through
  # a switch whose branches use different operands is copied whole by XLA in every branch
  # (the deviceless H100 compile of a 2x2x2 step: 2 x 8 MiB copies a backward slot).
  shared_names = tuple(dict.fromkeys(name for program in tables.programs for name in _shared_names(program, c)))
  grad_names = (LAYERS, *shared_names)
  masters = {name: params[name] for name in grad_names}
  masters[LAYERS] = jax.eval_shape(lambda layers: compute_rows(layers, c), params[LAYERS])    # their dtypes

  def zero_grads(names=grad_names):
    like = {name: gathered_like[name] for name in names}
    if LAYERS in like:
      like[LAYERS] = jax.tree.map(lambda x: jax.ShapeDtypeStruct((k, *x.shape[1:]), x.dtype), like[LAYERS])
    axes = {name: gathered_like[name] for name in names}
    return jax.tree.map(lambda x, master, typed: to_varying(jnp.zeros(x.shape, master.dtype), tuple(varying_axes(typed))),
                        like, {name: masters[name] for name in names}, axes)

  def chunk_grads_of(layer_grads, shared_grads):
    produced = zero.to_master_dtype({LAYERS: layer_grads, **shared_grads},
                                        {name: masters[name] for name in (LAYERS, *shared_grads)})
    missing = tuple(name for name in shared_names if name not in shared_grads)
    return _matching({**zero_grads(missing), **produced}, zero_grads())

  # Which backward branch produces which shared leaf (branch 0 idles): the tick adds a leaf's
  # gradient only when its branch made one.
  produces = {name: jnp.asarray([False] + [name in _shared_names(program, c) for program in tables.programs])
              for name in shared_names}

  def add_chunk_grads(grads, chunk_grads, op):
    """Add one backward slot's gradients. "step": as they are, every leaf every tick (an idle
    slot's are zeros; the dp reduce-scatter waits for the chunk's last backward): a lax.cond
    around the add would copy the whole buffer in its pass-through branch, as the switch did.
    "microbatch": reduce-scattered over dp first into the shard, under a cond that skips an
    idle slot's (and a shared leaf its program does not use): no collective of zeros."""
    branch = op["b_branch"]
    start = op["b_chunk"] * k

    def add(name, before):     # one leaf group: each cond hands only its own buffers through
      reduced = {name: chunk_grads[name]}
      if grad_sync == "microbatch":
        if name == LAYERS:
          reduced = {name: parameter_grads(reduced[name])}
        reduced = zero.reduce_scatter_grads(reduced, {name: layouts[name]}, bucket_bytes)
      if name == LAYERS:
        add_rows = lambda buffer, g: with_rows_at(buffer, rows_at(buffer, start, k) + g, start)
        return _matching(jax.tree.map(add_rows, before, reduced[LAYERS]), before)
      return _matching(jax.tree.map(jnp.add, before, reduced[name]), before)

    grads = dict(grads)
    for name in grad_names:
      if grad_sync == "step":
        grads[name] = add(name, grads[name])
      else:
        produced = branch > 0 if name == LAYERS else produces[name][branch]
        grads[name] = lax.cond(produced, lambda g, name=name: add(name, g), lambda g: g, grads[name])
    return grads

  # parallel.pipeline_recompute=False: each non-last program's forward traced once with its
  # residuals split out (residuals.py); one residual buffer per group of mesh axes, as wide
  # as the widest program's stash.
  splits, residual_words = {}, {}
  if not tables.recompute:
    # Example arguments typed as a tick's (indices read from the stage's table row vary over pp).
    index = jnp.asarray(tables.per_stage["f_chunk"])[0][stage]
    for program in tables.programs:
      if not program.last:
        shared = {name: full[name] for name in _shared_names(program, c)}
        splits[program] = SplitChunk.trace(chunk_forward(program, c, overlap, z_loss), chunk_params(full[LAYERS], index),
                                           shared, empty_message, microbatch(index))
        for group, words in splits[program].words.items():
          residual_words[group] = max(residual_words.get(group, 0), words)
    carry["residuals"] = {
        _group_key(group): to_varying(jnp.zeros((tables.residual_slots + 1, words), group_dtype(group)), group[0])
        for group, words in residual_words.items()}
  # What an idle slot returns is made inside its branch, not closed over: a switch returning a
  # buffer from outside copies it (an 8 MiB residual vector a tick in the H100 compile).
  def empty_residuals():
    return {_group_key(group): to_varying(jnp.zeros((words,), group_dtype(group)), group[0])
            for group, words in residual_words.items()}

  def no_message():
    return jnp.zeros_like(empty_message)

  def forward(program: Program, layers):
    run = chunk_forward(program, c, overlap, z_loss)
    def branch(stash, op, mb):
      shared = {name: full[name] for name in _shared_names(program, c)}
      args = (chunk_params(layers, op["f_chunk"]), shared, row_at(stash, op["f_in_slot"]), mb)
      if program in splits:    # the forward, keeping what its backward reads
        (out, _), packed = splits[program].forward(*args, words=residual_words)
        residuals = {_group_key(group): vector for group, vector in packed.items()}
      else:
        out, _ = run(*args)
        residuals = empty_residuals()
      return _matching(out, empty_message), _matching(residuals, empty_residuals())
    return branch

  def backward(program: Program, layers):
    run = chunk_forward(program, c, overlap, z_loss)
    def branch(stash, cotangents, residuals, stats, op, mb):
      chunk_layers = chunk_params(layers, op["b_chunk"])
      shared = {name: full[name] for name in _shared_names(program, c)}
      if program in splits:    # the pullback from the forward's residuals: no forward rerun
        stashed = {group: residuals[_group_key(group)] for group in residual_words}
        vjp_fn = splits[program].pullback_from(chunk_layers, shared, empty_message, mb, stashed)
      else:
        # The forward from the stashed input (rerun, or the last chunk's first run), then its backward.
        loss_fn = lambda chunk_layers, shared, x: run(chunk_layers, shared, x, mb)
        out, vjp_fn, new_stats = jax.vjp(loss_fn, chunk_layers, shared, row_at(stash, op["b_in_slot"]), has_aux=True)
      if program.last:     # the loss: seed its backward with 1, count its statistics
        cotangent = to_varying(jnp.ones((), out.dtype), tuple(varying_axes(out)))
        stats = _matching(jax.tree.map(jnp.add, stats, new_stats), stats)
      else:
        cotangent = row_at(cotangents, op["b_ct_slot"])
      layer_grads, shared_grads, x_grad = vjp_fn(cotangent)
      return (chunk_grads_of(layer_grads, shared_grads), stats,
              no_message() if program.first else _matching(x_grad, empty_message))
    return branch

  def branches(layers, segment):
    """Both slots' branch lists reading chunk rows from `layers`; branch 0 idles, and so does a
    program the segment's tables never select (and a last program's forward: Tables.build)."""
    forwards = [lambda stash, op, mb: (no_message(), empty_residuals())]
    backwards = [lambda stash, cotangents, residuals, stats, op, mb: (zero_grads(), stats, no_message())]
    for i, program in enumerate(tables.programs):
      used = lambda prefix: bool((segment[prefix + "branch"] == i + 1).any())
      forwards.append(forward(program, layers) if not program.last and used("f_") else forwards[0])
      backwards.append(backward(program, layers) if used("b_") else backwards[0])
    return forwards, backwards

  def tick(carry, rows, forwards, backwards, dp_collective=None):
    """One tick; `dp_collective` (the head's gather, the tail's reduce-scatter) runs first on
    CPU, the forward slot waiting for it (XLA:GPU may run it under both slots)."""
    op = {name: row_at(table, stage) for name, table in rows.items()}
    stash, cotangents = carry["stash"], carry["cotangents"]
    if ordered_collectives and dp_collective is not None:
      stash = after(stash, dp_collective, never)
    # Forward slot, then its send. Nothing the backward slot reads depends on the send (the
    # arrival is written at the tick's end), so the collective can run during the backward:
    # decoupled send/recv. Unconditional, so it stays outside any branch (idle ticks send zeros).
    with jax.named_scope(FORWARD_SLOT):
      activation, residuals = lax.switch(op["f_branch"], forwards, stash, op, microbatch(op["f_microbatch"]))
    if probes is not None and probes.perturb_site == "stage":
      activation = probes.perturb_sent(activation, stage, op["f_chunk"], microbatch(op["f_microbatch"])["rows"], p, k)
    send_forward = lambda x: lax.ppermute(x, PP, [(i, (i + 1) % p) for i in range(p)])
    send_backward = lambda x: lax.ppermute(x, PP, [(i, (i - 1) % p) for i in range(p)])
    cotangents_in, backward_op = cotangents, op
    if ordered_collectives:   # the backward slot after the forward slot (its collectives too),
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
                                                 carry["stats"], backward_op, microbatch(op["b_microbatch"]))
      grads = add_chunk_grads(carry["grads"], chunk_grads, op)
    backward_out = (cotangent, grads)
    with jax.named_scope("pp send-recv"):
      if ordered_collectives:  # both sends after the backward slot, the forward's first
        activation = send_forward(after_by_one_element(activation, backward_out, never))
        cotangent = after_by_one_element(cotangent, activation, never)
      cotangent = send_backward(cotangent)
    # Arrivals are written at the tick's end, after every read of the tick.
    new = dict(stash=with_row_at(stash, activation, op["recv_fwd"]),
               cotangents=with_row_at(cotangents, cotangent, op["recv_bwd"]),
               grads=grads, stats=stats)
    if "residuals" in carry:
      if ordered_collectives:
        residuals = _written_after(residuals, backward_out, never)
      new["residuals"] = {key: with_row_at(buffer, residuals[key], op["f_res_slot"])
                          for key, buffer in carry["residuals"].items()}
    return new

  def segment(first_tick, last_tick):
    return {name: jnp.asarray(table[first_tick:last_tick]) for name, table in tables.per_stage.items()}, \
        {name: table[first_tick:last_tick] for name, table in tables.per_stage.items()}

  def rows_of(tree, start, size):
    return jax.tree.map(lambda x: rows_at(x, start, size), tree)

  ticks = tables.ticks
  head, tail = len(gather_starts), len(scatter_starts)
  # Head: each tick also gathers a piece of the other chunks' rows (first, on CPU), which the
  # scan stacks; only the first chunk's rows are read meanwhile.
  if head:
    head_rows, head_table = segment(0, head)
    reads = (head_table["f_branch"] == 0) | (head_table["f_chunk"] == 0), (head_table["b_branch"] == 0) | (head_table["b_chunk"] == 0)
    assert reads[0].all() and reads[1].all(), "the head's ticks read only first chunks (Tables.first_chunk_only_ticks)"
    forwards, backwards = branches(full[LAYERS], head_table)
    def head_tick(carry_and_layers, xs):
      carry, layers = carry_and_layers
      rows, start = xs
      first_row = k + start
      shards = rows_of(params[LAYERS], first_row, gather_rows)
      piece = stage_params({LAYERS: shards}, {LAYERS: layouts[LAYERS]}, c.compute_dtype,
                           in_turn=never if ordered_collectives else None, bucket_bytes=bucket_bytes)[LAYERS]
      # Into the stage's rows at once (no branch reads them before the head ends).
      layers = jax.tree.map(lambda buffer, rows: with_rows_at(buffer, rows, first_row), layers,
                            compute_rows(piece, c))
      return (tick(carry, rows, forwards, backwards, piece), layers), None
    layers = jax.tree.map(lambda first: _with_rows(first, k + rest), full[LAYERS])
    (carry, layers), _ = lax.scan(head_tick, (carry, layers), (head_rows, jnp.asarray(gather_starts, jnp.int32)))
    full = {**full, LAYERS: layers}
  steady_rows, steady_table = segment(head, ticks - tail)
  forwards, backwards = branches(full[LAYERS], steady_table)
  carry, _ = lax.scan(lambda carry, rows: (tick(carry, rows, forwards, backwards), None), carry, steady_rows)
  # Tail: each tick also reduce-scatters a piece of the other chunks' summed rows, final
  # since the tail began (only first chunks run there).
  if tail:
    tail_rows, tail_table = segment(ticks - tail, ticks)
    forwards, backwards = branches(full[LAYERS], tail_table)
    def tail_tick(carry, xs):
      rows, start = xs
      sums = parameter_grads(rows_of(carry["grads"][LAYERS], k + start, scatter_rows))
      piece = zero.reduce_scatter_grads({LAYERS: sums}, {LAYERS: layouts[LAYERS]}, bucket_bytes,
                                            ordered=True if ordered_collectives else None)[LAYERS]
      return tick(carry, rows, forwards, backwards, piece), piece
    carry, pieces = lax.scan(tail_tick, carry, (tail_rows, jnp.asarray(scatter_starts, jnp.int32)))
  grads = carry["grads"]
  if grad_sync == "step":   # one dp reduce-scatter per leaf and piece for the step (before the pp sum: on shards)
    first_chunk = {**grads, LAYERS: parameter_grads(jax.tree.map(lambda x: x[:k] if tail else x, grads[LAYERS]))}
    grads = zero.reduce_scatter_grads(first_chunk, layouts, bucket_bytes)
    if tail:
      grads = {**grads, LAYERS: jax.tree.map(lambda first, shard, piece: _assemble_rows(first, shard.shape[0], piece,
                                                                                        scatter_starts),
                                             grads[LAYERS], params[LAYERS], pieces)}
  return sum_over_stages(grads, carry["stats"])
