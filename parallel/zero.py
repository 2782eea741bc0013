"""ZeRO inside the step's shard_map: the parameters' all-gathers and the gradients' reduce-scatters over dp.

Each device holds 1/dp of every parameter's fp32 master (megajax.parallel.sharding: the
layouts). The step gathers the parameters it computes with (the linears cast to the compute
dtype first: gathers_in_compute_dtype), with pp = 1 one layer ahead of their use inside the
first microbatch's forward (layer_ahead_gathers), each layer in its compute form
(megajax.parallel.fused: a fused matmul's kernels gathered as its operand); and it
reduce-scatters the gradients so that each device keeps the sum of its shard
(reduce_scatter_grads). What one collective carries: a fused operand whole, another matrix
split on its leading dimension alone, the other leaves packed into buckets of
parallel.dp_bucket_mb (_units).
"""

from __future__ import annotations

import dataclasses

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from megajax.model import ModelConfig
from megajax.optim import MATRIX_PARAM_NAMES
from megajax.parallel import collectives, fused
from megajax.parallel.mesh import DP, after, after_by_one_element, to_varying, varying_axes


# Which leaves ZeRO gathers in the compute dtype: the rule, in one place.
#
# The sharded forward (megajax.parallel.tensor_parallel, like the Flax Dense layers of the
# reference) casts every kernel and bias of the attention and MLP linears, and the untied
# head, to model.compute_dtype before any other op on it, once per use. For these leaves the
# cast moves before the dp all-gather: the gathered bf16 weight equals the cast of the full
# fp32 master, at half the gather's bytes. Their gradients are the cotangents of that cast,
# converted back to the master dtype (to_master_dtype) before they are summed or reduced:
# what the cast's own transpose did, so the maths is bit-for-bit the same (up to where XLA
# skips a bf16 rounding before a conversion to fp32: docs/parallelism.md).
# Gathered in the master dtype:
#   LayerNorm scales and biases   Flax's LayerNorm applies them in fp32 (the statistics' dtype);
#   the embedding                 looked up first, cast after: its gradient is a scatter-add
#                                 over the tokens, summed in fp32 (with tied embeddings the
#                                 head's transposed use casts, the lookup still does not).
COMPUTE_DTYPE_MODULES = ("attention", "mlp")     # a block's modules made of linears only


def gathers_in_compute_dtype(path: tuple[str, ...]) -> bool:
  """Whether the leaf at `path` (its keys in the params: ("layer_3", "mlp", "wi", "kernel"),
  stacked ("layers", "attention", "out", "bias"), ("head",)) is cast to the compute dtype on
  its master shard, before ZeRO's all-gather; every use of it in the forward is such a cast."""
  return path == ("head",) or (len(path) > 2 and path[1] in COMPUTE_DTYPE_MODULES)


def to_master_dtype(grads, params_like):
  """Gradients w.r.t. the gathered parameters -> the dtype of their master shards (fp32): the
  conversion the cast's transpose makes when the cast follows the gather. Before any sum."""
  return jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params_like)


# Inside the shard_map: ZeRO's gather of the parameters and scatter of the gradients.

