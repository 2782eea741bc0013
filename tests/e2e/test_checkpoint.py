"""Training checkpoints across processes: exact resume after a kill, preemption, kills during
saves, a mismatched checkpoint and a run whose every update is skipped through the launcher,
a 2-process job's resume and broadcast restore."""

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np

from megajax.checkpoint import TrainingCheckpointer, load_params
from tests.support import REPO, SMALL_MESH, config_flags
from tests.support.checkpoints import parallel_step_for, run_config
from tests.support.processes import (HANG_S, SHORT_DEFAULT_JOB, SHORT_JOB, child_env, launch_two_processes, run_module,
                                     short_default_job, wait_until)
from tests.support.records import metrics


# The default 2x2x2 job (pipeline, tp, ZeRO-2 over dp), short and in fp32, checkpoints every 3
# steps, at a quarter of its width (its uninterrupted run is made once for this file and
# test_launcher.py); at full width (SHORT_JOB) where a test measures bytes read or times saves.
RUN = SHORT_DEFAULT_JOB


def losses(workdir) -> dict:
  """step -> loss, the last record winning (a resumed run repeats the steps after its checkpoint)."""
  return {r["step"]: r["loss"] for r in metrics(workdir) if "loss" in r}


def launch(workdir, *overrides):
  return run_module([*RUN, f"--workdir={workdir}", *overrides])


def test_exact_resume_after_a_kill(tmp_path, tmp_path_factory):
  """12 steps straight vs killed (SIGKILL) after step 8 and relaunched with the same
  command: the same losses, and bitwise the same parameters."""
  straight, resumed = short_default_job(tmp_path_factory), tmp_path / "resumed"
  crashed = launch(resumed, "--config.debug.fail_at_step=8")
  assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-3000:]
  assert not (resumed / "params").exists()
  relaunched = launch(resumed)
  assert relaunched.returncode == 0, relaunched.stderr[-3000:]
  start = int(relaunched.stderr.split("resumed from ")[1].split(" (step ")[1].split(" ")[0])
  assert start in (3, 6)                     # the latest complete checkpoint when the process died
  want, got = losses(straight), losses(resumed)
  assert sorted(got) == list(range(1, 13))
  assert [got[s] for s in range(start + 1, 13)] == [want[s] for s in range(start + 1, 13)]
  for a, b in zip(jax.tree.leaves(load_params(str(straight / "params"))),
                  jax.tree.leaves(load_params(str(resumed / "params")))):
    np.testing.assert_array_equal(a, b)
  saves = [r for r in metrics(resumed) if "ckpt_blocking_s" in r or "ckpt_total_s" in r]
  assert {r["step"] for r in saves if "ckpt_total_s" in r} >= {9, 12}


def two_process_launch(workdir, *overrides):
  return launch_two_processes([*SHORT_JOB, f"--workdir={workdir}", *overrides])


SMALL_MESH_FLAGS = config_flags(SMALL_MESH)


def _start_endless_run(workdir, *overrides):
  """The small-mesh run with train.steps=100000 (one compiled program for the tests below);
  its stderr goes to WORKDIR.stderr (a pipe nobody reads would fill and stall it). Optimized
  (XLA's default -O2): its steps are short next to its saves, so that a kill at a random moment
  can land inside a save."""
  log = open(f"{workdir}.stderr", "w")
  process = subprocess.Popen([sys.executable, *SHORT_JOB, f"--workdir={workdir}", "--config.train.steps=100000",
                              *SMALL_MESH_FLAGS, *overrides], cwd=REPO, env=child_env(optimized=True),
                             stdout=subprocess.DEVNULL, stderr=log)
  log.close()
  return process


def test_preemption_saves_and_stops(tmp_path):
  """SIGTERM mid-run: the step finishes, a checkpoint is saved, the launcher exits 143; a
  relaunch would resume from that exact step and batch."""
  workdir = tmp_path / "run"
  process = _start_endless_run(workdir, "--config.checkpoint.every_steps=0")
  wait_until(lambda: len(losses(workdir) if (workdir / "metrics.jsonl").exists() else {}) >= 3, "step 3",
             process, poll_s=0.2)
  process.send_signal(signal.SIGTERM)
  process.wait(timeout=HANG_S)
  stderr = open(f"{workdir}.stderr").read()
  assert process.returncode == 143, stderr[-3000:]
  assert "preempted at step" in stderr
  step = int(stderr.split("preempted at step ")[1].split(":")[0])
  config = run_config(workdir)
  checkpointer = TrainingCheckpointer(str(workdir / "checkpoints"), config)
  assert checkpointer.all_steps() == [step]
  restored = checkpointer.restore_latest(parallel_step_for(config))
  checkpointer.close()
  assert restored.step == step == max(losses(workdir)) and restored.data_state == {"next_index": step}


def test_the_launcher_reports_a_mismatched_checkpoint_in_one_line(two_checkpoints):
  """The tiny model's checkpoint under configs/default.py's model: one line, exit 2, before
  any compile."""
  workdir, _, _ = two_checkpoints
  result = launch(workdir, *SMALL_MESH_FLAGS)
  assert result.returncode == 2
  assert "checkpoint error: checkpoint" in result.stderr and "model.vocab_size: checkpoint 64, this run 256" in result.stderr
  assert "Traceback" not in result.stderr


