"""The training checkpoint: Orbax CheckpointManager, two-stage asynchronous saves, resume.

A checkpoint at step n (WORKDIR/checkpoints/n/) holds three items:

  state   the TrainState (step, fp32 params, optimizer state) as global arrays, written
          by every process for the shards it owns (Orbax / tensorstore, OCDBT)
  data    each process's data iterator state, one JSON file per process (DataStateHandler)
  meta    JSON: the config, the layout the state was saved in (mesh, pipeline stages,
          virtual stages) and the RNG seed, so a restore can check and convert

MegaScale 4.4's two stages are Orbax's asynchronous save: `save` returns once the arrays
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

import jax
import ml_collections
import orbax.checkpoint as ocp

STATE, DATA, META = "state", "data", "meta"


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

  def metadata(self, directory):
    return None

  def finalize(self, directory):
    pass

  def close(self):
    pass


@ocp.args.register_with_handler(DataStateHandler, for_save=True)
@dataclasses.dataclass
class DataStateSave(ocp.args.CheckpointArgs):
  state: dict


@ocp.args.register_with_handler(DataStateHandler, for_restore=True)
@dataclasses.dataclass
class DataStateRestore(ocp.args.CheckpointArgs):
  pass


# --- The manager.

@dataclasses.dataclass
class Restored:
  step: int
  state: Any          # TrainState with the shardings asked for
  data_state: dict
  meta: dict


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
        async_options=ocp.AsyncOptions(post_finalization_callback=self._finalized))
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

  def wait(self) -> None:
    """Blocks until every started save is committed."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()
