"""How the checkpoints and the parameter export write arrays with Orbax.

Each array's shards are written once, by the devices of replica 0 (Orbax's default on GPU, here
on every platform). Orbax's replica-parallel writes (its default on CPU and TPU) split each
replicated array among its replicas instead: a slicing program per array shape and replica,
compiled at a process's first save and run at each (measured on CPU, the default job's 4-layer
model: the first checkpoint's blocking time 1.6 s -> 0.13 s, later ones 0.15 -> 0.07 s, the
parameter export 6.4 -> 3.6 s; `bench checkpoint`'s 1.88 GiB state on dp=2 x tp=4: the step
waits 0.84 -> 0.33 s, the background commit, one writer per shard, 12.6 -> 13.1 s). The format
is Orbax's PyTree checkpoint either way; the arrays are plain (no PRNG key arrays, so no key
metadata store); host arrays and scalars have Orbax's default handlers.
"""

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import type_handlers


def array_tree_handler() -> ocp.PyTreeCheckpointHandler:
  """The Orbax handler for a pytree of jax.Arrays (a TrainState, exported params)."""
  registry = type_handlers.create_type_handler_registry(
      (jax.Array, type_handlers.ArrayHandler(use_replica_parallel=False)),
      (np.ndarray, type_handlers.NumpyHandler()),     # host arrays (imported weights)
      (np.number, type_handlers.ScalarHandler()), (int, type_handlers.ScalarHandler()),
      (float, type_handlers.ScalarHandler()))
  return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


def restore_args(abstract_tree):
  """`ocp.args.PyTreeRestore` onto `abstract_tree`'s shapes, dtypes and shardings."""
  return ocp.args.PyTreeRestore(item=abstract_tree,
                                restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_tree))
