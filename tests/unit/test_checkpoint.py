"""Training checkpoints in process: the cadence, retention, the two-stage asynchronous save,
the config's checks, integrity (checksums, digests, quarantine), bad checkpoints and another
model's. (Across kills, preemption and processes: tests/e2e; onto other meshes: tests/integration.)"""

import copy
import errno
import json
import os
import threading
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from megajax.checkpoint import CheckpointError, TrainingCheckpointer, check_compatible, load_params
from megajax.checkpoint.integrity import IntegrityError, checksums, fingerprints, sealed, unsealed
from megajax.checkpoint.manager import _damaged, storage_refused
from megajax.config import ConfigError, validate
from megajax.model import GPT, ModelConfig
from megajax.trainer import train
from tests.support.checkpoints import (DAMAGES, parallel_step_for, quarantined, quarantined_as, restore_latest,
                                       truncate_arrays)
from tests.support.processes import HANG_S   # a hang guard only: each wait ends on its event


def test_retention_keeps_the_last_k_and_every_mth(tmp_path, tiny_config):
  """keep=2, keep_period=4, a save every step for 9 steps: 4 and 8 stay forever, plus the last two."""
  tiny_config.train.steps, tiny_config.checkpoint.every_steps = 9, 1
  tiny_config.checkpoint.keep, tiny_config.checkpoint.keep_period = 2, 4
  train(tiny_config, str(tmp_path), devices=jax.devices()[:1])
  checkpointer = TrainingCheckpointer(str(tmp_path / "checkpoints"), tiny_config)
  assert checkpointer.all_steps() == [4, 8, 9]
  restored = checkpointer.restore(8, parallel_step_for(tiny_config).abstract_inputs()[0])
  assert int(restored.state.step) == 8 and restored.data_state == {"next_index": 8}
  assert restored.meta["layout"] == {"dp": 1, "pp": 1, "tp": 1, "virtual_stages": 1, "num_layers": 2}
  checkpointer.close()


def test_the_async_save_returns_before_the_write_finishes(tmp_path, tiny_config):
  """Stage 1 (device -> host) blocks; stage 2 (host -> storage) runs behind: with a write
  that cannot finish until the test lets it, save() returns, nothing is committed, and the
  commit's time, recorded once it happens, covers the time the write was held."""
  state = parallel_step_for(tiny_config).init_state(jax.random.key(0))
  checkpointer = TrainingCheckpointer(str(tmp_path), tiny_config)
  handler = ocp.PyTreeCheckpointHandler   # the state item's (checkpoint/arrays.py)
  original, storage = handler.async_save, _HeldWrite()

  async def held_async_save(self, *args, **kwargs):
    futures = await original(self, *args, **kwargs)
    return [*(futures or []), storage]

  handler.async_save = held_async_save
  try:
    blocking = checkpointer.save(1, state, {"next_index": 1})
    returned = time.perf_counter()
    assert not os.path.exists(tmp_path / "1")            # not committed yet: only a temporary directory
    assert checkpointer.take_finished() == []
    released = time.perf_counter()                      # the commit comes after this
    storage.release()
    checkpointer.wait()
  finally:
    handler.async_save = original
  (step, total), = checkpointer.take_finished()
  # The save started `blocking` before `returned`, and committed after `released`.
  assert step == 1 and total >= blocking + (released - returned) and total > blocking
  assert checkpointer.latest_step() == 1
  checkpointer.close()


class _HeldWrite:
  """An Orbax commit future that finishes when the test releases it (a slow storage write)."""

  def __init__(self):
    self._released = threading.Event()

  def release(self):
    self._released.set()

  def result(self, timeout=None):
    assert self._released.wait(timeout=HANG_S), "the test never released the write"


@pytest.mark.parametrize("every,due", [(4, [4, 8, 10]), (0, [10])])
def test_the_checkpointer_owns_its_cadence(tmp_path, tiny_config, every, due):
  """Due: every checkpoint.every_steps steps (0: no schedule), the last step, and a preemption."""
  tiny_config.train.steps, tiny_config.checkpoint.every_steps = 10, every
  checkpointer = TrainingCheckpointer(str(tmp_path), tiny_config)
  assert [s for s in range(1, 11) if checkpointer.due(s)] == due
  assert checkpointer.due(3, preempted=True)
  checkpointer.close()


@pytest.mark.parametrize("field,value", [("checkpoint.every_steps", -1), ("checkpoint.keep", 0),
                                         ("debug.fail_at_step", -2)])
def test_checkpoint_fields_are_validated(tiny_config, field, value):
  group, name = field.split(".")
  tiny_config[group][name] = value
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    validate(tiny_config)


# --- Integrity and bad checkpoints.

