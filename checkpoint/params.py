"""Trained parameters to and from a directory (Orbax), for export and the Python API.

The full training checkpoint (optimizer state, data iterator, RNG, async saves) builds on
this package; exported params are a plain pytree that `megajax.init_params` also returns.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp


def save_params(directory: str, params) -> str:
  """Writes params under `directory` (atomically: Orbax commits a temporary directory)."""
  path = os.path.abspath(directory)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path, params, force=True)
  return path


def load_params(directory: str, like=None):
  """Reads params; `like` (a pytree of arrays or ShapeDtypeStructs) fixes shapes and shardings.

  Without `like`, every array lands whole on this process's first device, whatever mesh and
  process count wrote it.
  """
  path = os.path.abspath(directory)
  with ocp.StandardCheckpointer() as checkpointer:
    if like is None:
      device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
      like = jax.tree.map(lambda meta: jax.ShapeDtypeStruct(meta.shape, meta.dtype, sharding=device),
                          checkpointer.metadata(path).item_metadata)
    return checkpointer.restore(path, like)


def params_metadata(directory: str):
  """The saved parameters' tree of shapes and dtypes (Orbax metadata), nothing read."""
  with ocp.StandardCheckpointer() as checkpointer:
    return checkpointer.metadata(os.path.abspath(directory)).item_metadata
