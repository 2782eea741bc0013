"""The training checkpoint: Orbax CheckpointManager, two-stage asynchronous saves, resume.

A checkpoint at step n (WORKDIR/checkpoints/n/) holds three items:

  state   the TrainState (step, fp32 params, optimizer state) as global arrays, written
          by every process for the shards it owns (Orbax / tensorstore, OCDBT)
  data    each process's data iterator state, one JSON file per process (DataStateHandler)
  meta    JSON: the config, the layout the state was saved in (mesh, pipeline stages,
          virtual stages) and the RNG seed, so a restore can check and convert

The checkpointer owns its cadence (`due`): every checkpoint.every_steps steps, the last step
and a preemption. MegaScale 4.4's two stages are Orbax's asynchronous save: `save` returns once the arrays
are copied device -> host (stage 1, the only time the step loop waits: `ckpt_blocking_s`);
the write host -> storage runs in a background thread (stage 2), and the finalization
callback records `ckpt_total_s`. Atomicity is Orbax's: items are written under a temporary
directory that is renamed into place only when every process has finished, so a crash at
any moment leaves either a complete checkpoint or none; `latest_step` sees only complete
ones. Nothing is pickled.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from typing import Any

from absl import logging
import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from megajax.checkpoint import reshard
from megajax.model import GPT, ModelConfig, init_params
from megajax.parallel import ParallelStep
from megajax.parallel.mesh import DP

STATE, DATA, META = "state", "data", "meta"


class CheckpointError(Exception):
  """A checkpoint that cannot be used: unreadable, or saved by a different model."""


# --- The per-process data state item.

class DataStateHandler(ocp.CheckpointHandler):
  """Each process writes its own data iterator state (JSON) as process_<i>.json.

  grain's own handler keys the files by process count too and calls the grain iterator
  directly; ours reads the DevicePrefetcher's state (the batches the step consumed, not the
  ones prefetched), and since that state is the global batch index, a restore with another
  process count can read process 0's file.
  """

  def save(self, directory, args: "DataStateSave"):
    path = os.path.join(os.fspath(directory), f"process_{jax.process_index()}.json")
    with open(path, "w") as f:
      json.dump({"process_count": jax.process_count(), "state": args.state}, f)

  def restore(self, directory, args: "DataStateRestore" = None):
    directory = os.fspath(directory)
    own = os.path.join(directory, f"process_{jax.process_index()}.json")
    path = own if os.path.exists(own) else os.path.join(directory, "process_0.json")
    with open(path) as f:
      return json.load(f)["state"]


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


def layout_of(config: ml_collections.ConfigDict) -> dict:
  """What the saved arrays' layout depends on (a restore converts when it differs)."""
  p = config.parallel
  return {"dp": p.dp, "pp": p.pp, "tp": p.tp, "virtual_stages": p.virtual_stages,
          "num_layers": config.model.num_layers}


