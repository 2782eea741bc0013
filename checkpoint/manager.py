"""The training checkpoint: Orbax CheckpointManager, two-stage asynchronous saves, resume.

A checkpoint at step n (WORKDIR/checkpoints/n/) holds three items:

  state   the TrainState (step, fp32 params, optimizer state) as global arrays, written
          by every process for the shards it owns (Orbax / tensorstore, OCDBT)
  data    each process's data iterator state, one JSON file per process (DataStateHandler)
  meta    JSON: the config, the layout the state was saved in (mesh, pipeline stages,
          virtual stages) and the RNG seed, so a restore can check and convert; the state's
          array checksums; its own digest (integrity.py)

The checkpointer owns its cadence (`due`): every checkpoint.every_steps steps, the last step
and a preemption. MegaScale 4.4's two stages are Orbax's asynchronous save: `save` returns once the arrays
are copied device -> host (stage 1, the only time the step loop waits: `ckpt_blocking_s`);
the write host -> storage runs in a background thread (stage 2), and the finalization
callback records `ckpt_total_s`. Atomicity is Orbax's: items are written under a temporary
directory that is renamed into place only when every process has finished, so a crash at
any moment leaves either a complete checkpoint or none; `latest_step` sees only complete
ones. Nothing is pickled.

A restore checks what it read against the checksums and digests (integrity.py). One that
fails (unreadable, or not what was saved) is moved aside to quarantine/<step>-<reason> once a
readable older one is found, so the run resumes from that one and can save the step again.

A reader of a workdir (megajax-eval, -sample, -export-hf: `read_only=True`) changes nothing in
it, since its trainer may be running: no removal of Orbax's temporary directories (a save in
flight), no quarantine, no directory created. It reads the newest committed checkpoint that
passes its checks; one its trainer removes while it is listed or read (checkpoint.keep) is passed
over.
Only the trainer, which holds WORKDIR/lock (trainer/workdir.py), cleans and moves.
"""

from __future__ import annotations

import dataclasses
import errno
import glob
import itertools
import json
import os
import shutil
import threading
import time
from typing import Any

from absl import logging
import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from megajax.checkpoint import arrays, integrity, reshard
from megajax.checkpoint.integrity import (PROGRAMMING_ERRORS, CheckpointError, IntegrityError, MetaHandler, MetaRestore,
                                          MetaSave, first_line)
from megajax.config import default_config
from megajax.model import GPT, ModelConfig, init_params
from megajax.parallel import ParallelStep
from megajax.parallel.mesh import DP
from megajax.sections import RunConfig

STATE, DATA, META = "state", "data", "meta"
QUARANTINE = "quarantine"      # WORKDIR/checkpoints/quarantine/<step>-<reason>: what failed to restore
_LISTINGS = 5     # a reader's listings of the steps while its trainer removes them, at most (_listed)
_SETTLE_S, _REMOVE_S = 1.0, 30.0   # a failed save's leftovers: gone this long, removed for this long at most


# --- The per-process data state item.

class DataStateHandler(ocp.CheckpointHandler):
  """Each process writes its own data iterator state (JSON) as process_<i>.json.

  grain's own handler keys the files by process count too and calls the grain iterator
  directly; ours reads the DevicePrefetcher's state (the batches the step consumed, not the
  ones prefetched), and since that state is the global batch index, a restore with another
  process count can read process 0's file. Each file carries its own digest.
  """

  def save(self, directory, args: "DataStateSave"):
    path = os.path.join(os.fspath(directory), f"process_{jax.process_index()}.json")
    with open(path, "w") as f:
      json.dump(integrity.sealed({"process_count": jax.process_count(), "state": args.state}), f)

  def restore(self, directory, args: "DataStateRestore" = None):
    directory = os.fspath(directory)
    own = os.path.join(directory, f"process_{jax.process_index()}.json")
    path = own if os.path.exists(own) else os.path.join(directory, "process_0.json")
    with open(path) as f:
      return integrity.unsealed(json.load(f), path, "data-digest")["state"]


