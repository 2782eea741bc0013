"""How each parameter (and its optimizer state) is split over the mesh.

Tensor parallelism splits the dimension named heads / kv_heads / mlp / vocab over `tp`
(the logical axes the model declares). ZeRO then splits the fp32 master copy, its
gradient and its optimizer state 1/dp over `dp` along the first dimension that divides
(if that is the tp dimension too, it is split (tp, dp): each tp shard cut in dp pieces).
The first: an all-gather or reduce-scatter over the leading dimension is the array itself,
laid out as it is used (over another one, XLA moves it to a leading one and back: copies),
and the members of a fused matmul operand gathered together are that operand
(megajax.parallel.fused). A leaf with no dimension divisible by dp stays whole on every dp
rank. The collectives that gather and scatter them inside the step: megajax.parallel.zero.

With pipeline parallelism the blocks' parameters are stacked (megajax.parallel.pipeline):
one leaf per parameter with a leading layer axis split over `pp`; LAMB still takes one
trust ratio per layer, as on the single-device model.
"""

from __future__ import annotations

import dataclasses

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import optax

from megajax.model import GPT, logical_axes
from megajax.optim import TensorNorms
from megajax.parallel.mesh import DP, PP, TP

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
  return Layout(tp_dim, candidates[0] if dp > 1 and candidates else None)


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
