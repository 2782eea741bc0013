"""How each parameter (and its optimizer state) is split over the mesh.

Tensor parallelism splits the dimension named heads / kv_heads / mlp / vocab over `tp`
(the logical axes the model declares). ZeRO then splits the fp32 master copy, its
gradient and its optimizer state 1/dp over `dp` along the largest dimension that divides
(if that is the tp dimension too, it is split (tp, dp): each tp shard cut in dp pieces).
A leaf with no dimension divisible by dp stays whole on every dp rank. The linears' leaves
are gathered in the compute dtype, cast on the shard (gathers_in_compute_dtype: the rule).

With pipeline parallelism the blocks' parameters are stacked (megajax.parallel.pipeline):
one leaf per parameter with a leading layer axis split over `pp`; LAMB still takes one
trust ratio per layer, as on the single-device model.
"""

from __future__ import annotations

import dataclasses

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import optax

from megajax.model import GPT, logical_axes
from megajax.optim import TensorNorms
from megajax.parallel import collectives
from megajax.parallel.mesh import DP, PP, TP, after, to_varying, varying_axes

# The logical axes tensor parallelism splits over the tp mesh axis; other axes stay whole.
TENSOR_PARALLEL_AXES = ("heads", "kv_heads", "mlp", "vocab")


@dataclasses.dataclass(frozen=True)
class Layout:
  """One parameter's split: the dimension split over tp, the one ZeRO splits over dp, and
  (stacked block parameters) the leading layer axis split over pp."""
  tp_dim: int | None
  dp_dim: int | None
  pp_dim: int | None = None

  def spec(self, ndim: int) -> P:
    entries = [None] * ndim
    if self.pp_dim is not None:
      entries[self.pp_dim] = PP
    if self.tp_dim is not None:
      entries[self.tp_dim] = TP
    if self.dp_dim is not None:
      entries[self.dp_dim] = (TP, DP) if self.dp_dim == self.tp_dim else DP
    return P(*entries)

  @property
  def axes(self) -> tuple[str, ...]:
    """The mesh axes one tensor is split over (the axes its norm is summed over); a stacked
    leaf's layers are whole on their pp stage."""
    return ((DP,) if self.dp_dim is not None else ()) + ((TP,) if self.tp_dim is not None else ())


def _layout(names: P, shape: tuple[int, ...], dp: int, tp: int) -> Layout:
  tp_dims = [i for i, name in enumerate(names) if name in TENSOR_PARALLEL_AXES]
  tp_dim = tp_dims[0] if tp_dims and tp > 1 else None
  local = [size // tp if i == tp_dim else size for i, size in enumerate(shape)]
  candidates = [i for i, size in enumerate(local) if size % dp == 0]
  dp_dim = max(candidates, key=lambda i: (local[i], -i)) if dp > 1 and candidates else None
  return Layout(tp_dim, dp_dim)


def param_layouts(model: GPT, params_like, dp: int, tp: int):
  """A pytree like the params with a Layout at each leaf; `params_like` gives the shapes."""
  return jax.tree.map(lambda names, p: _layout(names, p.shape, dp, tp), logical_axes(model), params_like,
                      is_leaf=lambda x: isinstance(x, P))


def stacked_layouts(layer_layouts):
  """The layouts of stacked block parameters [layers, ...] from one layer's: the layer axis
  goes to pp, the per-layer splits move one dimension up."""
  shift = lambda d: None if d is None else d + 1
  return jax.tree.map(lambda l: Layout(shift(l.tp_dim), shift(l.dp_dim), pp_dim=0), layer_layouts)


def param_specs(layouts, params_like):
  return jax.tree.map(lambda layout, p: layout.spec(len(p.shape)), layouts, params_like)


def optimizer_specs(optimizer: optax.GradientTransformation, params_like, specs):
  """The optimizer state's specs: parameter-shaped leaves as their parameter, the rest replicated."""
  state = jax.eval_shape(optimizer.init, params_like)
  return optax.tree_map_params(optimizer, lambda _, spec: spec, state, specs,
                               transform_non_params=lambda _: P(), is_leaf=lambda x: isinstance(x, P))


def named(mesh, specs):
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P))


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