@ocp.args.register_with_handler(DataStateHandler, for_save=True)
@dataclasses.dataclass
class DataStateSave(ocp.args.CheckpointArgs):
  state: dict


@ocp.args.register_with_handler(DataStateHandler, for_restore=True)
@dataclasses.dataclass
class DataStateRestore(ocp.args.CheckpointArgs):
  """Nothing to pass: the handler picks this process's file (or process 0's)."""


# --- The manager.

@dataclasses.dataclass
class Restored:
  step: int
  state: Any          # TrainState with the shardings asked for
  data_state: dict
  meta: dict
  bytes_read: int | None = None   # what this process read from storage for the state (Linux)


def layout_of(config) -> dict:
  """What the saved arrays' layout depends on (a restore converts when it differs); `config`:
  a RunConfig or a ConfigDict (its parallel section and model.num_layers are read)."""
  p = config.parallel
  return {"dp": p.dp, "pp": p.pp, "tp": p.tp, "virtual_stages": p.virtual_stages,
          "num_layers": config.model.num_layers}


class TrainingCheckpointer:
  """Saves and restores training checkpoints under `directory` (WORKDIR/checkpoints).

  `checksums` (default: checkpoint.checksums) False saves without array checksums (restores
  then check only the digests): what the checkpoint benchmark measures them against.
  `read_only`: a reader's (the module docstring): it cannot save, and touches no file. `config`:
  the run's (a RunConfig, or a ConfigDict resolved here): its checkpoint section, the steps and
  seed, the layout, and its record, which every checkpoint keeps."""

  def __init__(self, directory: str, config: RunConfig | ml_collections.ConfigDict, checksums: bool | None = None,
               read_only: bool = False):
    self._config = RunConfig.of(config)
    c = self._config.checkpoint
    self.directory = os.path.abspath(directory)
    self.read_only = read_only
    self._checksums = c.checksums if checksums is None else checksums
    self._fingerprint_fn = None     # integrity.fingerprints compiled for the state (compile_checksums)
    self._lock = threading.Lock()
    self._pending: dict[int, float] = {}    # step -> save start (perf_counter), until finalized
    self._failed: set[int] = set()          # steps whose save failed (process 0 removes what they left)
    self.finished: list[tuple[int, float]] = []   # (step, ckpt_total_s), in finalization order
    if read_only:     # what Orbax's read_only would reset, unset here (it warns for each)
      options = ocp.CheckpointManagerOptions(read_only=True, create=False, enable_async_checkpointing=False)
    else:             # the trainer, under its workdir lock: it alone removes a crashed save's leftovers
      options = ocp.CheckpointManagerOptions(
          max_to_keep=c.keep, keep_period=c.keep_period or None, create=True,
          enable_async_checkpointing=c.async_save, cleanup_tmp_directories=True,
          async_options=ocp.AsyncOptions(post_finalization_callback=self._finalized) if c.async_save else None)
    self._manager = self._listed(lambda: ocp.CheckpointManager(
        self.directory, options=options,
        item_handlers={STATE: arrays.array_tree_handler(), DATA: DataStateHandler(),
                       META: MetaHandler()}))

  def _listed(self, list_steps):
    """list_steps() (Orbax listing the committed steps: its constructor, `reload`), listed again
    when a step vanished under it. Orbax finds the step directories, then reads each one's
    commit time; a reader's trainer removes its oldest checkpoint as it commits a new one
    (checkpoint.keep), and one removed between the two is a FileNotFoundError. The trainer
    removes one per save, so a second listing a moment later finds the list settled."""
    for attempt in itertools.count(1):
      try:
        return list_steps()
      except FileNotFoundError as error:
        if not self.read_only:
          raise       # the trainer alone removes steps: it never races itself
        if attempt == _LISTINGS:
          raise CheckpointError(f"the checkpoints in {self.directory} changed under each of {_LISTINGS} listings "
                                f"({first_line(error)}): is a trainer saving there every moment? try again") from None
        logging.warning("a checkpoint in %s was removed while it was listed (%s); listing again",
                        self.directory, first_line(error))

  def _finalized(self):
    """Orbax's background thread, after a save is committed: stage 2 is over."""
    now = time.perf_counter()
    with self._lock:
      for step, start in sorted(self._pending.items()):
        self.finished.append((step, now - start))
      self._pending.clear()

  def compile_checksums(self, abstract_state) -> None:
    """Compiles the checksums' program for states like `abstract_state` (ShapeDtypeStructs with
    shardings) now, with the step: else the first save compiles it while the step waits."""
    if self._checksums:
      self._fingerprint_fn = integrity.fingerprints.lower(abstract_state).compile()

  def due(self, step: int, preempted: bool = False) -> bool:
    """Whether the state after `step` is to be saved: every checkpoint.every_steps steps (0:
    never on a schedule), at train.steps, and when the job is preempted."""
    every = self._config.checkpoint.every_steps
    return preempted or step == self._config.train.steps or bool(every and step % every == 0)

  def save(self, step: int, state, data_state: dict) -> float:
    """Starts saving; returns the seconds the caller waited (the previous save's commit, if it
    is still going, then stage 1, device -> host). CheckpointError when this save, or the one
    before it, failed."""
    if self.read_only:
      raise CheckpointError(f"{self.directory} is open read-only (a reader's): it does not save")
    start = time.perf_counter()
    self.wait(step)     # Orbax's save would wait for the previous one too; here a failure names its step
    with self._lock:
      self._pending[step] = start
    meta = {"step": step, "config": self._config.record, "layout": layout_of(self._config),
            "seed": self._config.train.seed, "process_count": jax.process_count()}
    # The state's checksums: dispatched once Orbax has copied the state out (dispatched before,
    # they would hold up that copy), fetched by the meta's write in the background (integrity.py).
    checksums = integrity.PendingChecksums(state, self._fingerprint_fn) if self._checksums else None
    if checksums and not self._config.checkpoint.async_save:
      checksums.dispatch()          # the synchronous write waits for them inside Orbax's save
    try:
      self._manager.save(step, args=ocp.args.Composite(**{
          STATE: ocp.args.PyTreeSave(state), DATA: DataStateSave(data_state), META: MetaSave(meta, checksums)}),
          force=True)
    except PROGRAMMING_ERRORS:
      raise
    except Exception as error:  # pylint: disable=broad-except  (a full disk, a refused write: one line)
      if not storage_refused(error):
        raise                       # a transient fault (a timeout, the network): a restart may pass it
      raise self._save_failed(error, step, step) from error
    finally:
      if checksums:
        checksums.dispatch()        # (once; also when the save failed: the meta's writer waits for it)
    blocking = time.perf_counter() - start
    if not self._config.checkpoint.async_save:
      self._finalized()
    return blocking

  def check_for_errors(self, step: int | None = None) -> None:
    """Raises CheckpointError once a save started earlier has failed in the background (a disk
    that filled): the loop calls it every step (`step`, the one just done), so the failure is
    reported at the next step, not at the next save. Cheap: Orbax's in-progress flag. A
    committed save leaves _pending (the post-finalization callback) before Orbax clears the
    flag, so a pending step with the flag down is a save that failed. One process only: in a
    job, each process's flag falls at its own moment, and a process that stopped at another
    step than its peers would leave them waiting in the next step's collectives; there a
    failure surfaces at the next save (or the end), where every process waits for it."""
    if jax.process_count() > 1:
      return
    with self._lock:
      pending = bool(self._pending)
    if pending and not self._manager.is_saving_in_progress():
      self.wait(step)         # nothing in flight: returns at once, raising the failure

  def take_finished(self) -> list[tuple[int, float]]:
    """(step, ckpt_total_s) of the saves committed since the last call."""
    with self._lock:
      finished, self.finished = self.finished, []
    return finished

  def latest_step(self) -> int | None:
    self._listed(self._manager.reload)
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    self._listed(self._manager.reload)
    return list(self._manager.all_steps())

  def restore(self, step: int, abstract_state) -> Restored:
    """The checkpoint at `step` onto `abstract_state`'s shapes and shardings, checked against
    its checksums and digests (IntegrityError when it is not what was saved)."""
    restored = self._read(step, abstract_state)
    integrity.verify_state(restored.state, restored.meta, self.path(step))
    return restored

  def _read(self, step: int, abstract_state) -> Restored:
    """The checkpoint at `step` as read (the digests checked, the checksums not yet)."""
    restored = self._manager.restore(step, args=ocp.args.Composite(**{
        STATE: arrays.restore_args(abstract_state), DATA: DataStateRestore(), META: MetaRestore()}))
    return Restored(step, restored[STATE], restored[DATA], restored[META])

  def read_meta(self, step: int) -> dict:
    return self._manager.restore(step, args=ocp.args.Composite(**{META: MetaRestore()}))[META]

  def path(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def restore_latest(self, parallel_step: ParallelStep, before: int | None = None) -> Restored | None:
    """The latest readable checkpoint (older than step `before`, if given), onto the 3D step's
    mesh and layout; None if there is none.

    An unreadable one (truncated, corrupted, not what was saved) is reported and the previous
    complete one tried; once one restores, the unreadable ones are moved to quarantine/ (so the
    run can save their steps again). None restoring is a CheckpointError naming them, and they
    stay where they are. One saved by a different model raises CheckpointError naming the
    differences.
    """
    unreadable = {}     # step -> the failure that made it so
    for step in self._newest_first(before, unreadable):
      try:
        restored = self._restore_checked(parallel_step, step)
      except _Unusable as unusable:
        failure = unusable.cause
        if self.read_only and not os.path.exists(self.path(step)):
          logging.warning("checkpoint %s was removed by its trainer while it was read (checkpoint.keep); "
                          "reading the newest one again", self.path(step))
          continue
        logging.error("checkpoint %s is unreadable (%s: %s); falling back to the previous complete one",
                      self.path(step), type(failure).__name__, first_line(failure))
        unreadable[step] = failure
        continue
      if self.read_only:     # a reader moves nothing: the trainer quarantines at its next restore
        for bad in unreadable:
          logging.warning("checkpoint %s left in place: a reader changes nothing in a workdir", self.path(bad))
        return restored
      for bad, failure in unreadable.items():
        if _damaged(failure):
          self._quarantine(bad, failure.reason if isinstance(failure, IntegrityError) else "unreadable")
        else:                       # not moved: a later restore may read it
          logging.warning("checkpoint %s left in place: its read failed with %s, which may pass", self.path(bad),
                          type(failure).__name__)
      return restored
    if unreadable:
      raise CheckpointError(f"no readable checkpoint in {self.directory}: "
                            f"{', '.join(self.path(step) for step in unreadable)} failed to restore; "
                            f"move them aside (e.g. to {os.path.join(self.directory, QUARANTINE)}/) to start fresh, "
                            "or point --workdir elsewhere")
    return None

  def _newest_first(self, before: int | None, unreadable: dict):
    """The committed steps (older than `before`), newest first, not yet found unreadable. The
    list is read again after each step tried: a reader's trainer may have committed a newer
    one or removed an older one meanwhile."""
    tried = set()
    while True:
      steps = [step for step in sorted(self.all_steps(), reverse=True)
               if (before is None or step < before) and step not in tried and step not in unreadable]
      if not steps:
        return
      tried.add(steps[0])
      yield steps[0]

  def _quarantine(self, step: int, reason: str) -> None:
    """Moves checkpoint `step` to quarantine/<step>-<reason> (never deletes: a person may want
    it): process 0 moves, after every process agreed it is unreadable; then every process's
    Orbax manager forgets the step, so that it can be saved again."""
    def move_aside():
      if jax.process_index() != 0:
        return
      os.makedirs(os.path.join(self.directory, QUARANTINE), exist_ok=True)
      target = os.path.join(self.directory, QUARANTINE, f"{step}-{reason}")
      for again in itertools.count(2):      # the same step may fail again in a later run
        if not os.path.exists(target):
          break
        target = os.path.join(self.directory, QUARANTINE, f"{step}-{reason}-{again}")
      os.rename(self.path(step), target)
      logging.error("checkpoint %s moved to %s", self.path(step), target)
    try:
      _agreed(move_aside)     # every process learns whether process 0 could move it
    except _Unusable as unusable:
      raise CheckpointError(f"checkpoint {self.path(step)} is unreadable ({reason}) and could not be moved to "
                            f"{os.path.join(self.directory, QUARANTINE)}/: {unusable.cause}; move it aside by hand "
                            "and relaunch") from None
    self._manager.reload()

  def _restore_checked(self, parallel_step: ParallelStep, step: int) -> Restored:
    """Checkpoint `step` read, checked against its checksums, then converted onto the 3D step's
    layout and shardings; _Unusable when it cannot be. Every process takes each phase's outcome
    together (_agreed): the check and the conversion are collectives, which a process that
    failed to read must not leave the others waiting in."""
    meta = _agreed(lambda: self.read_meta(step))
    check_compatible(meta, self._config, parallel_step, self.path(step))
    before = _storage_bytes_read()
    restored, convert = _agreed(lambda: self._read_onto(parallel_step, step, meta))
    after = _storage_bytes_read()
    # As saved: a checkpoint of another pipeline layout is checked before its conversion.
    _agreed(lambda: integrity.verify_state(restored.state, restored.meta, self.path(step)))
    restored = dataclasses.replace(restored, state=convert(restored.state),
                                   bytes_read=None if before is None else after - before)
    logging.info("restoring %s (%s): this process read %s bytes from storage", self.path(step),
                 self._config.checkpoint.restore_mode, restored.bytes_read)
    return restored

  def _read_onto(self, parallel_step: ParallelStep, step: int, meta: dict):
    """(the checkpoint as read, unchecked; the conversion of its state onto the 3D step)."""
    current = layout_of(self._config)
    if reshard.same_structure(meta["layout"], current):   # Orbax reshards over dp and tp by itself
      if self._config.checkpoint.restore_mode == "broadcast":
        to_shards = jax.jit(lambda state: state, out_shardings=parallel_step.state_shardings)
        return self._broadcast_read(parallel_step, step), to_shards
      return self._read(step, parallel_step.abstract_inputs()[0]), lambda state: state
    logging.info("checkpoint %s was saved with pp=%d, virtual_stages=%d; converting to pp=%d, virtual_stages=%d",
                 self.path(step), meta["layout"]["pp"], meta["layout"]["virtual_stages"], current["pp"],
                 current["virtual_stages"])
    return (self._read(step, reshard.saved_abstract_state(parallel_step, meta["layout"])),
            lambda state: reshard.convert_state(parallel_step, state, meta["layout"]))

  def _broadcast_read(self, parallel_step: ParallelStep, step: int) -> Restored:
    """MegaScale 4.4's restore: the devices of data-parallel replica 0 read the state from
    storage, the other replicas receive it over the interconnect (Orbax's
    SingleReplicaArrayHandler, in chunks of at most `broadcast_memory_limit_mib`). Each
    replica then keeps its own ZeRO shards (a local slice, _read_onto's conversion: no more
    traffic). Checked like any restore: a fingerprint does not depend on the shardings."""
    from orbax.checkpoint import type_handlers
    abstract = parallel_step.abstract_inputs()[0]
    mesh = parallel_step.mesh

    def whole_over_dp(sharding):
      spec = [tuple(a for a in (axes if isinstance(axes, tuple) else (axes,)) if a != DP) or None
              for axes in sharding.spec]
      return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))

    restore_args = jax.tree.map(lambda a: type_handlers.SingleReplicaArrayRestoreArgs(
        sharding=whole_over_dp(a.sharding), global_shape=a.shape, dtype=a.dtype), abstract)
    handler = type_handlers.SingleReplicaArrayHandler(
        replica_axis_index=mesh.axis_names.index(DP), primary_replica_id=0,
        broadcast_memory_limit_bytes=self._config.checkpoint.broadcast_memory_limit_mib * 2**20)
    registry = type_handlers.create_type_handler_registry((jax.Array, handler))
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(type_handler_registry=registry)) as checkpointer:
      state = checkpointer.restore(os.path.join(self.path(step), STATE),
                                   args=ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args))
    rest = self._manager.restore(step, args=ocp.args.Composite(**{DATA: DataStateRestore(), META: MetaRestore()}))
    return Restored(step, state, rest[DATA], rest[META])

  def wait(self, step: int | None = None) -> None:
    """Blocks until every started save is committed; CheckpointError when one failed."""
    try:
      self._manager.wait_until_finished()
    except PROGRAMMING_ERRORS:
      raise
    except Exception as error:  # pylint: disable=broad-except
      with self._lock:
        failed = max(self._pending, default=None)
      if not storage_refused(error):
        with self._lock:
          self._pending.clear()
        raise                       # a transient fault: the supervisor restarts from the last checkpoint
      raise self._save_failed(error, failed, step) from error
    with self._lock:                # committed (Orbax calls _finalized on process 0 alone)
      self._pending.clear()

  def close(self) -> None:
    try:
      self.wait()
    finally:
      self._manager.close()
      self._remove_partial_saves()    # what a failed save's stragglers wrote since

  def _remove_partial_saves(self) -> None:
    """Orbax's temporary directories of the saves that failed, removed until each stays gone
    for _SETTLE_S (_REMOVE_S at most). Orbax reports a save's first failed write while the
    others are still in flight, and tensorstore makes the directories it writes into again."""
    patterns = [os.path.join(self.directory, f"{step}.orbax-checkpoint-tmp*") for step in self._failed]
    deadline = time.monotonic() + _REMOVE_S
    while patterns:
      for partial in (found for pattern in patterns for found in glob.glob(pattern)):
        shutil.rmtree(partial, ignore_errors=True)
      time.sleep(_SETTLE_S)
      if not any(glob.glob(pattern) for pattern in patterns) or time.monotonic() > deadline:
        return

  def __enter__(self) -> "TrainingCheckpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _save_failed(self, error: Exception, failed: int | None, now: int | None) -> CheckpointError:
    """The one line for the save of step `failed` that failed (found after step `now`): where it
    was going, why, the free space, and the checkpoint a relaunch resumes from. Process 0
    removes what it left (Orbax's temporary directory; its disk space back), so only committed
    checkpoints remain."""
    with self._lock:
      self._pending.clear()
    if failed is not None and jax.process_index() == 0:
      self._failed.add(failed)
      self._remove_partial_saves()
    kept = self.latest_step()
    why = str(error).splitlines()[0] if str(error) else type(error).__name__
    return CheckpointError(
        f"saving checkpoint {self.path(failed) if failed is not None else 'in ' + self.directory} failed"
        f"{f' (found after step {now})' if now is not None else ''}: {why}; {free_space(self.directory)}; "
        + (f"the last committed checkpoint, {self.path(kept)}, is kept: a relaunch resumes from it" if kept is not None
           else "no checkpoint was committed before it"))


