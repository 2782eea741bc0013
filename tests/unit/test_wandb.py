"""Weights & Biases as a tracker (observe.wandb_project), offline: the run's local files hold the
same scalars metrics.jsonl gets and the config; a resume continues the same W&B run; a config
naming it without it installed is refused. (That nothing of wandb is imported when it is off:
tests/e2e/test_commands.py's fresh-process import check.)"""

import jax
import pytest

from megajax.config import ConfigError, validate
from megajax.observe.records import METRICS, read_jsonl
from megajax.trainer import train
from tests.support.wandb_files import config as run_config, history


def test_a_run_and_its_resume_log_to_one_wandb_run(tmp_path, tiny_config, monkeypatch):
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  tiny_config.observe.wandb_project = "megajax-tests"
  tiny_config.train.steps, tiny_config.train.log_every, tiny_config.checkpoint.every_steps = 4, 2, 2
  train(tiny_config, str(tmp_path), devices=jax.devices()[:1])
  tiny_config.train.steps = 6                      # resumed from the checkpoint of step 4
  train(tiny_config, str(tmp_path), devices=jax.devices()[:1])
  run_id = (tmp_path / "wandb_run_id").read_text().strip()
  files = sorted((tmp_path / "wandb").glob(f"offline-run-*-{run_id}*/run-{run_id}.wandb"))
  assert len(files) == 2, list((tmp_path / "wandb").iterdir())     # both runs: the same W&B run id
  rows = [row for path in files for row in history(path)]
  logged = {(row["train/step"], key): value for row in rows for key, value in row.items()}
  # Everything metrics.jsonl holds is there, at its step: loss, throughput, goodput, checkpoints.
  records = read_jsonl(str(tmp_path / METRICS))
  for record in records:
    for key, value in record.items():
      if key != "step" and isinstance(value, (int, float)):
        assert logged[(record["step"], key)] == pytest.approx(value), (record["step"], key)
  assert {s for (s, key) in logged if key == "loss"} == {1, 2, 4, 6}
  assert {s for (s, key) in logged if key == "goodput/ratio"} == {1, 2, 4, 6}
  assert {s for (s, key) in logged if key == "ckpt_blocking_s"} == {2, 4, 6}
  assert run_config(files[0])["model"]["hidden_dim"] == tiny_config.model.hidden_dim


@pytest.mark.parametrize("project,problem", [("a/b", "cannot hold"), ("runs", "not installed")])
def test_a_bad_or_missing_wandb_is_refused_before_anything_runs(tiny_config, monkeypatch, project, problem):
  if problem == "not installed":
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
  tiny_config.observe.wandb_project = project
  with pytest.raises(ConfigError, match=f"observe.wandb_project.*{problem}"):
    validate(tiny_config)