def gather_params(params, layouts, compute_dtype=None, in_turn=None, bucket_bytes: int = 0, start_after=None):
  """dp shards -> this tp rank's full parameters: all-gathers over dp, the leaves packed into
  buckets of at most `bucket_bytes` gathered bytes each (parallel.dp_bucket_mb; a larger
  leaf goes alone; 0: one all-gather per leaf), in the order the forward pass uses them.

  A bucket holds leaves of one kind only (dtype and the mesh axes they vary over: shard_map's
  types) and is one all-gather of their shards laid end to end; each leaf is cut out of the
  gathered rows. With a `compute_dtype` the leaves of gathers_in_compute_dtype are cast to it
  on the shard and gathered in it (None: every leaf in its master dtype, e.g. where a gathered
  leaf's cotangent would be summed before its conversion: the GPipe baseline's tick scan).
  Leaves ZeRO could not split are marked per-device on dp, like the gathered ones: every
  gradient then comes back per device and reduce_scatter_grads does the one dp reduction.
  `start_after`: (deps, never) for mesh.after: no gather starts before `deps` are computed.
  `in_turn` (XLA:CPU inside a loop, where independent collectives may start in a different
  order on each device): a condition false at run time (mesh.after); each gather then waits
  for the one before, the kinds taken from the least varying (a dependency must not add
  mesh axes to a leaf).
  """
  paths, treedef = jax.tree_util.tree_flatten_with_path(params)
  flat_layouts = treedef.flatten_up_to(layouts)
  keys = [tuple(k.key for k in path) for path, _ in paths]
  leaves = [p.astype(compute_dtype) if compute_dtype is not None and gathers_in_compute_dtype(key) else p
            for key, (_, p) in zip(keys, paths)]
  out = [to_varying(p, (DP,)) if layout.dp_dim is None else None for p, layout in zip(leaves, flat_layouts)]
  # Traced in the order the forward pass needs them (a dict would be walked alphabetically).
  split = sorted((i for i, layout in enumerate(flat_layouts) if layout.dp_dim is not None),
                 key=lambda i: (_forward_order(keys[i][0]), i))
  if start_after is not None:
    deps, never = start_after
    needs = varying_axes(jax.tree.leaves(deps)[0]) | varying_axes(never)
  previous = None

  def ordered(x):
    """The bucket's buffer (or lone shard), made to wait for what it must follow."""
    if start_after is not None and needs <= varying_axes(x) | {DP}:
      x = after(x, deps, never)
    if previous is not None and varying_axes(previous) <= varying_axes(x) | {DP}:
      x = after(x, previous, in_turn)
    return x

  with jax.named_scope("dp all-gather"):    # trace scopes name each collective kind (megajax.observe.traces)
    for bucket in _buckets(split, leaves, bucket_bytes, scale=lax.axis_size(DP)):
      gathered = _packed_all_gather([leaves[i] for i in bucket], [flat_layouts[i].dp_dim for i in bucket], ordered)
      previous = gathered[-1] if in_turn is not None else None
      for i, leaf in zip(bucket, gathered):
        out[i] = leaf
  return treedef.unflatten(out)


def _buckets(indices: list[int], leaves: list, bucket_bytes: int, scale: int = 1) -> list[list[int]]:
  """`indices` (in the order the collectives should go) cut into buckets: consecutive leaves
  of one kind (dtype, varying mesh axes) up to `bucket_bytes` together, counting each leaf's
  bytes times `scale` (a shard's: dp, its gathered size); kinds from the least varying
  (mesh.after's rule), each in the given order. 0: a bucket per leaf."""
  kind = lambda i: (len(varying_axes(leaves[i])), tuple(sorted(varying_axes(leaves[i]))), str(leaves[i].dtype))
  buckets = []
  for group in sorted({kind(i) for i in indices}):
    current, size = [], 0
    for i in (i for i in indices if kind(i) == group):
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