# A save the storage refused: what a restart would meet again (one line, exit 2, not retried).
# Anything else (a timeout, a network error, a barrier a slow host missed) propagates: retried.
_REFUSED_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM)


def storage_refused(error: BaseException) -> bool:
  """Whether `error` (or one it came from) is the storage refusing the write: full, over quota,
  read-only, not allowed. Tensorstore reports the OS error in its message only."""
  words = tuple(os.strerror(code) for code in _REFUSED_ERRNOS)
  while error is not None:
    if isinstance(error, OSError) and error.errno in _REFUSED_ERRNOS:
      return True
    if any(word in str(error) for word in words):
      return True
    error = error.__cause__ or error.__context__
  return False


def free_space(path: str) -> str:
  """'1.2 GiB free of 40 GiB on <path>', of the filesystem holding `path` (or its nearest
  existing parent)."""
  while not os.path.exists(path) and os.path.dirname(path) != path:
    path = os.path.dirname(path)
  usage = shutil.disk_usage(path)
  return f"{_size(usage.free)} free of {_size(usage.total)} on {path}"


def _size(count: int) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if count < 1024:
      return f"{count:.1f} {unit}" if unit != "B" else f"{count} B"
    count /= 1024
  return f"{count:.1f} TiB"


def _storage_bytes_read() -> int | None:
  """Bytes this process has read through read() calls (Linux /proc/self/io rchar), None elsewhere."""
  try:
    with open("/proc/self/io") as f:
      return int(next(line for line in f if line.startswith("rchar:")).split()[1])
  except (OSError, StopIteration):
    return None