def gather_params(params, layouts, compute_dtype=None, in_turn=None, bucket_bytes: int = 0, start_after=None,
                  model: ModelConfig | None = None):
  """dp shards -> this tp rank's full parameters: all-gathers over dp, in the order the
  forward pass uses them. A matrix (a kernel, the embedding, the head) split on its leading
  dimension is gathered alone, the other leaves (norm scales, biases; the pipeline's stacked
  kernels) packed into buckets of at most `bucket_bytes` gathered bytes each
  (parallel.dp_bucket_mb; 0: one all-gather per leaf).

  With `model`, each layer ("layer_<i>") comes back in its compute form
  (megajax.parallel.fused): an operand whose members ZeRO split on their first dimension is
  one all-gather of them packed (fused.pack), its result the operand itself; another one is
  built from its gathered members (a copy). A bucket holds leaves of one kind only (dtype and
  the mesh axes they vary over: shard_map's types) and is one all-gather of their shards laid
  end to end; each leaf is cut out of the gathered rows. With a `compute_dtype` the leaves of
  gathers_in_compute_dtype are cast to it on the shard and gathered in it (None: every leaf in
  its master dtype, e.g. where a gathered leaf's cotangent would be summed before its
  conversion: the GPipe baseline's tick scan). Leaves ZeRO could not split are marked
  per-device on dp, like the gathered ones: every gradient then comes back per device and
  reduce_scatter_grads does the one dp reduction.
  `start_after`: (deps, never) for mesh.after: no gather starts before `deps` are computed.
  `in_turn` (XLA:CPU inside a loop, where independent collectives may start in a different
  order on each device): a condition false at run time (mesh.after); each gather then waits
  for the one before, the kinds taken from the least varying (a dependency must not add
  mesh axes to a leaf).
  """
  paths, treedef = jax.tree_util.tree_flatten_with_path(params)
  flat_layouts = treedef.flatten_up_to(layouts)
  keys = [tuple(k.key for k in path) for path, _ in paths]
  leaves = _in_gather_dtype(keys, [p for _, p in paths], compute_dtype)
  out = [to_varying(p, (DP,)) if layout.dp_dim is None else None for p, layout in zip(leaves, flat_layouts)]
  dp = lax.axis_size(DP)
  whole = _whole_operands(keys, leaves, flat_layouts, model, dp)
  if start_after is not None:
    deps, never = start_after
    needs = varying_axes(jax.tree.leaves(deps)[0]) | varying_axes(never)
  previous = None

  def ordered(x):
    """The bucket's buffer (or lone shard, or packed operand), made to wait for what it must follow."""
    if start_after is not None and needs <= varying_axes(x) | {DP}:
      x = after(x, deps, never)
    if previous is not None and varying_axes(previous) <= varying_axes(x) | {DP}:
      x = after(x, previous, in_turn)
    return x

  operands = {}
  with jax.named_scope("dp all-gather"):    # trace scopes name each collective kind (megajax.observe.traces)
    for unit in _units(keys, leaves, flat_layouts, whole, bucket_bytes, dp):
      if isinstance(unit, _WholeOperand):
        packed = ordered(fused.pack(unit.operand, [leaves[i] for i in unit.members]))
        gathered = [lax.all_gather(packed, DP, axis=0, tiled=not unit.operand.rows)]
        operands.setdefault(unit.layer, {})[unit.operand.name] = gathered[0]
      else:
        gathered = _packed_all_gather([leaves[i] for i in unit], [flat_layouts[i].dp_dim for i in unit], ordered)
        for i, leaf in zip(unit, gathered):
          out[i] = leaf
      previous = gathered[-1] if in_turn is not None else None
  tree = treedef.unflatten(out)
  if model is not None:
    tree = {name: fused.to_compute_form(value, model, operands.get(name)) if name.startswith("layer_") else value
            for name, value in tree.items()}
  return tree


def _in_gather_dtype(keys, leaves, compute_dtype):
  """The leaves as ZeRO gathers them: those of gathers_in_compute_dtype cast to `compute_dtype`."""
  return [x.astype(compute_dtype) if compute_dtype is not None and gathers_in_compute_dtype(key) else x
          for key, x in zip(keys, leaves)]


@dataclasses.dataclass(frozen=True)
class _WholeOperand:
  """A fused operand ZeRO moves in one collective: its layer, what it is, its members'
  positions among the flattened leaves."""
  layer: str
  operand: fused.Operand
  members: tuple[int, ...]


def _whole_operands(keys, leaves, flat_layouts, model: ModelConfig | None, dp: int) -> list[_WholeOperand]:
  """The layers' fused operands (megajax.parallel.fused) whose members, all present, are split
  over dp on their first dimension and of one kind (dtype, varying axes): an all-gather of
  them packed is the operand. None without a model or with dp = 1 (nothing is gathered)."""
  if model is None or dp == 1:
    return []
  index = {key: i for i, key in enumerate(keys)}
  found = []
  for layer in dict.fromkeys(key[0] for key in keys if key[0].startswith("layer_")):
    for operand in fused.operands(model).values():
      members = tuple(index.get((layer, module, linear, "kernel")) for module, linear in operand.members)
      if (None not in members and all(flat_layouts[i].dp_dim == 0 for i in members)
          and len({_kind(leaves[i]) for i in members}) == 1):
        found.append(_WholeOperand(layer, operand, members))
  return found


