"""Commands that read a workdir (eval, sample, export: launch.run_files, read-only checkpointers)
change nothing in it, since its trainer may be running; a finished run's params/ is checked
like a checkpoint (its checksums), and a damaged one gives way to the latest verified
checkpoint or one line, never a traceback or wrong numbers."""

import os

import jax
import numpy as np
import pytest

from megajax.checkpoint import CheckpointError, TrainingCheckpointer, load_params, save_params
from megajax.checkpoint.integrity import IntegrityError
from megajax.checkpoint.manager import _Unusable
from megajax.launch.run_files import run_params
from tests.support.checkpoints import DAMAGES, PARAMS_DAMAGES, quarantined


def _tree(directory) -> dict:
  """Every file under `directory`: (size, mtime) by path; what a read-only reader leaves alone."""
  return {os.path.join(root, name): (os.stat(os.path.join(root, name)).st_size,
                                     os.stat(os.path.join(root, name)).st_mtime_ns)
          for root, _, files in os.walk(directory) for name in files}


def _save_in_flight(workdir):
  """What Orbax leaves while a save of step 9 is being written: its temporary directory."""
  partial = workdir / "checkpoints" / "9.orbax-checkpoint-tmp-1700000000" / "state"
  partial.mkdir(parents=True)
  (partial / "_METADATA").write_text("{}")
  return partial.parent


def test_a_reader_changes_nothing_while_the_trainer_alone_cleans_up(two_checkpoints, caplog):
  """A read-only checkpointer (eval's, run_params') over a save in flight and a damaged latest
  checkpoint: it reads the previous one and says so, and leaves every file as it was (the
  temporary directory, the damaged checkpoint: no quarantine); it cannot save. The trainer's
  own checkpointer removes the temporary directory and quarantines the damaged one."""
  workdir, config, parallel_step = two_checkpoints
  in_flight = _save_in_flight(workdir)
  DAMAGES["changed_values"][0](workdir / "checkpoints" / "6")
  before = _tree(workdir)
  with TrainingCheckpointer(str(workdir / "checkpoints"), config, read_only=True) as reader:
    restored = reader.restore_latest(parallel_step)
    with pytest.raises(CheckpointError, match="open read-only"):
      reader.save(7, restored.state, {})
  assert restored.step == 3 and _tree(workdir) == before and quarantined(workdir) == []
  assert "left in place: a reader changes nothing" in caplog.text
  with TrainingCheckpointer(str(workdir / "checkpoints"), config) as trainer:
    assert trainer.restore_latest(parallel_step).step == 3
  assert not in_flight.exists() and quarantined(workdir) == ["6-checksum"]


def test_a_checkpoint_its_trainer_removes_while_read_is_passed_over(two_checkpoints, monkeypatch, caplog):
  """checkpoint.keep: the trainer deletes the oldest checkpoint as it commits a new one, maybe
  the one a reader is reading. The reader reads the list again and takes the newest."""
  workdir, config, parallel_step = two_checkpoints
  reader = TrainingCheckpointer(str(workdir / "checkpoints"), config, read_only=True)
  read = reader._restore_checked
  removed = []

  def removed_while_read(parallel_step, step):
    if not removed:                     # the trainer, between the reader's listing and its read
      removed.append(step)
      os.rename(reader.path(step), reader.path(step) + ".gone")
      raise _Unusable(FileNotFoundError(reader.path(step)))
    return read(parallel_step, step)

  monkeypatch.setattr(reader, "_restore_checked", removed_while_read)
  restored = reader.restore_latest(parallel_step)
  reader.close()
  assert removed == [6] and restored.step == 3 and "removed by its trainer while it was read" in caplog.text


def test_a_checkpoint_its_trainer_removes_while_listed_is_listed_again(two_checkpoints, monkeypatch, caplog):
  """Orbax lists the step directories, then reads each one's commit time: the trainer's
  checkpoint.keep may remove one in between (seen in CI: megajax-sample's FileNotFoundError on a
  running job). The reader lists again and restores the newest; a list that never settles is
  one line."""
  from orbax.checkpoint._src.path import step as orbax_step
  workdir, config, parallel_step = two_checkpoints
  commit_timestamp = orbax_step.Metadata.commit_timestamp
  removed = []

  def removed_while_listed(metadata):
    if metadata.step == 3 and not removed:    # the trainer, between Orbax's listing and its stat
      removed.append(metadata.step)
      os.rename(metadata.path, f"{metadata.path}.gone")
    return commit_timestamp.fget(metadata)

  monkeypatch.setattr(orbax_step.Metadata, "commit_timestamp", property(removed_while_listed))
  with TrainingCheckpointer(str(workdir / "checkpoints"), config, read_only=True) as reader:
    assert reader.all_steps() == [6] and reader.restore_latest(parallel_step).step == 6
  assert removed == [3] and "removed while it was listed" in caplog.text

  def never_settles(metadata):
    raise FileNotFoundError(metadata.path)

  monkeypatch.setattr(orbax_step.Metadata, "commit_timestamp", property(never_settles))
  with pytest.raises(CheckpointError, match=r"^the checkpoints in .* changed under each of 5 listings .*try again$"):
    TrainingCheckpointer(str(workdir / "checkpoints"), config, read_only=True)
  with pytest.raises(FileNotFoundError):     # the trainer's own listing: nothing removes steps under it
    TrainingCheckpointer(str(workdir / "checkpoints"), config)


def test_params_carry_checksums_that_every_read_checks(tmp_path):
  params = {"embed": jax.numpy.arange(12.0).reshape(3, 4), "head": {"w": jax.numpy.ones((4, 2))}}
  path = save_params(str(tmp_path / "params"), params)
  np.testing.assert_array_equal(load_params(path)["embed"], params["embed"])
  PARAMS_DAMAGES["changed_values"](tmp_path / "params")
  with pytest.raises(IntegrityError, match=r"^parameters .*params: 1 of 2 arrays differ from their checksums \(embed\)$"):
    load_params(path)


@pytest.mark.parametrize("damage", sorted(PARAMS_DAMAGES))
def test_damaged_params_give_way_to_the_latest_verified_checkpoint(two_checkpoints, damage, caplog):
  """What sample and export read: a finished run's params/ damaged in any way is refused with a
  warning naming it, and the latest checkpoint that passes its checksums read instead; the
  parameters are the run's final ones bit for bit (params/ is the last checkpoint's export)."""
  workdir, config, _ = two_checkpoints
  want = jax.tree.leaves(load_params(str(workdir / "params")))
  PARAMS_DAMAGES[damage](workdir / "params")
  os.utime(workdir / "params")            # newer than the checkpoints, as after a finished run
  params, source = run_params(str(workdir), config)
  assert source == str(workdir / "checkpoints" / "6")
  assert f"{workdir / 'params'}" in caplog.text and "reading the latest checkpoint" in caplog.text
  for a, b in zip(want, jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)


def test_damaged_params_without_a_checkpoint_are_one_line(two_checkpoints):
  workdir, config, _ = two_checkpoints
  PARAMS_DAMAGES["truncated_arrays"](workdir / "params")
  os.rename(workdir / "checkpoints", workdir / "elsewhere")
  with pytest.raises(CheckpointError) as error:
    run_params(str(workdir), config)
  message = str(error.value)
  assert "\n" not in message and message.startswith(f"{workdir / 'params'}: unreadable parameters")
  assert message.endswith("has no checkpoint to read instead: restore params/ from a copy, or train again")