def _all_processes_agree(ok: bool) -> bool:
  """True when `ok` on every process (all must restore the same step, or none)."""
  if jax.process_count() == 1:
    return ok
  from jax.experimental import multihost_utils
  return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


class _Unusable(Exception):
  """A checkpoint some process could not read or check; `cause` is this process's error."""

  def __init__(self, cause: Exception):
    super().__init__(str(cause))
    self.cause = cause


def _damaged(failure: BaseException) -> bool:
  """Whether a failed read says the checkpoint itself is bad (moved aside), rather than a fault
  that may pass (left in place): an I/O error of the storage other than a missing file, or the
  devices' memory running out."""
  if isinstance(failure, IntegrityError):
    return True
  if isinstance(failure, OSError) and failure.errno not in (errno.ENOENT, errno.ENOTDIR, errno.EISDIR, None):
    return False
  return not str(failure).startswith("RESOURCE_EXHAUSTED")


def _agreed(read):
  """read()'s result once it has succeeded on every process; else _Unusable."""
  try:
    result, failure = read(), None
  except PROGRAMMING_ERRORS:
    raise
  except Exception as error:  # pylint: disable=broad-except  (any read failure: try the previous one)
    result, failure = None, error
  if not _all_processes_agree(failure is None):
    raise _Unusable(failure or CheckpointError("another process could not read it"))
  return result