def gathered_zeros(shards, layouts, compute_dtype=None):
  """Zeros typed like gather_params(shards, layouts, compute_dtype): shape, dtype and the
  mesh axes they vary over (the gradient accumulators' and layer_ahead_gathers' template)."""
  dp = lax.axis_size(DP)
  def zeros(path, shard, layout):
    shape = list(shard.shape)
    if layout.dp_dim is not None:
      shape[layout.dp_dim] *= dp
    cast = compute_dtype is not None and gathers_in_compute_dtype(tuple(k.key for k in path))
    return to_varying(jnp.zeros(shape, compute_dtype if cast else shard.dtype), (*varying_axes(shard), DP))
  return jax.tree_util.tree_map_with_path(zeros, shards, layouts)


@jax.custom_vjp
def _gradient_to(sink, value):
  """`value`, its cotangent handed to `sink` (a zero of its type): the gradient w.r.t. a
  gathered parameter, though the gather itself runs inside the differentiated function."""
  return value


_gradient_to.defvjp(lambda sink, value: (value, None), lambda _, cotangent: (cotangent, None))


def layer_ahead_gathers(shards, layouts, compute_dtype, sinks, never, ordered: bool = False, bucket_bytes: int = 0):
  """For loss_sums(gather_ahead=...): (params, names, issued_after) -> (params with the leaves
  `names` added, issued_after), gathered as gather_params does (in buckets of `bucket_bytes`),
  each gather depending on `issued_after` (mesh.after, `never`: false at run time) so that
  none starts earlier; a gathered leaf's gradient goes to its entry of `sinks`
  (gathered_zeros: the step differentiates w.r.t. them). Names not in `shards` (a tied head)
  are skipped. Shards that do not vary over every mesh axis of `issued_after` (tp-replicated
  LayerNorm scales and biases: the activations vary over tp) are issued at once instead: a
  dependency would make them vary over tp too, and they are small.
  `ordered` (XLA:CPU): the group's gathers one after another, and what comes next waits for
  them: the returned `issued_after` (the layer's input) and the group's own leaves."""
  def ahead(params, names, issued_after):
    names = [name for name in names if name in shards and name not in params]
    gathered = gather_params({name: shards[name] for name in names}, {name: layouts[name] for name in names},
                             compute_dtype, in_turn=never if ordered else None, bucket_bytes=bucket_bytes,
                             start_after=(issued_after, never))
    if ordered and names:
      last = max(jax.tree.leaves(gathered), key=lambda x: len(varying_axes(x)))
      waits = lambda x: after(x, last, never) if varying_axes(last) <= varying_axes(x) else x
      gathered = jax.tree.map(waits, gathered)
      issued_after = jax.tree.map(waits, issued_after)
    return {**params, **jax.tree.map(_gradient_to, {name: sinks[name] for name in names}, gathered)}, issued_after
  return ahead