def _kind(x) -> tuple:
  """What one collective can carry together: the mesh axes a value varies over (fewest
  first: mesh.after's rule for orders) and its dtype."""
  return len(varying_axes(x)), tuple(sorted(varying_axes(x))), str(x.dtype)


def _units(keys, leaves, flat_layouts, whole: list, bucket_bytes: int, scale: int, backward: bool = False) -> list:
  """The collectives of a ZeRO gather (or, `backward`, reduce-scatter) in the order they go:
  each a _WholeOperand or a bucket of leaf positions; kinds from the least varying (mesh.after's
  rule), each in the order the forward uses them (the backward makes them: reversed). A
  matrix split on its leading dimension goes alone; the other leaves of a kind in buckets of
  up to `bucket_bytes` (a leaf's bytes times `scale`: a shard's gathered size)."""
  members = {i for unit in whole for i in unit.members}
  # Traced in the order the forward pass needs them (a dict would be walked alphabetically).
  forward = sorted(range(len(keys)), key=lambda i: (_forward_order(keys[i][0]), i))
  rank = {i: (-r if backward else r) for r, i in enumerate(forward)}
  split = sorted((i for i, layout in enumerate(flat_layouts) if layout.dp_dim is not None and i not in members),
                 key=rank.get)
  # A matrix split on its leading dimension goes alone: the collective's buffer is the matrix
  # (packed, it would be cut out of the rows: a copy). Split on another one (the pipeline's
  # stacked [layers, ...] leaves), XLA moves it to a leading one and back anyway: packed.
  matrices = [i for i in split if keys[i][-1] in MATRIX_PARAM_NAMES and flat_layouts[i].dp_dim == 0]
  units = [(unit.members[0], unit) for unit in whole] + [(i, [i]) for i in matrices]
  units += [(bucket[0], bucket) for bucket in _buckets([i for i in split if i not in matrices], leaves, bucket_bytes,
                                                       scale)]
  units.sort(key=lambda unit: (_kind(leaves[unit[0]]), rank[unit[0]]))
  return [unit for _, unit in units]


def _buckets(indices: list[int], leaves: list, bucket_bytes: int, scale: int = 1) -> list[list[int]]:
  """`indices` (in the order the collectives should go) cut into buckets: consecutive leaves
  of one kind (dtype, varying mesh axes) up to `bucket_bytes` together, counting each leaf's
  bytes times `scale` (a shard's: dp, its gathered size); kinds from the least varying
  (mesh.after's rule), each in the given order. 0: a bucket per leaf."""
  buckets = []
  for group in sorted({_kind(leaves[i]) for i in indices}):
    current, size = [], 0
    for i in (i for i in indices if _kind(leaves[i]) == group):
      nbytes = leaves[i].size * leaves[i].dtype.itemsize * scale
      if current and size + nbytes > bucket_bytes:
        buckets.append(current)
        current, size = [], 0
      current.append(i)
      size += nbytes
    buckets.append(current)
  return buckets


def _packed_all_gather(shards: list, dp_dims: list[int], prepare=lambda x: x) -> list:
  """[lax.all_gather(shard, DP, axis=dim, tiled=True) for each shard] in one collective: the
  shards flattened end to end, gathered into rows [dp, n], each leaf cut out of the rows and
  its dp pieces put back along its dimension. `prepare` maps what is gathered (the packed
  buffer, or a lone shard) first: its ordering dependencies, once per collective."""
  if len(shards) == 1:
    return [lax.all_gather(prepare(shards[0]), DP, axis=dp_dims[0], tiled=True)]
  dp = lax.axis_size(DP)
  rows = lax.all_gather(prepare(jnp.concatenate([x.ravel() for x in shards])), DP, axis=0)     # [dp, n]
  offsets = np.cumsum([0] + [x.size for x in shards])
  out = []
  for x, dim, start, stop in zip(shards, dp_dims, offsets[:-1], offsets[1:]):
    pieces = jnp.moveaxis(rows[:, start:stop].reshape(dp, *x.shape), 0, dim)      # [..., dp, x.shape[dim], ...]
    out.append(pieces.reshape(*x.shape[:dim], dp * x.shape[dim], *x.shape[dim + 1:]))
  return out


