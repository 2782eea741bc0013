"""What a checkpoint's bytes must be: array checksums, digests of the JSON items, their check.

A read that succeeds is not a read that is right: a flipped byte inside an array file reads
back as a different number, and a finished run would export it. So every checkpoint carries

  checksums  per array of the state, a 64-bit fingerprint of its bits (`fingerprints`),
             computed on device by one jitted function over the global arrays and stored in
             the meta item; a restore recomputes them from what it read and compares
  digests    the meta item and each data state file carry the SHA-256 of their own canonical
             JSON (`digest`), so a garbled or edited one is caught

A fingerprint is a sum, modulo 2**32, of a mixing of each element's bits with its flat index
in the global array. Integer sums do not depend on their order, so the value is the same
whatever the mesh, the shardings or the process count the array is computed on (a restore
onto another mesh checks the checksums the save wrote). Every single-element change moves the
sum (the mixing is a bijection), the index makes swapped elements count, and two lanes with
different constants make a chance match about 2**-64.

Saving: the fingerprints are dispatched once Orbax's save has copied the state to the host,
and computed while the write and the next steps go on; `MetaHandler` writes the meta in
Orbax's background thread once they are on the host (`PendingChecksums`). The step waits for
the dispatch alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading

from absl import logging
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

META_FILE = "metadata"     # Orbax's JsonCheckpointHandler's name for it, kept


# Bugs, not damaged files: these propagate instead of being read as damage (a fallback, one line).
PROGRAMMING_ERRORS = (AttributeError, NameError, TypeError, NotImplementedError)


class CheckpointError(Exception):
  """A checkpoint that cannot be used: unreadable, or saved by a different model."""


class IntegrityError(CheckpointError):
  """What was read is not what was saved; `reason` names which check failed (for the
  quarantine's directory name)."""

  def __init__(self, reason: str, message: str):
    super().__init__(message)
    self.reason = reason


# --- Digests of JSON.

def digest(value) -> str:
  """SHA-256 of the canonical JSON of `value` (sorted keys, no spaces)."""
  return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def sealed(value: dict) -> dict:
  """`value` with its own digest under "digest"."""
  return {**value, "digest": digest(value)}


def unsealed(value, what: str, reason: str) -> dict:
  """`value` without its digest, which must match; else IntegrityError(reason). A file of the
  format before digests (no "digest" and, for a meta, no "checksums") is read unchecked, with
  a warning: a workdir of an earlier megajax resumes."""
  if not isinstance(value, dict):
    raise IntegrityError(reason, f"{what} holds a JSON {type(value).__name__}, not an object")
  value = dict(value)
  stored = value.pop("digest", None)
  if stored is None and "checksums" not in value:
    logging.warning("%s was saved before checkpoints carried digests: read unchecked", what)
    return value
  if stored != digest(value):
    raise IntegrityError(reason, f"{what}: its digest does not match its contents"
                         if stored else f"{what} has no digest (damaged)")
  return value


# --- Array fingerprints, on device.

# Per lane: an odd multiplier of the flat index (distinct positions, distinct terms) and an offset.
_LANES = ((0x9E3779B1, 0x85EBCA77), (0x7FEB352D, 0x27D4EB2F))
_MULTIPLIERS, _OFFSETS = (np.array(column, np.uint32) for column in zip(*_LANES))


def _mix(h):
  """murmur3's 32-bit finalizer: a bijection of uint32 in which every input bit moves every output bit."""
  h = h ^ (h >> 16)
  h = h * np.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * np.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _bits(x) -> jax.Array:
  """Each element's bits as uint32: narrower types widened, 64-bit ones folded."""
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  if x.dtype.itemsize == 8:
    halves = lax.bitcast_convert_type(x, jnp.uint32)
    return _mix(halves[..., 0]) ^ halves[..., 1]
  unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
  return lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _flat_index(shape) -> jax.Array:
  """Each element's row-major index in the global array, modulo 2**32 (iotas: no reshape)."""
  index, stride = jnp.zeros(shape, jnp.uint32), 1
  for dim in reversed(range(len(shape))):
    index = index + lax.broadcasted_iota(jnp.uint32, shape, dim) * np.uint32(stride % 2**32)
    stride *= shape[dim]
  return index


def _fingerprint(x) -> jax.Array:
  """uint32[2]: lane i is the sum (mod 2**32) of _mix(bits + index * multiplier_i + offset_i).
  Both lanes in one reduction over a leading lane axis: one kernel per array, not two (the
  program compiles in half the time: 57 arrays 0.46 -> 0.21 s on CPU; same sums, same bits)."""
  bits, index = _bits(x), _flat_index(x.shape)
  lanes = (len(_LANES),) + (1,) * x.ndim
  hashed = _mix(bits[None] + index[None] * _MULTIPLIERS.reshape(lanes) + _OFFSETS.reshape(lanes))
  return jnp.sum(hashed, axis=tuple(range(1, x.ndim + 1)), dtype=jnp.uint32)


# One program per tree structure and shardings; the result is two uint32 per array, replicated.
fingerprints = jax.jit(lambda tree: jax.tree.map(_fingerprint, tree))


def checksums(fingerprinted) -> dict[str, str]:
  """`fingerprints(tree)`'s result -> {"params/layer_0/...": 16 hex digits}, on the host (waits).
  The names are the arrays' paths, the same for a TrainState and the dict Orbax reads back."""
  fetched = jax.device_get(fingerprinted)
  return {jax.tree_util.keystr(path, simple=True, separator="/"): f"{int(lanes[0]):08x}{int(lanes[1]):08x}"
          for path, lanes in jax.tree_util.tree_leaves_with_path(fetched)}


def verify_state(state, meta: dict, path: str) -> None:
  """Raises IntegrityError when the arrays read differ from the checksums the save stored."""
  if meta.get("checksums") is not None:      # None: saved with checkpoint.checksums=False
    verify_arrays(state, meta["checksums"], f"checkpoint {path}")


def verify_arrays(tree, want: dict, what: str) -> None:
  """Raises IntegrityError naming `what` when `tree`'s arrays differ from the checksums `want`."""
  got = checksums(fingerprints(tree))
  wrong = sorted(name for name in want.keys() | got.keys() if want.get(name) != got.get(name))
  if wrong:
    raise IntegrityError("checksum", f"{what}: {len(wrong)} of {len(want)} arrays differ from their "
                         f"checksums ({', '.join(wrong[:3])}{', ...' if len(wrong) > 3 else ''})")


def first_line(error: BaseException, limit: int = 300) -> str:
  """An error's first line, cut at `limit` characters (TensorStore's messages span pages)."""
  text = str(error).strip()
  return text.splitlines()[0][:limit] if text else type(error).__name__


class PendingChecksums:
  """A state's checksums between the save and the meta's write: the saver dispatches the
  fingerprints (once Orbax has copied the state to the host), the writer, in Orbax's
  background thread, waits for them and fetches them. `fingerprint_fn`: `fingerprints`, or
  its program compiled ahead of time for the state's shapes and shardings (the trainer's: a
  first save that compiled it would hold the step for the compile)."""

  def __init__(self, state, fingerprint_fn=None):
    self._state, self._fingerprints = state, None
    self._fingerprint_fn = fingerprint_fn or fingerprints
    self._dispatched = threading.Event()

  def dispatch(self) -> None:
    """Starts computing them on the devices (once; returns without waiting for them)."""
    if self._dispatched.is_set():
      return
    try:
      self._fingerprints = self._fingerprint_fn(self._state)
    finally:
      self._state = None                    # the step may donate its buffers from here on
      self._dispatched.set()

  def result(self) -> dict[str, str]:
    self._dispatched.wait()
    if self._fingerprints is None:
      raise CheckpointError("the state's checksums could not be computed (see the save's error)")
    return checksums(self._fingerprints)


# --- The meta item: JSON, sealed, written once the checksums are on the host.

class MetaHandler(ocp.AsyncCheckpointHandler):
  """The meta item (process 0 writes it): the caller's dict, the state's checksums, a digest.

  Asynchronously, the write runs in Orbax's background commit (with the arrays' own write),
  where it waits for the fingerprints the save dispatched; the step loop never waits for them."""

  async def async_save(self, directory, args: "MetaSave"):
    async def write():     # runs in the commit's own thread: waiting here blocks nothing else
      self._write(directory, args)
    return [ocp.future.CommitFutureAwaitingContractedSignals(write(), name="megajax_meta_save")]

  def save(self, directory, args: "MetaSave"):
    self._write(directory, args)

  def _write(self, directory, args: "MetaSave") -> None:
    if jax.process_index() != 0:
      return
    meta = {**args.meta, "checksums": None if args.checksums is None else args.checksums.result()}
    with open(os.path.join(os.fspath(directory), META_FILE), "w") as f:
      json.dump(sealed(meta), f)

  def restore(self, directory, args: "MetaRestore" = None) -> dict:
    path = os.path.join(os.fspath(directory), META_FILE)
    with open(path) as f:
      return unsealed(json.load(f), path, "meta-digest")


@ocp.args.register_with_handler(MetaHandler, for_save=True)
@dataclasses.dataclass
class MetaSave(ocp.args.CheckpointArgs):
  meta: dict
  checksums: PendingChecksums | None = None     # None: saved without checksums


@ocp.args.register_with_handler(MetaHandler, for_restore=True)
@dataclasses.dataclass
class MetaRestore(ocp.args.CheckpointArgs):
  """Nothing to pass: the handler reads and checks the one file."""