def test_a_fingerprint_is_the_same_on_any_sharding_and_moves_with_any_change():
  """The checksum of a global array does not depend on the mesh it is computed on (a restore
  onto another mesh checks the save's); one changed element or two swapped ones change it."""
  x = jax.random.normal(jax.random.key(0), (8, 12, 6))
  mesh = jax.make_mesh((2, 4), ("a", "b"), devices=jax.devices()[:8])
  on = lambda *spec: jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec)))
  want = checksums(fingerprints({"x": x}))
  assert all(checksums(fingerprints({"x": y})) == want for y in (on("a", "b"), on(None, "b", "a"), on(("a", "b"))))
  flipped = x.at[3, 4, 5].set(np.float32(np.nextafter(x[3, 4, 5], np.inf)))
  swapped = x.at[0, 0, 0].set(x[0, 0, 1]).at[0, 0, 1].set(x[0, 0, 0])
  assert checksums(fingerprints({"x": flipped})) != want and checksums(fingerprints({"x": swapped})) != want


def test_a_fingerprint_is_the_hash_checkpoints_were_saved_with():
  """Each lane is the sum mod 2**32 of murmur3's finalizer over bits + flat index * multiplier
  + offset (computed here in numpy, row-major): checkpoints saved by an earlier megajax verify."""
  def mix(h):
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)

  x = np.linspace(-3, 3, 4 * 5 * 3, dtype=np.float32).reshape(4, 5, 3)
  bits, index = x.view(np.uint32).astype(np.uint64), np.arange(x.size, dtype=np.uint64).reshape(x.shape)
  saved_lanes = ((0x9E3779B1, 0x85EBCA77), (0x7FEB352D, 0x27D4EB2F))    # (multiplier, offset): the format's
  lanes = [int(mix((bits + index * m + o) & 0xFFFFFFFF).sum() % 2**32) for m, o in saved_lanes]
  assert checksums(fingerprints({"x": jnp.asarray(x)})) == {"x": f"{lanes[0]:08x}{lanes[1]:08x}"}


@pytest.mark.parametrize("damage,restore_mode", [(d, "direct") for d in DAMAGES] + [("changed_values", "broadcast")])
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous(two_checkpoints, damage, restore_mode, caplog):
  """Each damage is caught (changed values by the checksums, an edited meta by its digest), the
  previous checkpoint restored, and the damaged one moved to quarantine/<step>-<reason>."""
  workdir, config, parallel_step = two_checkpoints
  config.checkpoint.restore_mode = restore_mode
  latest = workdir / "checkpoints" / "6"
  damage_fn = DAMAGES[damage][0]
  damage_fn(latest)
  with caplog.at_level("ERROR"):
    restored = restore_latest(workdir, config, parallel_step)
  assert restored.step == 3 and int(restored.state.step) == 3
  assert f"checkpoint {latest} is unreadable" in caplog.text and "falling back" in caplog.text
  assert quarantined_as(workdir, 6, damage) and not latest.exists()


@pytest.mark.parametrize("damage", ["changed_values", "flipped_bytes", "truncated_arrays", "deleted_meta",
                                    "deleted_state_metadata", "deleted_data_state"])
def test_a_finished_run_with_a_damaged_last_checkpoint_is_finished_again(two_checkpoints, damage):
  """The last checkpoint of a finished run damaged, the run relaunched: it resumes from the
  one before, trains to the end again, saves the step again, and exports the uninterrupted
  run's parameters bit for bit (never a damaged state, never 'nothing to do')."""
  workdir, config, _ = two_checkpoints
  want = jax.tree.leaves(load_params(str(workdir / "params")))
  DAMAGES[damage][0](workdir / "checkpoints" / "6")
  result = train(config, str(workdir), devices=jax.devices()[:1])
  assert result.start_step == 3 and [h["step"] for h in result.history][-1] == 6
  assert quarantined_as(workdir, 6, damage)
  for a, b in zip(want, jax.tree.leaves(load_params(str(workdir / "params")))):
    np.testing.assert_array_equal(a, b)
  checkpointer = TrainingCheckpointer(str(workdir / "checkpoints"), config)
  abstract_state = parallel_step_for(config).abstract_inputs()[0]
  assert checkpointer.all_steps() == [3, 6] and int(checkpointer.restore(6, abstract_state).state.step) == 6
  checkpointer.close()


def test_no_readable_checkpoint_is_an_error_naming_them(two_checkpoints):
  """Then nothing is moved aside: it may be this run that cannot read them."""
  workdir, config, parallel_step = two_checkpoints
  for step in (3, 6):
    truncate_arrays(workdir / "checkpoints" / str(step))
  with pytest.raises(CheckpointError, match=r"no readable checkpoint in .*checkpoints/6, .*checkpoints/3 failed"):
    restore_latest(workdir, config, parallel_step)
  assert quarantined(workdir) == []


