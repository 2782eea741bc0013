"""Training checkpoints: exact resume after a crash, preemption, retention, atomicity."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from megajax.checkpoint import TrainingCheckpointer, load_params
from tests.conftest import REPO, child_env, launch_two_processes, run_module

# The default 2x2x2 job (pipeline, tp, ZeRO-2 over dp), short and in fp32.
RUN = ["-m", "megajax.launch.train", "--config=configs/default.py", "--config.train.steps=20",
       "--config.optimizer.warmup_steps=3", "--config.train.log_every=1", "--config.model.compute_dtype=float32",
       "--config.checkpoint.every_steps=5"]


def records(workdir):
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def losses(workdir) -> dict:
  """step -> loss, the last record winning (a resumed run repeats the steps after its checkpoint)."""
  return {r["step"]: r["loss"] for r in records(workdir) if "loss" in r}


def launch(workdir, *overrides, timeout=300):
  return run_module([*RUN, f"--workdir={workdir}", *overrides], timeout=timeout)


def test_exact_resume_after_a_kill(tmp_path):
  """20 steps straight vs killed (SIGKILL) after step 12 and relaunched with the same
  command: the same losses, and bitwise the same parameters."""
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  result = launch(straight)
  assert result.returncode == 0, result.stderr[-3000:]
  crashed = launch(resumed, "--config.debug.fail_at_step=12")
  assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-3000:]
  assert not (resumed / "params").exists()
  relaunched = launch(resumed)
  assert relaunched.returncode == 0, relaunched.stderr[-3000:]
  start = int(relaunched.stderr.split("resumed from ")[1].split(" (step ")[1].split(" ")[0])
  assert start in (5, 10)                    # the latest complete checkpoint when the process died
  want, got = losses(straight), losses(resumed)
  assert sorted(got) == list(range(1, 21))
  assert [got[s] for s in range(start + 1, 21)] == [want[s] for s in range(start + 1, 21)]
  for a, b in zip(jax.tree.leaves(load_params(str(straight / "params"))),
                  jax.tree.leaves(load_params(str(resumed / "params")))):
    np.testing.assert_array_equal(a, b)
  saves = [r for r in records(resumed) if "ckpt_blocking_s" in r or "ckpt_total_s" in r]
  assert {r["step"] for r in saves if "ckpt_total_s" in r} >= {15, 20}


def two_process_launch(workdir, *overrides, timeout=300):
  return launch_two_processes([*RUN, f"--workdir={workdir}", *overrides], timeout)


def test_two_process_job_resumes_after_a_kill(tmp_path):
  """Both processes of a 2-process job die after step 12; the relaunched job resumes from
  the checkpoint both wrote and repeats the steps after it with the losses of before the
  crash. To 1e-6, not bitwise: two straight 2-process runs already differ in the last bits
  (gloo's CPU reductions do not fix their summation order); a wrong restore (fresh
  optimizer moments, another data position) moves the losses by far more."""
  workdir = tmp_path / "run"
  codes, errors = two_process_launch(workdir, "--config.debug.fail_at_step=12")
  assert all(code != 0 for code in codes), errors[0][-2000:]
  before = {r["step"]: r["loss"] for r in records(workdir) if "loss" in r}
  assert max(before) == 12
  codes, errors = two_process_launch(workdir)
  assert codes == [0, 0], errors[0][-2000:] + errors[1][-2000:]
  start = int(errors[0].split("resumed from ")[1].split(" (step ")[1].split(" ")[0])
  assert start in (5, 10)
  after = losses(workdir)
  assert sorted(after) == list(range(1, 21))
  np.testing.assert_allclose([after[s] for s in range(start + 1, 13)], [before[s] for s in range(start + 1, 13)],
                             rtol=1e-6)
  data_files = sorted(os.listdir(workdir / "checkpoints" / "20" / "data"))
  assert [f for f in data_files if f.startswith("process_")] == ["process_0.json", "process_1.json"]


def test_preemption_saves_and_stops(tmp_path):
  """SIGTERM mid-run: the step finishes, a checkpoint is saved, the launcher exits 143; the
  relaunch resumes from that exact step."""
  workdir = tmp_path / "run"
  command = [sys.executable, *RUN, f"--workdir={workdir}", "--config.train.steps=100000",
             "--config.checkpoint.every_steps=0"]
  process = subprocess.Popen(command, cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
  deadline = time.time() + 240
  while time.time() < deadline and len(losses(workdir) if (workdir / "metrics.jsonl").exists() else {}) < 3:
    time.sleep(0.2)
  process.send_signal(signal.SIGTERM)
  _, stderr = process.communicate(timeout=120)
  assert process.returncode == 143, stderr[-3000:]
  assert "preempted at step" in stderr
  step = int(stderr.split("preempted at step ")[1].split(":")[0])
  checkpointer = TrainingCheckpointer(str(workdir / "checkpoints"), _config())
  assert checkpointer.all_steps() == [step]
  checkpointer.close()
  relaunched = launch(workdir, f"--config.train.steps={step + 2}", "--config.checkpoint.every_steps=0")
  assert relaunched.returncode == 0, relaunched.stderr[-3000:]
  assert f"resumed from {workdir / 'checkpoints'}/{step} (step {step} of {step + 2})" in relaunched.stderr
  assert max(losses(workdir)) == step + 2


def _config():
  from megajax.config import default_config
  return default_config()


def test_retention_keeps_the_last_k_and_every_mth(tmp_path, tiny_config):
  """keep=2, keep_period=4, a save every step for 9 steps: 4 and 8 stay forever, plus the last two."""
  from megajax.trainer import train
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
  """Stage 1 (device -> host) blocks; stage 2 (host -> storage) runs behind: with a slow
  write, save() returns long before the commit, whose time is recorded."""
  from megajax.parallel import ParallelPlan, make_mesh
  from megajax.trainer import build_model
  import orbax.checkpoint as ocp
  plan = ParallelPlan.build(tiny_config, build_model(tiny_config), make_mesh(tiny_config, jax.devices()[:1]))
  state = plan.init_state(jax.random.key(0))
  checkpointer = TrainingCheckpointer(str(tmp_path), tiny_config)
  handler = ocp.StandardCheckpointHandler
  original = handler.async_save

  async def slow_async_save(self, *args, **kwargs):
    futures = await original(self, *args, **kwargs)
    return [*(futures or []), _SleepFuture(1.5)]

  handler.async_save = slow_async_save
  try:
    blocking = checkpointer.save(1, state, {"next_index": 1})
    assert not os.path.exists(tmp_path / "1")            # not committed yet: only a temporary directory
    checkpointer.wait()
  finally:
    handler.async_save = original
  (step, total), = checkpointer.take_finished()
  assert step == 1 and total >= 1.5 > blocking
  assert checkpointer.latest_step() == 1
  checkpointer.close()


class _SleepFuture:
  """An Orbax commit future that takes `seconds` (a slow storage write)."""

  def __init__(self, seconds):
    self._done = time.time() + seconds

  def result(self, timeout=None):
    time.sleep(max(0.0, self._done - time.time()))


@pytest.mark.parametrize("field,value", [("checkpoint.every_steps", -1), ("checkpoint.keep", 0),
                                         ("debug.fail_at_step", -2)])
def test_checkpoint_fields_are_validated(tiny_config, field, value):
  from megajax.config import ConfigError, validate
  group, name = field.split(".")
  tiny_config[group][name] = value
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    validate(tiny_config)