class TrainingCheckpointer:
  """Saves and restores training checkpoints under `directory` (WORKDIR/checkpoints)."""

  def __init__(self, directory: str, config: ml_collections.ConfigDict):
    c = config.checkpoint
    self.directory = os.path.abspath(directory)
    self._config = config
    self._lock = threading.Lock()
    self._pending: dict[int, float] = {}    # step -> save start (perf_counter), until finalized
    self.finished: list[tuple[int, float]] = []   # (step, ckpt_total_s), in finalization order
    options = ocp.CheckpointManagerOptions(
        max_to_keep=c.keep, keep_period=c.keep_period or None, create=True,
        enable_async_checkpointing=c.async_save, cleanup_tmp_directories=True,
        async_options=ocp.AsyncOptions(post_finalization_callback=self._finalized) if c.async_save else None)
    self._manager = ocp.CheckpointManager(
        self.directory, options=options,
        item_handlers={STATE: ocp.StandardCheckpointHandler(), DATA: DataStateHandler(),
                       META: ocp.JsonCheckpointHandler()})

  def _finalized(self):
    """Orbax's background thread, after a save is committed: stage 2 is over."""
    now = time.perf_counter()
    with self._lock:
      for step, start in sorted(self._pending.items()):
        self.finished.append((step, now - start))
      self._pending.clear()

  def due(self, step: int, preempted: bool = False) -> bool:
    """Whether the state after `step` is to be saved: every checkpoint.every_steps steps (0:
    never on a schedule), at train.steps, and when the job is preempted."""
    every = self._config.checkpoint.every_steps
    return preempted or step == self._config.train.steps or bool(every and step % every == 0)

  def save(self, step: int, state, data_state: dict) -> float:
    """Starts saving; returns the seconds the caller waited (stage 1, device -> host)."""
    start = time.perf_counter()
    with self._lock:
      self._pending[step] = start
    meta = {"step": step, "config": json.loads(self._config.to_json()), "layout": layout_of(self._config),
            "seed": self._config.train.seed, "process_count": jax.process_count()}
    self._manager.save(step, args=ocp.args.Composite(**{
        STATE: ocp.args.StandardSave(state), DATA: DataStateSave(data_state), META: ocp.args.JsonSave(meta)}),
        force=True)
    blocking = time.perf_counter() - start
    if not self._config.checkpoint.async_save:
      self._finalized()
    return blocking

  def take_finished(self) -> list[tuple[int, float]]:
    """(step, ckpt_total_s) of the saves committed since the last call."""
    with self._lock:
      finished, self.finished = self.finished, []
    return finished

  def latest_step(self) -> int | None:
    self._manager.reload()
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    self._manager.reload()
    return list(self._manager.all_steps())

  def restore(self, step: int, abstract_state) -> Restored:
    """The checkpoint at `step` onto `abstract_state`'s shapes and shardings."""
    restored = self._manager.restore(step, args=ocp.args.Composite(**{
        STATE: ocp.args.StandardRestore(abstract_state), DATA: DataStateRestore(), META: ocp.args.JsonRestore()}))
    return Restored(step, restored[STATE], restored[DATA], restored[META])

  def read_meta(self, step: int) -> dict:
    return self._manager.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]

  def path(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def restore_latest(self, parallel_step: ParallelStep) -> Restored | None:
    """The latest readable checkpoint, onto the 3D step's mesh and layout; None if there is none.

    An unreadable one (truncated, corrupted) is reported and the previous complete one
    tried; one saved by a different model raises CheckpointError naming the differences.
    """
    unreadable = []
    for step in sorted(self.all_steps(), reverse=True):
      try:
        meta = self.read_meta(step)
      except _PROGRAMMING_ERRORS:
        raise
      except Exception as error:  # pylint: disable=broad-except  (any read failure: try the previous one)
        meta, failure = None, error
      if _all_processes_agree(meta is not None):
        check_compatible(meta, self._config, parallel_step, self.path(step))
        try:
          restored = self._restore_onto(parallel_step, step, meta)
        except _PROGRAMMING_ERRORS:
          raise
        except Exception as error:  # pylint: disable=broad-except
          restored, failure = None, error
        if _all_processes_agree(restored is not None):
          return restored
      elif meta is not None:
        failure = CheckpointError("another process could not read it")
      logging.error("checkpoint %s is unreadable (%s: %s); falling back to the previous complete one",
                    self.path(step), type(failure).__name__, str(failure).splitlines()[0][:300] if str(failure) else "")
      unreadable.append(self.path(step))
    if unreadable:
      raise CheckpointError(f"no readable checkpoint in {self.directory}: {', '.join(unreadable)} failed to restore; "
                            "move them aside to start fresh, or point --workdir elsewhere")
    return None

  def _restore_onto(self, parallel_step: ParallelStep, step: int, meta: dict) -> Restored:
    before = _storage_bytes_read()
    restored = self._restore_state(parallel_step, step, meta)
    after = _storage_bytes_read()
    restored.bytes_read = None if before is None else after - before
    logging.info("restoring %s (%s): this process read %s bytes from storage", self.path(step),
                 self._config.checkpoint.restore_mode, restored.bytes_read)
    return restored

  def _restore_state(self, parallel_step: ParallelStep, step: int, meta: dict) -> Restored:
    current = layout_of(self._config)
    if reshard.same_structure(meta["layout"], current):   # Orbax reshards over dp and tp by itself
      if self._config.checkpoint.restore_mode == "broadcast":
        return self._broadcast_restore(parallel_step, step)
      return self.restore(step, parallel_step.abstract_inputs()[0])
    logging.info("checkpoint %s was saved with pp=%d, virtual_stages=%d; converting to pp=%d, virtual_stages=%d",
                 self.path(step), meta["layout"]["pp"], meta["layout"]["virtual_stages"], current["pp"],
                 current["virtual_stages"])
    restored = self.restore(step, reshard.saved_abstract_state(parallel_step, meta["layout"]))
    state = reshard.convert_state(parallel_step, restored.state, meta["layout"])
    return dataclasses.replace(restored, state=state)

  def _broadcast_restore(self, parallel_step: ParallelStep, step: int) -> Restored:
    """MegaScale 4.4's restore: the devices of data-parallel replica 0 read the state from
    storage, the other replicas receive it over the interconnect (Orbax's
    SingleReplicaArrayHandler, in chunks of at most `broadcast_memory_limit_mib`). Each
    replica then keeps its own ZeRO shards (a local slice: no more traffic)."""
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
    state = jax.jit(lambda state: state, out_shardings=parallel_step.state_shardings)(state)
    rest = self._manager.restore(step, args=ocp.args.Composite(**{DATA: DataStateRestore(),
                                                                   META: ocp.args.JsonRestore()}))
    return Restored(step, state, rest[DATA], rest[META])

  def wait(self) -> None:
    """Blocks until every started save is committed."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()


# Bugs, not damaged files: these propagate instead of triggering the fallback.
_PROGRAMMING_ERRORS = (AttributeError, NameError, TypeError, NotImplementedError)


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


def _differences(saved: dict, config: ml_collections.ConfigDict) -> list[str]:
  """'model.hidden_dim: checkpoint 64, this run 128' for each model field (and the optimizer) that differs."""
  now = json.loads(config.to_json())
  lines = [f"model.{k}: checkpoint {saved['model'].get(k)!r}, this run {v!r}"
           for k, v in now["model"].items() if saved["model"].get(k) != v]
  if saved["optimizer"]["name"] != now["optimizer"]["name"]:
    lines.append(f"optimizer.name: checkpoint {saved['optimizer']['name']!r}, this run {now['optimizer']['name']!r}")
  return lines


def check_compatible(meta: dict, config: ml_collections.ConfigDict, parallel_step: ParallelStep,
                     path: str) -> None:
  """Raises CheckpointError when the checkpoint's parameters or optimizer state cannot fit this
  run's model; other differing model fields (window, dtypes, kernels) are only logged."""
  differences = _differences(meta["config"], config)
  if not differences:
    return
  shapes = lambda model: jax.eval_shape(lambda: init_params(model, jax.random.key(0)))
  saved_model = GPT(ModelConfig.from_config(ml_collections.ConfigDict(meta["config"]["model"])))
  saved, now = shapes(saved_model), shapes(parallel_step.model)
  same = (jax.tree.structure(saved) == jax.tree.structure(now)
          and all(a.shape == b.shape and a.dtype == b.dtype for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(now)))
          and meta["config"]["optimizer"]["name"] == config.optimizer.name)
  if not same:
    raise CheckpointError(f"checkpoint {path} was saved by a different model: {'; '.join(differences)}. "
                          "Relaunch with the checkpoint's values, or use a new --workdir")
  logging.warning("checkpoint %s: these fields differ but the shapes fit, restoring: %s", path, "; ".join(differences))
