"""Restoring a checkpoint saved on one mesh onto another; a fresh state from saved parameters.

A checkpoint holds global arrays, so a change of dp or tp alone is Orbax's business: it
reads each array with the new shardings. What Orbax cannot know is the pipeline layout:
with pp > 1 the blocks are one stacked `layers` tree whose row order depends on (pp,
virtual stages) (`pipeline.stacked_layer_order`), with pp = 1 they are `layer_0`,
`layer_1`, ... So when the saved layout differs from the run's, the state is read in the
saved structure, spread over all devices of the new mesh (no device holds a whole copy),
and converted under jit (saved layout -> the model's -> the run's) straight into the run's
shardings. The optimizer moments are parameter-shaped trees and convert the same way.
"""

from __future__ import annotations

import os

import jax
from jax.sharding import NamedSharding, PartitionSpec

from megajax.checkpoint.integrity import CheckpointError
from megajax.checkpoint.params import load_params, params_metadata
from megajax.model import init_params
from megajax.parallel import ParallelStep, pipeline
from megajax.reference_step import TrainState, fresh_train_state


def pipeline_layout_of(layout: dict) -> tuple[int, int] | None:
  """(stages, virtual stages) of a saved layout, None for the model's own (pp = 1)."""
  return (layout["pp"], layout["virtual_stages"]) if layout["pp"] > 1 else None


def same_structure(saved: dict, current: dict) -> bool:
  return pipeline_layout_of(saved) == pipeline_layout_of(current)


def spread_sharding(shape, mesh) -> NamedSharding:
  """Split the first dimension that divides over every device of the mesh; else replicate."""
  for dim, size in enumerate(shape):
    if size % mesh.size == 0:
      spec = [None] * len(shape)
      spec[dim] = tuple(mesh.axis_names)
      return NamedSharding(mesh, PartitionSpec(*spec))
  return NamedSharding(mesh, PartitionSpec())


def saved_abstract_state(parallel_step: ParallelStep, layout: dict) -> TrainState:
  """The state as it was saved (its layout's structure), spread over the step's mesh."""
  saved = pipeline_layout_of(layout)

  def structure():
    params = init_params(parallel_step.model, jax.random.key(0))
    if saved is not None:
      params = pipeline.to_pipeline_params(params, *saved)
    return fresh_train_state(params, parallel_step.optimizer)

  spread = lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=spread_sharding(s.shape, parallel_step.mesh))
  return jax.tree.map(spread, jax.eval_shape(structure))


def _map_param_trees(fn, tree, params_treedef):
  """fn applied to every subtree shaped like the parameters (the params, Adam's mu and nu)."""
  is_params = lambda node: jax.tree.structure(node) == params_treedef
  return jax.tree.map(lambda node: fn(node) if is_params(node) else node, tree, is_leaf=is_params)


def convert_state(parallel_step: ParallelStep, state: TrainState, layout: dict) -> TrainState:
  """A state read in the saved layout -> this run's layout and shardings."""
  saved = pipeline_layout_of(layout)

  def to_run(params):
    model_params = params if saved is None else pipeline.to_model_params(params, *saved)
    return parallel_step.from_model_params(model_params)

  def convert(state):
    treedef = jax.tree.structure(state.params)
    return TrainState(state.step, to_run(state.params), _map_param_trees(to_run, state.opt_state, treedef))

  return jax.jit(convert, out_shardings=parallel_step.state_shardings)(state)


def initial_state(parallel_step: ParallelStep, directory: str) -> TrainState:
  """A fresh state (step 0, new optimizer moments) from the model parameters `directory` holds
  (save_params' format: another run's WORKDIR/params, megajax-import-hf's): read spread over the
  step's mesh, converted under jit to the run's layout (stacked with pp > 1) and shardings.
  CheckpointError when the directory is unreadable or holds another model's parameters."""
  expected = jax.eval_shape(lambda: init_params(parallel_step.model, jax.random.key(0)))
  if not os.path.isdir(directory):
    raise CheckpointError(f"train.init_params={directory}: no such directory; pass a parameters directory (a run's "
                          "WORKDIR/params, megajax-import-hf's WORKDIR/hf_import/params)")
  saved, problem = None, ""
  try:
    saved = params_metadata(directory)
  except CheckpointError as error:      # params_metadata's one line names the directory already
    problem = f" ({str(error).removeprefix(os.path.abspath(directory) + ': ')})"
  if not saved:
    raise CheckpointError(f"train.init_params={directory}: no saved parameters there{problem}; pass a directory "
                          "megajax.checkpoint.save_params wrote (a run's WORKDIR/params)")
  shapes = lambda tree: {jax.tree_util.keystr(path): tuple(leaf.shape)
                         for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}
  want, have = shapes(expected), shapes(saved)
  for name in sorted(want.keys() | have.keys()):
    if want.get(name) != have.get(name):
      raise CheckpointError(f"train.init_params={directory}: parameter {name} is {have.get(name) or 'missing'} there, "
                            f"this run's model has {want.get(name) or 'no such parameter'}; the model fields must match")
  # Without a pipeline the model's pytree is the state's: read straight into the step's shardings.
  shardings = (parallel_step.state_shardings.params if parallel_step.pipeline is None else
               jax.tree.map(lambda s: spread_sharding(s.shape, parallel_step.mesh), expected))
  like = jax.tree.map(lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), expected,
                      shardings)
  params = load_params(directory, like)

  def fresh(params):
    params = parallel_step.from_model_params(params)
    return fresh_train_state(params, parallel_step.optimizer)

  return jax.jit(fresh, out_shardings=parallel_step.state_shardings)(params)
