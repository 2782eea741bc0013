"""Training checkpoints in process: the cadence, retention, the two-stage asynchronous save,
the config's checks, bad checkpoints and another model's. (Across kills, preemption and
processes: tests/e2e; onto other meshes: tests/integration.)"""

import os
import threading
import time

import jax
import orbax.checkpoint as ocp
import pytest

from megajax.checkpoint import CheckpointError, TrainingCheckpointer
from megajax.config import ConfigError, validate
from megajax.trainer import train
from tests.support.checkpoints import parallel_step_for, restore_latest, truncate_arrays


def test_retention_keeps_the_last_k_and_every_mth(tmp_path, tiny_config):
  """keep=2, keep_period=4, a save every step for 9 steps: 4 and 8 stay forever, plus the last two."""
  tiny_config.train.steps, tiny_config.checkpoint.every_steps = 9, 1
  tiny_config.checkpoint.keep, tiny_config.checkpoint.keep_period = 2, 4
  train(tiny_config, str(tmp_path), devices=jax.devices()[:1])
  checkpointer = TrainingCheckpointer(str(tmp_path / "checkpoints"), tiny_config)
  assert checkpointer.all_steps() == [4, 8, 9]
  restored = checkpointer.restore(8, None)
  assert int(restored.state["step"]) == 8 and restored.data_state == {"next_index": 8}
  assert restored.meta["layout"] == {"dp": 1, "pp": 1, "tp": 1, "virtual_stages": 1, "num_layers": 2}
  checkpointer.close()


def test_the_async_save_returns_before_the_write_finishes(tmp_path, tiny_config):
  """Stage 1 (device -> host) blocks; stage 2 (host -> storage) runs behind: with a write
  that cannot finish until the test lets it, save() returns, nothing is committed, and the
  commit's time, recorded once it happens, covers the time the write was held."""
  state = parallel_step_for(tiny_config).init_state(jax.random.key(0))
  checkpointer = TrainingCheckpointer(str(tmp_path), tiny_config)
  handler = ocp.StandardCheckpointHandler
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
    assert self._released.wait(timeout=120), "the test never released the write"


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


# --- Bad checkpoints.

@pytest.mark.parametrize("damage", ["truncated_arrays", "garbage_meta"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous(two_checkpoints, damage, caplog):
  workdir, config, parallel_step = two_checkpoints
  latest = workdir / "checkpoints" / "6"
  if damage == "truncated_arrays":
    truncate_arrays(latest)
  else:
    (latest / "meta" / "metadata").write_bytes(os.urandom(64))
  with caplog.at_level("ERROR"):
    restored = restore_latest(workdir, config, parallel_step)
  assert restored.step == 3 and int(restored.state.step) == 3
  assert f"checkpoint {latest} is unreadable" in caplog.text and "falling back" in caplog.text


def test_no_readable_checkpoint_is_an_error_naming_them(two_checkpoints):
  workdir, config, parallel_step = two_checkpoints
  for step in (3, 6):
    truncate_arrays(workdir / "checkpoints" / str(step))
  with pytest.raises(CheckpointError, match=r"no readable checkpoint in .*checkpoints/6, .*checkpoints/3 failed"):
    restore_latest(workdir, config, parallel_step)


def test_a_checkpoint_of_another_model_lists_the_fields(two_checkpoints):
  workdir, config, _ = two_checkpoints
  config.model.hidden_dim, config.model.num_layers = 64, 4
  with pytest.raises(CheckpointError, match=r"checkpoint .*checkpoints/6 was saved by a different model: "
                     r"model\.num_layers: checkpoint 2, this run 4; model\.hidden_dim: checkpoint 32, this run 64|"
                     r"model\.hidden_dim: checkpoint 32, this run 64; model\.num_layers: checkpoint 2, this run 4"):
    restore_latest(workdir, config, parallel_step_for(config))