def test_a_checkpoint_of_another_model_lists_the_fields(two_checkpoints):
  workdir, config, _ = two_checkpoints
  config.model.hidden_dim, config.model.num_layers = 64, 4
  with pytest.raises(CheckpointError, match=r"checkpoint .*checkpoints/6 was saved by a different model: "
                     r"model\.num_layers: checkpoint 2, this run 4; model\.hidden_dim: checkpoint 32, this run 64|"
                     r"model\.hidden_dim: checkpoint 32, this run 64; model\.num_layers: checkpoint 2, this run 4"):
    restore_latest(workdir, config, parallel_step_for(config))


def test_a_checkpoint_of_another_block_family_lists_the_fields(tiny_config):
  """An RMSNorm + SwiGLU checkpoint into a LayerNorm + GeLU model: refused, both fields named;
  one from before model.norm and model.mlp existed is a LayerNorm + GeLU model, and fits."""
  model_of = lambda config: types.SimpleNamespace(model=GPT(ModelConfig.from_config(config.model)))
  llama = copy.deepcopy(tiny_config)
  llama.model.update(norm="rmsnorm", mlp="swiglu")
  meta = {"config": json.loads(llama.to_json())}
  with pytest.raises(CheckpointError, match=r"different model: model\.norm: checkpoint 'rmsnorm', this run "
                     r"'layernorm'; model\.mlp: checkpoint 'swiglu', this run 'gelu'\."):
    check_compatible(meta, tiny_config, model_of(tiny_config), "checkpoints/6")
  before = json.loads(tiny_config.to_json())
  del before["model"]["norm"], before["model"]["mlp"]
  check_compatible({"config": before}, tiny_config, model_of(tiny_config), "checkpoints/6")


def test_digests_refuse_a_changed_file_and_read_one_from_before_digests():
  meta = {"step": 3, "checksums": {"params/w": "00ff"}}
  assert unsealed(sealed(meta), "m", "meta-digest") == meta
  with pytest.raises(IntegrityError, match="digest does not match"):
    unsealed({**sealed(meta), "step": 4}, "m", "meta-digest")
  with pytest.raises(IntegrityError, match="no digest"):
    unsealed(meta, "m", "meta-digest")                     # has checksums: a digest was written, and lost
  with pytest.raises(IntegrityError, match="JSON list"):
    unsealed([1, 2], "m", "meta-digest")
  old = {"step": 3, "config": {}}                          # an earlier megajax's meta: resumes, unchecked
  assert unsealed(old, "m", "meta-digest") == old


def test_only_a_refused_write_is_final_and_only_damage_is_moved_aside():
  """A full or read-only disk fails the run with one line (exit 2, not retried); a timeout or
  network error propagates (the supervisor restarts). A read that may pass (an I/O error, device
  memory) leaves the checkpoint in place; damage moves it aside."""
  assert storage_refused(OSError(errno.ENOSPC, "No space left on device"))
  assert storage_refused(ValueError("FAILED_PRECONDITION: write failed [OS error: No space left on device]"))
  wrapped = RuntimeError("commit failed")
  wrapped.__cause__ = OSError(errno.EROFS, "Read-only file system")
  assert storage_refused(wrapped)
  assert not storage_refused(TimeoutError("Timed out while waiting for async_write_complete barrier"))
  assert _damaged(IntegrityError("checksum", "differs")) and _damaged(FileNotFoundError(errno.ENOENT, "gone"))
  assert _damaged(ValueError("DATA_LOSS: Error reading"))
  assert not _damaged(OSError(errno.EIO, "Input/output error"))
  assert not _damaged(RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 4 GiB"))


def test_checksums_compiled_ahead_are_the_ones_a_restore_checks(tmp_path, tiny_config):
  """compile_checksums (the trainer calls it with the step's compile) gives a save the very
  checksums the restore recomputes, and the save then compiles nothing."""
  parallel_step = parallel_step_for(tiny_config)
  state = parallel_step.init_state(jax.random.key(0))
  checkpointer = TrainingCheckpointer(str(tmp_path), tiny_config)
  checkpointer.compile_checksums(parallel_step.abstract_inputs()[0])
  misses_before = fingerprints._cache_size()
  checkpointer.save(1, state, {"next_index": 1})
  checkpointer.wait()
  assert fingerprints._cache_size() == misses_before       # the jitted path was not traced again
  restored = checkpointer.restore(1, parallel_step.abstract_inputs()[0])   # checks the checksums
  assert restored.meta["checksums"] == checksums(fingerprints(state))
  checkpointer.close()