def _saved_model(saved: dict) -> dict:
  """The checkpoint's model fields over today's defaults: a field added since (model.norm,
  model.mlp) has its default, which is what every model before it was."""
  return {**default_config().model.to_dict(), **saved["model"]}


def _differences(saved: dict, now: dict) -> list[str]:
  """'model.hidden_dim: checkpoint 64, this run 128' for each model field (and the optimizer)
  that differs; `now`: this run's record (RunConfig.record)."""
  saved_model = _saved_model(saved)
  lines = [f"model.{k}: checkpoint {saved_model.get(k)!r}, this run {v!r}"
           for k, v in now["model"].items() if saved_model.get(k) != v]
  if saved["optimizer"]["name"] != now["optimizer"]["name"]:
    lines.append(f"optimizer.name: checkpoint {saved['optimizer']['name']!r}, this run {now['optimizer']['name']!r}")
  return lines


def check_compatible(meta: dict, config: RunConfig | ml_collections.ConfigDict, parallel_step: ParallelStep,
                     path: str) -> None:
  """Raises CheckpointError when the checkpoint's parameters or optimizer state cannot fit this
  run's model; other differing model fields (window, dtypes, kernels) are only logged."""
  now = RunConfig.of(config).record
  differences = _differences(meta["config"], now)
  if not differences:
    return
  shapes = lambda model: jax.eval_shape(lambda: init_params(model, jax.random.key(0)))
  saved_model = GPT(ModelConfig.from_config(ml_collections.ConfigDict(_saved_model(meta["config"]))))
  saved, now = shapes(saved_model), shapes(parallel_step.model)
  same = (jax.tree.structure(saved) == jax.tree.structure(now)
          and all(a.shape == b.shape and a.dtype == b.dtype for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(now)))
          and meta["config"]["optimizer"]["name"] == now["optimizer"]["name"])
  if not same:
    raise CheckpointError(f"checkpoint {path} was saved by a different model: {'; '.join(differences)}. "
                          "Relaunch with the checkpoint's values, or use a new --workdir")
  logging.warning("checkpoint %s: these fields differ but the shapes fit, restoring: %s", path, "; ".join(differences))