# ZeRO's gathers one layer ahead (pp = 1). The parameters stay gathered for the whole step
# (ZeRO-2), so only the first microbatch waits for them: its forward issues each gather
# one layer ahead of its use (the next block's as this one starts: sharding's part in
# megajax.parallel.tensor_parallel.loss_sums), so on a GPU the gather of layer i + 1 runs
# under layer i's compute, and only the embedding's and the first block's are exposed.
# Every later microbatch reuses what it gathered.

def gathered_zeros(shards, layouts, compute_dtype=None, model: ModelConfig | None = None):
  """Zeros typed like gather_params(shards, layouts, compute_dtype, model=model): shape, dtype
  and the mesh axes they vary over (the gradient accumulators' and layer_ahead_gathers'
  template; the layers in compute form with `model`)."""
  dp = lax.axis_size(DP)
  def zeros(path, shard, layout):
    shape = list(shard.shape)
    if layout.dp_dim is not None:
      shape[layout.dp_dim] *= dp
    cast = compute_dtype is not None and gathers_in_compute_dtype(tuple(k.key for k in path))
    return to_varying(jnp.zeros(shape, compute_dtype if cast else shard.dtype), (*varying_axes(shard), DP))
  tree = jax.tree_util.tree_map_with_path(zeros, shards, layouts)
  if model is None:
    return tree
  paths, treedef = jax.tree_util.tree_flatten_with_path(shards)
  keys = [tuple(k.key for k in path) for path, _ in paths]
  whole = _whole_operands(keys, _in_gather_dtype(keys, [x for _, x in paths], compute_dtype),
                          treedef.flatten_up_to(layouts), model, dp)
  groups = {}     # a rows operand gathered whole comes in dp groups (fused.rows)
  for unit in whole:
    groups.setdefault(unit.layer, {})[unit.operand.name] = dp
  return {name: fused.to_compute_form(value, model, groups=groups.get(name)) if name.startswith("layer_") else value
          for name, value in tree.items()}


@jax.custom_vjp
def _gradient_to(sink, value):
  """`value`, its cotangent handed to `sink` (a zero of its type): the gradient w.r.t. a
  gathered parameter, though the gather itself runs inside the differentiated function."""
  return value


_gradient_to.defvjp(lambda sink, value: (value, None), lambda _, cotangent: (cotangent, None))


def layer_ahead_gathers(shards, layouts, compute_dtype, sinks, never, ordered: bool = False, bucket_bytes: int = 0,
                        model: ModelConfig | None = None):
  """For loss_sums(gather_ahead=...): (params, names, issued_after) -> (params with the leaves
  `names` added, issued_after), gathered as gather_params does (in buckets of `bucket_bytes`;
  the layers in compute form with `model`), each gather depending on `issued_after`
  (mesh.after, `never`: false at run time) so that none starts earlier; a gathered value's
  gradient goes to its entry of `sinks` (gathered_zeros: the step differentiates w.r.t.
  them). Names not in `shards` (a tied head) are skipped. Shards that do not vary over every
  mesh axis of `issued_after` (tp-replicated LayerNorm scales and biases: the activations vary
  over tp) are issued at once instead: a dependency would make them vary over tp too, and
  they are small.
  `ordered` (XLA:CPU): the group's gathers one after another, and the returned
  `issued_after` (the layer's input) waits for all of them: every collective of the layer
  reads it, and none of them can start before the group's gathers are done. (The gathered
  values themselves need no wait: what reads them in the forward reads the layer's input too;
  a wait on them would copy them.)"""
  def ahead(params, names, issued_after):
    names = [name for name in names if name in shards and name not in params]
    group = {name: layouts[name] for name in names}
    gathered = gather_params({name: shards[name] for name in names}, group, compute_dtype,
                             in_turn=never if ordered else None, bucket_bytes=bucket_bytes,
                             start_after=(issued_after, never), model=model)
    if ordered and any(layout.dp_dim is not None for layout in jax.tree.leaves(group)):
      def waits(x):     # on every gather whose value varies over no more mesh axes than x
        done = [g for g in jax.tree.leaves(gathered) if varying_axes(g) <= varying_axes(x)]
        return after_by_one_element(x, done, never) if done else x
      issued_after = jax.tree.map(waits, issued_after)
    return {**params, **jax.tree.map(_gradient_to, {name: sinks[name] for name in names}, gathered)}, issued_after
  return ahead


