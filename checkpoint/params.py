"""Trained parameters to and from a directory (Orbax), for export and the Python API.

The full training checkpoint (optimizer state, data iterator, RNG, async saves) builds on
this package; exported params are a plain pytree that `megajax.init_params` also returns.

A params directory is checked like a checkpoint: its arrays' checksums (integrity.py's
fingerprints) are written in Orbax's step metadata, inside the same atomic commit, and
`load_params` compares what it read with them. Every failure to read or to match is a
CheckpointError with one line naming the directory (TensorStore's own errors span pages).
"""

from __future__ import annotations

import json
import os

from absl import logging
import jax
import orbax.checkpoint as ocp
import tensorstore as ts

from megajax.checkpoint import arrays, integrity
from megajax.checkpoint.integrity import PROGRAMMING_ERRORS, CheckpointError

CHECKSUMS = "megajax_checksums"    # the key in Orbax's custom metadata
STEP_METADATA = "_CHECKPOINT_METADATA"   # Orbax's file of it, in the committed directory


def save_params(directory: str, params) -> str:
  """Writes params and their checksums under `directory` (atomically: Orbax commits a
  temporary directory)."""
  path = os.path.abspath(directory)
  checksums = integrity.checksums(integrity.fingerprints(params))
  with ocp.Checkpointer(arrays.array_tree_handler()) as checkpointer:
    checkpointer.save(path, args=ocp.args.PyTreeSave(params), force=True, custom_metadata={CHECKSUMS: checksums})
  return path


def load_params(directory: str, like=None):
  """Reads params, checked against their checksums; `like` (a pytree of arrays or
  ShapeDtypeStructs) fixes shapes and shardings.

  Without `like`, every array lands whole on this process's first device, whatever mesh and
  process count wrote it. CheckpointError (IntegrityError for a mismatch) when the directory
  cannot be read or is not what was saved.
  """
  path = os.path.abspath(directory)
  try:
    if like is None:      # a reader's whole copy: every stored chunk read first (below)
      _read_every_chunk(path)
    with ocp.StandardCheckpointer() as checkpointer:
      metadata = checkpointer.metadata(path)
      if like is None:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        like = jax.tree.map(lambda meta: jax.ShapeDtypeStruct(meta.shape, meta.dtype, sharding=device),
                            metadata.item_metadata)
      params = checkpointer.restore(path, like)
  except PROGRAMMING_ERRORS:
    raise
  except Exception as error:  # pylint: disable=broad-except  (TensorStore raises a plain Exception)
    raise CheckpointError(f"{path}: unreadable parameters ({type(error).__name__}: "
                          f"{integrity.first_line(error)})") from None
  checksums = _saved_checksums(path)
  if checksums is None:
    logging.warning("%s was saved before parameters carried checksums: read unchecked", path)
  else:
    integrity.verify_arrays(params, checksums, f"parameters {path}")
  return params


def _read_every_chunk(path: str) -> None:
  """Reads every key of the directory's OCDBT store, one at a time: a truncated or missing
  chunk fails here, before Orbax's concurrent restore, whose other reads in flight would
  print a traceback each (asyncio's loop closed under them) after its one error."""
  store = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{path}/"}).result()
  for key in store.list().result():
    store.read(key).result()


def _saved_checksums(path: str) -> dict | None:
  """The checksums in Orbax's step metadata file, read here: Orbax logs a damaged file and goes
  on without it, which would read the arrays unchecked. None: saved before checksums."""
  try:
    with open(os.path.join(path, STEP_METADATA)) as f:
      step_metadata = json.load(f)
  except FileNotFoundError:
    return None
  except (OSError, ValueError) as error:      # ValueError: not JSON, not UTF-8
    raise CheckpointError(f"{path}: unreadable parameters ({STEP_METADATA} is damaged: "
                          f"{integrity.first_line(error)})") from None
  custom = step_metadata.get("custom_metadata") if isinstance(step_metadata, dict) else None
  return (custom or {}).get(CHECKSUMS)


def params_metadata(directory: str):
  """The saved parameters' tree of shapes and dtypes (Orbax metadata), nothing read."""
  try:
    with ocp.StandardCheckpointer() as checkpointer:
      return checkpointer.metadata(os.path.abspath(directory)).item_metadata
  except PROGRAMMING_ERRORS:
    raise
  except Exception as error:  # pylint: disable=broad-except
    raise CheckpointError(f"{os.path.abspath(directory)}: unreadable parameters' metadata "
                          f"({type(error).__name__}: {integrity.first_line(error)})") from None
