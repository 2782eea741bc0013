"""What a chunk program runs in the executor's two slots, and the gradients a backward returns.

executor.py runs the tick scan; each tick's forward slot and backward slot is a lax.switch
over idle | one branch per chunk program. `Slots` (one per step, built once the first
chunk's rows are gathered) makes those branch lists for a segment of the scan and owns
what the branches share: the gathered stage parameters, the microbatches, the residual
layout of each program's forward (residuals.py, parallel.pipeline_recompute=False), and
the gradient accumulators' types (how a backward's gradients are added: grad_sync).
forward.py (the eval step) runs the same chunk programs (`chunk_forward`).
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp

from megajax.model import ModelConfig
from megajax.parallel import zero
from megajax.parallel.mesh import PP, to_varying, varying_axes
from megajax.parallel.pipeline.residuals import SplitChunk, group_dtype
from megajax.parallel.pipeline.stacking import LAYERS, compute_rows, parameter_rows
from megajax.parallel.pipeline.tables import Program, Tables
from megajax.parallel.tensor_parallel import Overlap, apply_block, head_loss_sums, positions_of, vocab_parallel_embed


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


def matching(tree, like):
  """`tree` cast to the per-device (varying) axes of `like`, leaf by leaf: switch branches
  must return identically typed values."""
  return jax.tree.map(lambda x, y: to_varying(x, tuple(varying_axes(y))), tree, like)


def shared_names(program: Program, c: ModelConfig) -> tuple:
  """The non-block parameters a chunk program uses."""
  names = ("embedding",) if program.first else ()
  if program.last:
    names += ("final_norm", "embedding" if c.tie_embeddings else "head")
  return tuple(dict.fromkeys(names))


def group_key(group: tuple) -> str:
  """A residual buffer's name in the carry: the mesh axes its values vary over, their width."""
  axes, width = group
  return f"{','.join(axes) or 'invariant'}:{width * 8}bit"


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