def first_microbatch_gathering(loss, shards, layouts, compute_dtype, sinks, ordered: bool = False,
                               bucket_bytes: int = 0, model: ModelConfig | None = None):
  """For megajax.reference_step.accumulate_gradients(first_microbatch=...): microbatch ->
  ((objective, stats), gradients w.r.t. the gathered parameters, the gathered parameters),
  the gathers issued inside `loss(params, microbatch, gather_ahead=...)`'s forward one layer
  ahead. `sinks`: gathered_zeros of the same arguments; `ordered`, `bucket_bytes`, `model`:
  layer_ahead_gathers'."""
  def first(microbatch):
    never = microbatch["inputs"][0, 0] < 0      # token ids are never negative: false, opaque to XLA

    def objective(sinks):
      ahead = layer_ahead_gathers(shards, layouts, compute_dtype, sinks, never, ordered, bucket_bytes, model)
      gathered = {}
      def gather_ahead(params, names, issued_after):
        params, issued_after = ahead(params, names, issued_after)
        gathered.update(params)
        return params, issued_after
      total, stats = loss({}, microbatch, gather_ahead=gather_ahead)
      return total, (stats, gathered)

    (total, (stats, params)), grads = jax.value_and_grad(objective, has_aux=True)(sinks)
    return (total, stats), grads, params
  return first


def _forward_order(name: str):
  """embedding, layer_0, layer_1, ..., layer_10, ... (or the stacked layers), final_norm, head."""
  if name.startswith("layer_"):
    return (1, int(name.split("_")[1]))
  if name == "layers":
    return (1, 0)
  return (0 if name == "embedding" else 2 if name == "final_norm" else 3, 0)


def gradient_accumulators(like):
  """fp32 zeros shaped like `like` (and, inside the shard_map, varying over the same mesh
  axes): the local sum of a step's microbatch gradients under parallel.grad_sync="step",
  fp32 whatever the parameter dtype so that summing m microbatches loses no bits."""
  return jax.tree.map(lambda x: jnp.zeros_like(x, jnp.float32), like)


@jax.named_scope("dp reduce-scatter")
def reduce_scatter_grads(grads, layouts, bucket_bytes: int = 0, ordered: bool | None = None, shards=None,
                         model: ModelConfig | None = None):
  """Per-device gradients -> their dp sum, each dp rank keeping its shard (no all-reduce).

  The collectives go in the order the backward pass makes the gradients (the head's first):
  a matrix split on its leading dimension alone, the other leaves packed into reduce-scatters
  of at most `bucket_bytes` each (parallel.dp_bucket_mb; 0: one per leaf), a bucket holding
  leaves of one kind (dtype, varying mesh axes), so that each can start as soon as the
  backward has made its leaves.
  Leaves with no dp split: one psum for them all. With `model`, `grads` are w.r.t.
  gather_params(..., model=model)'s values (the layers in compute form) and the result is
  shaped like `shards` (the parameters' dp shards): an operand gathered whole is
  reduce-scattered whole and unpacked into its members' shards (megajax.parallel.fused),
  another one's members are cut out of it first.
  `ordered` (default: on CPU across processes): each collective waits
  for the one before (the same values): XLA:CPU runs independent collectives concurrently,
  and its gloo reduce-scatters on one communicator take their message slots from a shared
  counter in whatever order their threads get there. Two processes can then wait on
  different slots: a 30 s timeout whose error path hangs (jax-ml/jax#40831).
  """
  if ordered is None:
    ordered = jax.process_count() > 1 and jax.devices()[0].platform == "cpu"
  paths, treedef = jax.tree_util.tree_flatten_with_path(grads if model is None else shards)
  keys = [tuple(k.key for k in path) for path, _ in paths]
  flat_layouts = treedef.flatten_up_to(layouts)
  if model is None:
    leaves, whole, whole_grads = [leaf for _, leaf in paths], [], {}
  else:
    leaves, whole, whole_grads = _member_gradients(grads, keys, [x for _, x in paths], flat_layouts, model)
  out = list(leaves)
  previous = None

  def in_turn(x):
    # A data dependency on the previous collective's result (one element of x plus 0 * r: not
    # folded away for floats, and in place) so that XLA:CPU starts this collective only after
    # that one has finished. (Not where it would make x vary over more mesh axes; kinds go
    # from the least varying.)
    if previous is None or not varying_axes(previous) <= varying_axes(x):
      return x
    return x.at[(0,) * x.ndim].add((previous * 0).astype(x.dtype))

  # Each whole operand's gradient stands at its first member's place for the order and kind.
  sources = list(leaves)
  for unit in whole:
    sources[unit.members[0]] = whole_grads[unit]
  for unit in _units(keys, sources, flat_layouts, whole, bucket_bytes, 1, backward=True):
    if isinstance(unit, _WholeOperand):
      mine = lax.psum_scatter(in_turn(whole_grads[unit]), DP, scatter_dimension=0, tiled=not unit.operand.rows)
      scattered = fused.unpack(unit.operand, mine, [paths[i][1] for i in unit.members])
      positions = unit.members
    else:
      scattered = _packed_reduce_scatter([leaves[i] for i in unit], [flat_layouts[i].dp_dim for i in unit], in_turn)
      positions = unit
    previous = scattered[-1].ravel()[0] if ordered else None
    for i, shard in zip(positions, scattered):
      out[i] = shard
  backward = sorted(range(len(keys)), key=lambda i: (_forward_order(keys[i][0]), i), reverse=True)
  summed = [i for i in backward if flat_layouts[i].dp_dim is None]
  if summed:    # one all-reduce of them all (a variadic psum)
    for i, total in zip(summed, collectives.psum([in_turn(leaves[i]) for i in summed], DP)):
      out[i] = total
  return treedef.unflatten(out)