def test_a_run_whose_every_update_is_skipped_exits_2_in_one_line(tmp_path):
  """Every batch non-finite (as with a learning rate of inf): the run rolls back to the initial
  state, meets the same again, and megajax-train ends with one line and exit code 2 (the
  supervisor does not retry it); no checkpoint, no parameters, no "done"."""
  workdir = tmp_path / "run"
  result = launch(workdir, f"--config.debug.nonfinite_steps={','.join(map(str, range(1, 13)))}")
  assert result.returncode == 2, result.stderr[-3000:]
  line, = [line for line in result.stderr.splitlines() if line.startswith("megajax-train: ")]
  assert line.startswith("megajax-train: non-finite error: step 6: every update was skipped after rolling back to "
                         "the initial state (steps 1-6:"), line
  assert "Traceback" not in result.stderr and "done: step" not in result.stderr
  assert not (workdir / "params").exists() and not any(p.name.isdigit() for p in (workdir / "checkpoints").iterdir())


def test_killing_during_saves_never_leaves_a_broken_latest_checkpoint(tmp_path):
  """A save every step, SIGKILL at random moments (3 trials): the latest checkpoint Orbax
  reports complete always restores, without falling back."""
  rng, interrupted = random.Random(0), 0
  for trial in range(3):
    workdir = tmp_path / f"trial{trial}"
    process = _start_endless_run(workdir, "--config.checkpoint.every_steps=1", "--config.checkpoint.keep=2")
    wait_until((workdir / "checkpoints" / "2").exists, "checkpoint 2", process)
    time.sleep(rng.uniform(0.0, 1.5))
    process.kill()
    process.wait(timeout=HANG_S)
    interrupted += any("tmp" in name for name in os.listdir(workdir / "checkpoints"))
    config = run_config(workdir)
    checkpointer = TrainingCheckpointer(str(workdir / "checkpoints"), config)
    latest = checkpointer.latest_step()
    assert latest is not None and latest >= 2
    restored = checkpointer.restore_latest(parallel_step_for(config))
    checkpointer.close()
    assert restored.step == latest and int(restored.state.step) == latest
    assert restored.data_state == {"next_index": latest}
  assert interrupted >= 1     # some kill did land inside a save (its temporary directory was left)


def test_two_process_job_resumes_after_a_kill_and_restores_by_broadcast(tmp_path):
  """2 processes x 2 devices, mesh (2,1,2): the data-parallel replicas are the processes.

  Kill and resume: both processes die after step 8; the relaunched job resumes from the
  checkpoint both wrote and repeats the steps after it with the losses of before the crash
  (to 1e-6, not bitwise: two straight 2-process runs already differ in the last bits, as
  gloo's CPU reductions do not fix their summation order; a wrong restore, such as fresh
  optimizer moments or another data position, moves the losses by far more).

  Restore modes: `direct` (the resume): each process reads its own shards; `broadcast`
  (relaunched at train.steps, the job restores and exports the parameters untouched):
  process 0 (replica 0) reads, process 1 receives and reads (almost) nothing from storage,
  and the values are the saved ones exactly."""
  mesh = SMALL_MESH_FLAGS
  source = tmp_path / "source"
  codes, errors = two_process_launch(source, *mesh, "--config.debug.fail_at_step=8")
  assert all(code != 0 for code in codes), errors[0][-2000:]
  before = losses(source)
  assert max(before) == 8
  codes, errors = two_process_launch(source, *mesh)
  assert codes == [0, 0], errors[0][-2000:] + errors[1][-2000:]
  direct = [int(re.search(r"\(direct\): this process read (\d+) bytes", e).group(1)) for e in errors]
  start = int(errors[0].split("resumed from ")[1].split(" (step ")[1].split(" ")[0])
  assert start in (3, 6)
  after = losses(source)
  assert sorted(after) == list(range(1, 13))
  np.testing.assert_allclose([after[s] for s in range(start + 1, 9)], [before[s] for s in range(start + 1, 9)],
                             rtol=1e-6)
  data_files = sorted(os.listdir(source / "checkpoints" / "12" / "data"))
  assert [f for f in data_files if f.startswith("process_")] == ["process_0.json", "process_1.json"]

  # Broadcast: relaunched at train.steps, the job restores and exports the parameters untouched.
  workdir = tmp_path / "broadcast"
  shutil.copytree(source / "checkpoints", workdir / "checkpoints")
  codes, errors = two_process_launch(workdir, *mesh, "--config.checkpoint.restore_mode=broadcast")
  assert codes == [0, 0], errors[0][-2000:] + errors[1][-2000:]
  broadcast = [int(re.search(r"\(broadcast\): this process read (\d+) bytes", e).group(1)) for e in errors]
  for a, b in zip(jax.tree.leaves(load_params(str(source / "params"))), jax.tree.leaves(load_params(str(workdir / "params")))):
    np.testing.assert_array_equal(a, b)
  reads = {"direct": direct, "broadcast": broadcast}
  (direct_0, direct_1), (broadcast_0, broadcast_1) = reads["direct"], reads["broadcast"]
  assert broadcast_1 < 0.1 * broadcast_0, reads          # the receiving process read (almost) nothing
  assert min(direct_0, direct_1) > 0.3 * max(direct_0, direct_1), reads   # each read its half
  assert broadcast_0 > 1.5 * direct_0, reads               # replica 0 read the whole state
