"""The non-finite policy end to end in process: a rollback that meets non-finite steps again
goes further back, and stops with one line when there is nowhere further; a run never ends
"done" with its updates skipped to the end. (The skip itself: test_trainer.py; the drill
across processes and the supervisor's record: tests/e2e/test_fault_drills.py.)"""

import jax
import pytest

from megajax.trainer import NonFiniteError, train
from tests.support.checkpoints import quarantined


def _poisoned(config, nonfinite_steps, rollback_after: int = 1, every_steps: int = 1):
  """6 steps: the program two_checkpoints compiled (the schedule depends on train.steps)."""
  config.train.steps, config.checkpoint.every_steps = 6, every_steps
  config.train.nonfinite_rollback_after = rollback_after
  config.debug.nonfinite_steps = ",".join(map(str, nonfinite_steps))
  return config


def _saved(workdir) -> list[int]:
  return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def test_a_rollback_to_a_checkpoint_that_fails_again_goes_further_back(tmp_path, tiny_config, caplog):
  """A save every step, a rollback at every skip. Step 3 skipped: back to checkpoint 2. Step 4
  skipped too, no update applied since: not 2 again but 1; steps 5, 6 train on it, so the
  final state holds 1 + 2 updates. No checkpoint was written inside the skips."""
  config = _poisoned(tiny_config, (3, 4))
  with caplog.at_level("WARNING"):
    result = train(config, str(tmp_path), devices=jax.devices()[:1])
  assert "rolled back to the state of step 2 (rollback 1)" in caplog.text
  assert "rolled back to the state of step 1 (rollback 2)" in caplog.text
  assert int(result.state.step) == 3 and result.history[-1]["step"] == 6
  assert _saved(tmp_path) == [2, 5, 6] and quarantined(tmp_path) == []     # (keep=3: 1 retired)


def test_with_nowhere_further_back_the_run_stops_in_one_line_naming_the_states(tmp_path, tiny_config):
  """Every step from 2 on is non-finite: back to checkpoint 1, then the initial state, then a
  NonFiniteError naming both (the launcher's one line, exit 2); nothing exported."""
  config = _poisoned(tiny_config, range(2, 7))
  with pytest.raises(NonFiniteError) as error:
    train(config, str(tmp_path), devices=jax.devices()[:1])
  message = str(error.value)
  assert "\n" not in message and message.startswith("step 4: every update was skipped after rolling back to ")
  assert f"checkpoint {tmp_path / 'checkpoints' / '1'}, the initial state (steps 2-4:" in message
  assert _saved(tmp_path) == [1] and not (tmp_path / "params").exists()


@pytest.mark.parametrize("nonfinite_steps,which", [
    (range(1, 7), "every update of this run was skipped (steps 1-6:"),
    ((5, 6), "every update from step 5 to the end was skipped (steps 5-6:")])
def test_a_run_whose_updates_are_skipped_to_the_end_is_not_done(tmp_path, tiny_config, nonfinite_steps, which):
  """Skipped to the end (fewer in a row than a rollback needs; a learning rate of inf is the
  same): an error, not "done"; no checkpoint of the skipped steps, no parameters."""
  config = _poisoned(tiny_config, nonfinite_steps, rollback_after=7, every_steps=3)
  with pytest.raises(NonFiniteError, match=which.replace("(", r"\(")):
    train(config, str(tmp_path), devices=jax.devices()[:1])
  assert _saved(tmp_path) == ([] if 1 in nonfinite_steps else [3]) and not (tmp_path / "params").exists()
