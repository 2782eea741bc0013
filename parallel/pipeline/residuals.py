"""A chunk's forward split at its residuals, so the pipeline's backward need not rerun it.

`jax.vjp` of a chunk program returns a pullback whose leaves are the residuals: everything
its backward reads (what the model's remat policy saves, and the inputs of recomputed
blocks under "dots" / "full"). The executor's forward slot keeps them until the backward
slot of the same microbatch-chunk, ticks later, rebuilds the pullback from them. Two kinds:

  stashed     depend on the chunk's input activation or the microbatch's tokens: they are
              the forward's work, packed per tick slot as flat unsigned words of their width.
  recomputed  depend only on the weights and the microbatch's metadata (weight slices and
              casts, positions, masks): the backward slot rebuilds them from what it has,
              a pruned copy of the forward (`_prune`) that never touches the activation.

The split is read off the traced forward (a jaxpr): a value is stashed if any chain of
equations leads to it from the activation or the tokens; an equation with a sub-program
(a kernel, a remat) counts as one, so the split errs towards stashing, never towards work.

Inside shard_map values carry the mesh axes they vary over, and a backward must get its
residuals typed as the forward made them: residuals are grouped by those axes and their
element width, one buffer per group (`SplitChunk.words`), each a bit-exact view.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.extend.core import ClosedJaxpr, Literal, jaxpr_as_fun
import jax.numpy as jnp
import numpy as np

from megajax.parallel.mesh import aval_varying_axes, to_varying

# The stash's units: a residual is kept as unsigned words of its own width (a bit-exact view,
# free to make), so a group is (the mesh axes it varies over, the width in bytes).
WORDS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}
ACTIVATION_KEYS = ("inputs",)  # the microbatch fields whose residuals are the forward's work


@dataclasses.dataclass(frozen=True)
class _Leaf:
  index: int                 # position among the pullback's leaves
  shape: tuple
  dtype: np.dtype
  group: tuple               # (mesh axes it varies over (sorted), bytes per element): its buffer
  offset: int = 0            # in words, inside its group's packed vector

  @property
  def words(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64))


def group_dtype(group: tuple):
  """The word type of a residual buffer group."""
  return WORDS[group[1]]


def _group_of(aval) -> tuple:
  dtype = np.dtype(aval.dtype)
  if dtype.itemsize not in WORDS or (dtype.kind not in "fiub" and dtype.name != "bfloat16"):
    raise TypeError(f"a pipeline residual of dtype {dtype} cannot be kept; set parallel.pipeline_recompute=True")
  return tuple(sorted(aval_varying_axes(aval))), dtype.itemsize


def _to_words(x):
  """A residual as a flat vector of unsigned words of its width (bit-exact)."""
  word = WORDS[np.dtype(x.dtype).itemsize]
  if np.dtype(x.dtype) == np.bool_:
    return x.astype(word).reshape(-1)
  return jax.lax.bitcast_convert_type(x, word).reshape(-1)


def _from_words(words, leaf: _Leaf):
  if np.dtype(leaf.dtype) == np.bool_:
    return (words != 0).reshape(leaf.shape)
  return jax.lax.bitcast_convert_type(words.reshape(leaf.shape), leaf.dtype)


def _depends(jaxpr, sources: list[bool]) -> list[bool]:
  """Per outvar of `jaxpr`: does it depend on an invar marked in `sources`?"""
  marked = {v for v, s in zip(jaxpr.invars, sources) if s}
  for eqn in jaxpr.eqns:
    if any(not isinstance(v, Literal) and v in marked for v in eqn.invars):
      marked.update(eqn.outvars)
  return [not isinstance(v, Literal) and v in marked for v in jaxpr.outvars]


def _prune(closed: ClosedJaxpr, keep: list[int]) -> ClosedJaxpr:
  """`closed` computing only outvars `keep`: every equation nothing kept needs is dropped (the
  activation's among them, for a recomputed set). Same invars."""
  jaxpr = closed.jaxpr
  outvars = [jaxpr.outvars[i] for i in keep]
  needed = {v for v in outvars if not isinstance(v, Literal)}
  eqns = []
  for eqn in reversed(jaxpr.eqns):
    if any(v in needed for v in eqn.outvars):
      eqns.append(eqn)
      needed.update(v for v in eqn.invars if not isinstance(v, Literal))
  # The forward's debug info, naming only the outputs kept.
  debug_info = jaxpr.debug_info
  if debug_info is not None and debug_info.result_paths is not None and not callable(debug_info.result_paths):
    debug_info = debug_info._replace(result_paths=tuple(debug_info.result_paths[i] for i in keep))
  pruned = jaxpr.replace(eqns=eqns[::-1], outvars=outvars, debug_info=debug_info,
                         effects=frozenset().union(*(e.effects for e in eqns)) if eqns else frozenset())
  return ClosedJaxpr(pruned, closed.consts)


@dataclasses.dataclass(frozen=True)
class SplitChunk:
  """One chunk program's forward, traced once with the pullback's residuals as outputs."""
  forward_jaxpr: ClosedJaxpr   # (layers, shared, x, mb) -> (out, aux, *residuals), flattened
  recompute_jaxpr: ClosedJaxpr  # the same inputs -> the recomputed residuals
  pullback: jax.tree_util.PyTreeDef
  outputs: jax.tree_util.PyTreeDef   # of (out, aux)
  stashed: tuple               # _Leaf per stashed residual, with its offset in its group
  recomputed: tuple            # pullback leaf index per recomputed residual
  words: dict                  # group (axes, width) -> words this chunk stashes

  @classmethod
  def trace(cls, run, layers, shared, x, mb) -> "SplitChunk":
    """`run(layers, shared, x, mb) -> (out, aux)`: a chunk's forward; the arguments only give
    shapes and types (tracers of the enclosing shard_map: the collectives' axes exist)."""
    boxes = {}

    def with_residuals(layers, shared, x, mb):
      out, pullback, aux = jax.vjp(lambda l, s, x: run(l, s, x, mb), layers, shared, x, has_aux=True)
      leaves, boxes["pullback"] = jax.tree.flatten(pullback)
      outputs, boxes["outputs"] = jax.tree.flatten((out, aux))
      return (*outputs, *leaves)

    closed = jax.make_jaxpr(with_residuals)(layers, shared, x, mb)
    # The sources of the forward's own work: the activation and the microbatch's tokens (not
    # its metadata: positions, segment ids, targets, mask), leaf by leaf in argument order.
    marks = lambda tree, value: jax.tree.map(lambda _: value, tree)
    sources = jax.tree.leaves((marks(layers, False), marks(shared, False), marks(x, True),
                               {key: marks(value, key in ACTIVATION_KEYS) for key, value in mb.items()}))
    n_out = boxes["outputs"].num_leaves
    depends = _depends(closed.jaxpr, sources)[n_out:]
    avals = [v.aval for v in closed.jaxpr.outvars[n_out:]]
    stashed, recomputed, words = [], [], {}
    for i, (dep, aval) in enumerate(zip(depends, avals)):
      if not dep:
        recomputed.append(i)
        continue
      leaf = _Leaf(i, tuple(aval.shape), np.dtype(aval.dtype), _group_of(aval))
      leaf = dataclasses.replace(leaf, offset=words.get(leaf.group, 0))
      stashed.append(leaf)
      words[leaf.group] = leaf.offset + leaf.words
    recompute = _prune(closed, [n_out + i for i in recomputed])
    return cls(closed, recompute, boxes["pullback"], boxes["outputs"], tuple(stashed), tuple(recomputed), words)

  def forward(self, layers, shared, x, mb, words: dict):
    """-> ((out, aux), {group: words [words[group]]}): the forward and its stash,
    each group padded to the executor's buffer width `words`."""
    flat = jaxpr_as_fun(self.forward_jaxpr)(*jax.tree.leaves((layers, shared, x, mb)))
    n_out = self.outputs.num_leaves
    residuals = flat[n_out:]
    packed = {}
    for group, width in words.items():
      parts = [_to_words(residuals[leaf.index]) for leaf in self.stashed if leaf.group == group]
      used = sum(part.shape[0] for part in parts)
      if width > used:
        parts.append(jnp.zeros((width - used,), group_dtype(group)))
      packed[group] = to_varying(jnp.concatenate(parts), group[0])
    return jax.tree.unflatten(self.outputs, flat[:n_out]), packed

  def pullback_from(self, layers, shared, x, mb, packed: dict):
    """The chunk's pullback, rebuilt from its stash `packed` and the recomputed residuals
    (`x` only gives the activation's type: none of the recomputed ones reads it)."""
    residuals = [None] * self.pullback.num_leaves
    for i, value in zip(self.recomputed, jaxpr_as_fun(self.recompute_jaxpr)(*jax.tree.leaves((layers, shared, x, mb)))):
      residuals[i] = value
    for leaf in self.stashed:
      words = jax.lax.slice_in_dim(packed[leaf.group], leaf.offset, leaf.offset + leaf.words)
      residuals[leaf.index] = _from_words(words, leaf)
    return jax.tree.unflatten(self.pullback, residuals)