class Slots:
  """The branches of one step's slots. `full`: the gathered stage parameters (the shared
  leaves read from here; the layers' rows are handed to `branches`, as the scan's head
  gathers them); `gathered_like`: the gathered leaves' types, the layers in their compute
  form; `layer_like`: the layers' gathered parameter form (parameter_rows cuts into it);
  `empty_message`: an activation's type; `stage`: this device's pp index."""

  def __init__(self, params, full, microbatches, layouts, tables: Tables, c: ModelConfig, overlap: Overlap,
               z_loss: float, grad_sync: str, bucket_bytes: int, gathered_like, layer_like, empty_message, stage):
    self.full, self.microbatches, self.layouts, self.tables, self.c = full, microbatches, layouts, tables, c
    self.overlap, self.z_loss, self.grad_sync, self.bucket_bytes = overlap, z_loss, grad_sync, bucket_bytes
    self.gathered_like, self.layer_like, self.empty_message = gathered_like, layer_like, empty_message
    self.k = tables.layers_per_chunk
    # A backward slot's gradients: the chunk's k rows and every shared leaf any program uses, in
    # the master dtype (as they come from the vjp, a leaf gathered in the compute dtype
    # converted: what its cast's transpose did before), typed like the gathered parameters.
    self.shared_names = tuple(dict.fromkeys(name for program in tables.programs
                                            for name in shared_names(program, c)))
    self.grad_names = (LAYERS, *self.shared_names)
    self.masters = {name: params[name] for name in self.grad_names}
    self.masters[LAYERS] = jax.eval_shape(lambda layers: compute_rows(layers, c), params[LAYERS])   # their dtypes
    # Which backward branch produces which shared leaf (branch 0 idles): the tick adds a leaf's
    # gradient only when its branch made one.
    self.produces = {name: jnp.asarray([False] + [name in shared_names(program, c) for program in tables.programs])
                     for name in self.shared_names}
    self.splits, self.residual_words = self._split_forwards(stage) if not tables.recompute else ({}, {})

  def _split_forwards(self, stage):
    """parallel.pipeline_recompute=False: each non-last program's forward traced once with its
    residuals split out (residuals.py), and the words of each group of mesh axes' residual
    vector (as wide as the widest program's stash)."""
    splits, words = {}, {}
    # Example arguments typed as a tick's (indices read from the stage's table row vary over pp).
    index = jnp.asarray(self.tables.per_stage["f_chunk"])[0][stage]
    for program in self.tables.programs:
      if not program.last:
        shared = {name: self.full[name] for name in shared_names(program, self.c)}
        splits[program] = SplitChunk.trace(chunk_forward(program, self.c, self.overlap, self.z_loss),
                                           self.chunk_params(self.full[LAYERS], index), shared, self.empty_message,
                                           self.microbatch(index))
        for group, width in splits[program].words.items():
          words[group] = max(words.get(group, 0), width)
    return splits, words

  def microbatch(self, index):
    return jax.tree.map(lambda x: row_at(x, index), self.microbatches)

  def chunk_params(self, layers, chunk):
    start = chunk * self.k
    return jax.tree.map(lambda x: rows_at(x, start, self.k), layers)

  def parameter_grads(self, rows):
    """Layer gradients w.r.t. their compute form, cut into the parameters' (for the reduce-scatter)."""
    return parameter_rows(rows, self.layer_like, self.c)

  def residual_buffers(self) -> dict:
    """The carry's residual buffers: per group of mesh axes, [slots + 1, words]; varying over pp
    too, whatever the group's axes (the tick's slots are switched by stage: what they write
    varies over pp, a residual the chunk traced as pp-invariant (a mask of the layout's) too)."""
    return {group_key(group): to_varying(jnp.zeros((self.tables.residual_slots + 1, words), group_dtype(group)),
                                         (*group[0], PP))
            for group, words in self.residual_words.items()}

  # What an idle slot returns is made inside its branch, not closed over: a switch returning a
  # buffer from outside copies it (an 8 MiB residual vector a tick in the H100 compile).
  def empty_residuals(self) -> dict:
    return {group_key(group): to_varying(jnp.zeros((words,), group_dtype(group)), group[0])
            for group, words in self.residual_words.items()}

  def no_message(self):
    return jnp.zeros_like(self.empty_message)

  # --- A backward slot's gradients. The switch returns them and the tick adds them to the carry
  # outside it: an accumulator handed through a switch whose branches use different operands
  # is copied whole by XLA in every branch (the deviceless H100 compile of a 2x2x2 step:
  # 2 x 8 MiB copies a backward slot).

  def zero_grads(self, names=None):
    names = self.grad_names if names is None else names
    like = {name: self.gathered_like[name] for name in names}
    if LAYERS in like:
      like[LAYERS] = jax.tree.map(lambda x: jax.ShapeDtypeStruct((self.k, *x.shape[1:]), x.dtype), like[LAYERS])
    axes = {name: self.gathered_like[name] for name in names}
    return jax.tree.map(lambda x, master, typed: to_varying(jnp.zeros(x.shape, master.dtype), tuple(varying_axes(typed))),
                        like, {name: self.masters[name] for name in names}, axes)

  def chunk_grads_of(self, layer_grads, shared_grads):
    produced = zero.to_master_dtype({LAYERS: layer_grads, **shared_grads},
                                    {name: self.masters[name] for name in (LAYERS, *shared_grads)})
    missing = tuple(name for name in self.shared_names if name not in shared_grads)
    return matching({**self.zero_grads(missing), **produced}, self.zero_grads())

  def add_chunk_grads(self, grads, chunk_grads, op):
    """Add one backward slot's gradients. "step": as they are, every leaf every tick (an idle
    slot's are zeros; the dp reduce-scatter waits for the chunk's last backward): a lax.cond
    around the add would copy the whole buffer in its pass-through branch, as the switch did.
    "microbatch": reduce-scattered over dp first into the shard, under a cond that skips an
    idle slot's (and a shared leaf its program does not use): no collective of zeros."""
    branch = op["b_branch"]
    start = op["b_chunk"] * self.k

    def add(name, before):     # one leaf group: each cond hands only its own buffers through
      reduced = {name: chunk_grads[name]}
      if self.grad_sync == "microbatch":
        if name == LAYERS:
          reduced = {name: self.parameter_grads(reduced[name])}
        reduced = zero.reduce_scatter_grads(reduced, {name: self.layouts[name]}, self.bucket_bytes)
      if name == LAYERS:
        add_rows = lambda buffer, g: with_rows_at(buffer, rows_at(buffer, start, self.k) + g, start)
        return matching(jax.tree.map(add_rows, before, reduced[LAYERS]), before)
      return matching(jax.tree.map(jnp.add, before, reduced[name]), before)

    grads = dict(grads)
    for name in self.grad_names:
      if self.grad_sync == "step":
        grads[name] = add(name, grads[name])
      else:
        produced = branch > 0 if name == LAYERS else self.produces[name][branch]
        grads[name] = lax.cond(produced, lambda g, name=name: add(name, g), lambda g: g, grads[name])
    return grads

  # --- The branches.

  def _shared(self, program: Program) -> dict:
    return {name: self.full[name] for name in shared_names(program, self.c)}

  def forward(self, program: Program, layers):
    """The forward slot's branch: (stash, op, microbatch) -> (activation, residuals)."""
    run = chunk_forward(program, self.c, self.overlap, self.z_loss)
    def branch(stash, op, mb):
      args = (self.chunk_params(layers, op["f_chunk"]), self._shared(program), row_at(stash, op["f_in_slot"]), mb)
      if program in self.splits:    # the forward, keeping what its backward reads
        (out, _), packed = self.splits[program].forward(*args, words=self.residual_words)
        residuals = {group_key(group): vector for group, vector in packed.items()}
      else:
        out, _ = run(*args)
        residuals = self.empty_residuals()
      return matching(out, self.empty_message), matching(residuals, self.empty_residuals())
    return branch

  def backward(self, program: Program, layers):
    """The backward slot's branch: (stash, cotangents, kept residuals, stats, op, microbatch) ->
    (the chunk's gradients, stats, the input's cotangent)."""
    run = chunk_forward(program, self.c, self.overlap, self.z_loss)
    def branch(stash, cotangents, residuals, stats, op, mb):
      chunk_layers = self.chunk_params(layers, op["b_chunk"])
      shared = self._shared(program)
      if program in self.splits:    # the pullback from the forward's residuals: no forward rerun
        stashed = {group: residuals[group_key(group)] for group in self.residual_words}
        vjp_fn = self.splits[program].pullback_from(chunk_layers, shared, self.empty_message, mb, stashed)
      else:
        # The forward from the stashed input (rerun, or the last chunk's first run), then its backward.
        loss_fn = lambda chunk_layers, shared, x: run(chunk_layers, shared, x, mb)
        out, vjp_fn, new_stats = jax.vjp(loss_fn, chunk_layers, shared, row_at(stash, op["b_in_slot"]), has_aux=True)
      if program.last:     # the loss: seed its backward with 1, count its statistics
        cotangent = to_varying(jnp.ones((), out.dtype), tuple(varying_axes(out)))
        stats = matching(jax.tree.map(jnp.add, stats, new_stats), stats)
      else:
        cotangent = row_at(cotangents, op["b_ct_slot"])
      layer_grads, shared_grads, x_grad = vjp_fn(cotangent)
      return (self.chunk_grads_of(layer_grads, shared_grads), stats,
              self.no_message() if program.first else matching(x_grad, self.empty_message))
    return branch

  def branches(self, layers, segment):
    """Both slots' branch lists reading chunk rows from `layers`; branch 0 idles, and so does a
    program the segment's tables never select (and a last program's forward: Tables.build)."""
    forwards = [lambda stash, op, mb: (self.no_message(), self.empty_residuals())]
    backwards = [lambda stash, cotangents, residuals, stats, op, mb: (self.zero_grads(), stats, self.no_message())]
    for i, program in enumerate(self.tables.programs):
      used = lambda prefix: bool((segment[prefix + "branch"] == i + 1).any())
      forwards.append(self.forward(program, layers) if not program.last and used("f_") else forwards[0])
      backwards.append(self.backward(program, layers) if used("b_") else backwards[0])
    return forwards, backwards