def _member_gradients(grads, keys, shards, flat_layouts, model: ModelConfig):
  """Gradients w.r.t. compute-form layers -> (one per leaf of `keys`, None for the members of
  an operand reduce-scattered whole; those operands (_whole_operands); their gradients). An
  operand not moved whole is cut into its members' full gradients (fused.unpack)."""
  dp = lax.axis_size(DP)
  whole = _whole_operands(keys, shards, flat_layouts, model, dp)
  whole_names = {(unit.layer, unit.operand.name) for unit in whole}
  index = {key: i for i, key in enumerate(keys)}
  leaves = [None] * len(keys)
  members = set()
  for layer in dict.fromkeys(key[0] for key in keys if key[0].startswith("layer_")):
    for operand in fused.operands(model).values():
      positions = [index[(layer, module, linear, "kernel")] for module, linear in operand.members]
      members.update(positions)
      if (layer, operand.name) in whole_names:
        continue
      full = [jax.ShapeDtypeStruct(tuple(n * dp if d == flat_layouts[i].dp_dim else n
                                         for d, n in enumerate(shards[i].shape)), shards[i].dtype) for i in positions]
      for i, g in zip(positions, fused.unpack(operand, grads[layer][operand.name], full)):
        leaves[i] = g
  for i, key in enumerate(keys):
    if i not in members:
      value = grads
      for k in key:
        value = value[k]
      leaves[i] = value
  return leaves, whole, {unit: grads[unit.layer][unit.operand.name] for unit in whole}


def _packed_reduce_scatter(leaves: list, dp_dims: list[int], prepare=lambda x: x) -> list:
  """[psum_scatter(leaf, DP, scatter_dimension=dim, tiled=True) for each leaf] in one
  collective: each leaf split along its dp dimension into rows [dp, n], the rows of the
  leaves side by side, one reduce-scatter over the rows. `prepare`: as _packed_all_gather's."""
  if len(leaves) == 1:
    return [lax.psum_scatter(prepare(leaves[0]), DP, scatter_dimension=dp_dims[0], tiled=True)]
  dp = lax.axis_size(DP)
  moved = [jnp.moveaxis(x, dim, 0) for x, dim in zip(leaves, dp_dims)]
  rows = prepare(jnp.concatenate([m.reshape(dp, -1) for m in moved], axis=1))
  mine = lax.psum_scatter(rows, DP, scatter_dimension=0, tiled=True)[0]
  offsets = np.cumsum([0] + [m.size // dp for m in moved])
  return [jnp.moveaxis(mine[start:stop].reshape((m.shape[0] // dp, *m.shape[1:])), 0, dim)
          for m, dim, start, stop in zip(moved, dp_dims, offsets[:-1], offsets[1:])]