def first_microbatch_gathering(loss, shards, layouts, compute_dtype, sinks, ordered: bool = False,
                               bucket_bytes: int = 0):
  """For megajax.reference_step.accumulate_gradients(first_microbatch=...): microbatch ->
  ((objective, stats), gradients w.r.t. the gathered parameters, the gathered parameters),
  the gathers issued inside `loss(params, microbatch, gather_ahead=...)`'s forward one layer
  ahead. `sinks`: gathered_zeros of the same arguments; `ordered`, `bucket_bytes`:
  layer_ahead_gathers'."""
  def first(microbatch):
    never = microbatch["inputs"][0, 0] < 0      # token ids are never negative: false, opaque to XLA

    def objective(sinks):
      ahead = layer_ahead_gathers(shards, layouts, compute_dtype, sinks, never, ordered, bucket_bytes)
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
def reduce_scatter_grads(grads, layouts, bucket_bytes: int = 0, ordered: bool | None = None):
  """Per-device gradients -> their dp sum, each dp rank keeping its shard (no all-reduce).

  The leaves go in the order the backward pass makes them (the head's first), packed into
  reduce-scatters of at most `bucket_bytes` each (parallel.dp_bucket_mb; a larger leaf goes
  alone; 0: one per leaf), a bucket holding leaves of one kind (dtype, varying mesh axes), so
  that each can start as soon as the backward has made its leaves. Leaves with no dp split:
  one psum for them all. `ordered` (default: on CPU across processes): each collective waits
  for the one before (the same values): XLA:CPU runs independent collectives concurrently,
  and its gloo reduce-scatters on one communicator take their message slots from a shared
  counter in whatever order their threads get there. Two processes can then wait on
  different slots: a 30 s timeout whose error path hangs (jax-ml/jax#40831).
  """
  if ordered is None:
    ordered = jax.process_count() > 1 and jax.devices()[0].platform == "cpu"
  paths, treedef = jax.tree_util.tree_flatten_with_path(grads)
  leaves = [leaf for _, leaf in paths]
  leaf_layouts = treedef.flatten_up_to(layouts)
  backward = sorted(range(len(leaves)), key=lambda i: (_forward_order(paths[i][0][0].key), i), reverse=True)
  out = list(leaves)
  previous = None

  def in_turn(x):
    # A data dependency on the previous collective's result (x + 0 * r: not folded away for
    # floats) so that XLA:CPU starts this collective only after that one has finished. (Not
    # where it would make x vary over more mesh axes; kinds go from the least varying.)
    if previous is None or not varying_axes(previous) <= varying_axes(x):
      return x
    return x + (previous * 0).astype(x.dtype)

  scattered = [i for i in backward if leaf_layouts[i].dp_dim is not None]
  for bucket in _buckets(scattered, leaves, bucket_bytes):
    shards = _packed_reduce_scatter([leaves[i] for i in bucket], [leaf_layouts[i].dp_dim for i in bucket], in_turn)
    previous = shards[-1].ravel()[0] if ordered else None
    for i, shard in zip(bucket, shards):
      out[i] = shard
  summed = [i for i in backward if leaf_layouts[i].dp_dim is None]
  if summed:    # one all-reduce of them all (a variadic psum)
    for i, total in zip(summed, collectives.psum([in_turn(leaves[i]) for i in summed], DP)):
      out[i] = total
  return treedef.unflatten(out)


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


def tensor_norms(layouts) -> TensorNorms:
  """For megajax.optim: whole-tensor squared norms from local shards.

  Per tensor: the local sum of squares, summed over the axes the leaf is split on; a
  stacked leaf gives one norm per layer ([layers, 1, ...], broadcasting against the leaf).
  Total: the sum over every tensor of the model; stacked layers are summed over pp too.
  """
  def leaf_norms(x, layout):
    x = jnp.square(x.astype(jnp.float32))
    local = jnp.sum(x) if layout.pp_dim is None else jnp.sum(x, axis=tuple(range(1, x.ndim)), keepdims=True)
    return lax.psum(local, layout.axes) if layout.axes else local

  def per_tensor(tree):
    return jax.tree.map(leaf_norms, tree, layouts)

  def total(tree):
    norms, stacked = jax.tree.leaves(per_tensor(tree)), jax.tree.leaves(jax.tree.map(lambda l: l.pp_dim is not None, layouts))
    whole = sum(jnp.sum(n) for n, s in zip(norms, stacked) if not s)
    split = [jnp.sum(n) for n, s in zip(norms, stacked) if s]
    return whole + (lax.psum(sum(split), PP) if split else 0.0)
  return TensorNorms(per_tensor, total)
