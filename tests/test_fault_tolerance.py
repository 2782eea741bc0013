"""Robust training (issue 7): the supervisor's fault drills on a real 2-process job (local CPU, gloo),
the non-finite loss policy, the hang view and the elastic layout.

(The file name sorts early on purpose: xdist hands out tests in collection order, and this
file's two-minute drill then overlaps the other worker's many short tests instead of
running alone at the end of the suite.)"""

import json
import os
import random
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from megajax.checkpoint import TrainingCheckpointer, load_params
from megajax.config import default_config
from megajax.launch.hang_view import classify, format_hang_view
from megajax.launch.supervisor import elastic_layout
from tests.conftest import REPO, child_env

# 2 processes x 4 CPU devices, mesh (2,1,4): the data-parallel replicas are the processes.
# Steps 7-9 get a NaN loss: skipped, then a rollback. Single-threaded Eigen in the workers:
# XLA:CPU's multi-threaded contractions do not fix their summation order on a loaded machine,
# and these runs are compared bit for bit.
JOB = ["--config=configs/default.py", "--config.train.steps=12", "--config.optimizer.warmup_steps=3",
       "--config.train.log_every=1", "--config.model.compute_dtype=float32", "--config.checkpoint.every_steps=3",
       "--config.parallel.dp=2", "--config.parallel.pp=1", "--config.parallel.virtual_stages=1",
       "--config.parallel.tp=4", "--config.parallel.tp_overlap=none", "--config.model.num_layers=2",
       "--config.supervisor.processes=2", "--config.supervisor.heartbeat_interval_s=0.25",
       "--config.supervisor.heartbeat_timeout_s=3", "--config.supervisor.hang_timeout_s=90",
       "--config.debug.nonfinite_steps=7,8,9"]
HEARTBEAT_TIMEOUT = 3.0


def start_supervisor(workdir, *overrides):
  log = open(f"{workdir}.log", "w")
  return subprocess.Popen([sys.executable, "-m", "megajax.launch.supervise", *JOB, f"--workdir={workdir}", *overrides],
                          cwd=REPO, env=child_env({"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"}), stdout=log,
                          stderr=subprocess.STDOUT)


def finish(process, workdir, timeout=400) -> str:
  process.wait(timeout=timeout)
  return open(f"{workdir}.log").read()


def beats(workdir) -> dict:
  from megajax.heartbeat import read_heartbeats
  return read_heartbeats(str(workdir))


def wait_for_step(process, workdir, step, timeout=300) -> dict:
  deadline = time.time() + timeout
  while time.time() < deadline and process.poll() is None:
    current = beats(workdir)
    if len(current) == 2 and min(b["step"] for b in current.values()) >= step:
      return current
    time.sleep(0.05)
  raise AssertionError(f"the job never reached step {step}: {open(f'{workdir}.log').read()[-3000:]}")


def incidents(workdir) -> list[dict]:
  path = workdir / "incidents.jsonl"
  return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def losses(workdir) -> dict:
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  return {r["step"]: r["loss"] for r in records if r.get("loss") is not None}


def test_fault_drills_nan_kill_hang_and_elastic_continue(tmp_path):
  """Reference: the injected NaN steps 7-9 are skipped, the third in a row rolls back to the
  latest checkpoint, no checkpoint holds a non-finite value. Kill: the same job with a kill -9
  of a random worker at a random step; the supervisor restarts it, the run finishes, and the
  final parameters equal the uninterrupted run's bit for bit; the restart compiles from the
  workdir's persistent cache. Hang and elastic continue: below."""
  reference, killed = tmp_path / "reference", tmp_path / "killed"
  output = finish(start_supervisor(reference), reference)
  assert "training finished" in output, output[-3000:]
  nonfinite = [i for i in incidents(reference) if i["kind"] == "nonfinite"]
  assert len(nonfinite) == 1 and nonfinite[0]["action"] == "rollback", incidents(reference)
  assert nonfinite[0]["resumed_from_step"] == 6 and nonfinite[0]["last_step"] == 9
  records = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
  assert [r["skipped"] for r in records if "skipped" in r and r["step"] in (7, 8, 9)] == [1, 1, 1]
  _assert_checkpoints_finite(reference)

  rng = random.Random(os.getpid())
  victim, at_step = rng.randrange(2), rng.randrange(2, 11)
  process = start_supervisor(killed, f"--config.runtime.compilation_cache_dir={killed}/jax_cache",
                             "--config.supervisor.diagnose=false")      # the same mesh after the restart
  pid = wait_for_step(process, killed, at_step)[victim]["pid"]
  os.kill(pid, signal.SIGKILL)
  output = finish(process, killed)
  assert "training finished" in output, output[-3000:]
  crash = [i for i in incidents(killed) if i["kind"] == "exit"]
  assert len(crash) == 1 and crash[0]["processes"] == [victim], incidents(killed)
  assert crash[0]["steps_lost"] >= 0 and crash[0]["time_to_resume_s"] > 0
  for a, b in zip(jax.tree.leaves(load_params(str(reference / "params"))),
                  jax.tree.leaves(load_params(str(killed / "params")))):
    np.testing.assert_array_equal(a, b)
  # The restart compiled from the workdir's persistent cache, which the first attempt filled
  # (process 0 writes the entries, and on CPU only its cache keys match its own).
  import re
  cache = [re.search(r"compilation cache: (\d+) hits, (\d+) misses", (killed / "logs" / f"attempt_{i}.process_0.log")
                     .read_text()).groups() for i in (0, 1)]
  # (A restart that restores a checkpoint may compile its restore program, which the first
  # attempt never ran: fewer misses, not none.)
  assert cache[0][0] == "0" and int(cache[0][1]) > 0, cache
  assert int(cache[1][0]) > 0 and int(cache[1][1]) < int(cache[0][1]), cache

  # Hang and elastic continue: process 1 is stopped (SIGSTOP) after step 5. Its heartbeat goes silent and
  # the other, blocked in a collective, keeps beating: detected within 2x the heartbeat
  # timeout, the 3D view names 1 the suspect and 0 the victim. The diagnostics find process 1
  # slow (the drill), so the job continues on process 0 alone: dp 2 -> 1 with twice the
  # accumulation and the same global batch, so the steps after the restart have the
  # uninterrupted run's losses.
  elastic = tmp_path / "elastic"
  process = start_supervisor(elastic, "--config.debug.diagnose_slow_process=1")
  os.kill(wait_for_step(process, elastic, 5)[1]["pid"], signal.SIGSTOP)   # before the NaN steps
  output = finish(process, elastic)
  assert "training finished" in output, output[-3000:]
  incident = [i for i in incidents(elastic) if i["kind"] != "nonfinite"][-1]
  assert incident["kind"] == "heartbeat_lost" and incident["processes"] == [1], incident
  assert incident["time_to_detect_s"] <= 2 * HEARTBEAT_TIMEOUT, incident
  view = (elastic / "hang_views.txt").read_text()
  assert "suspects: process 1" in view and "victims: process 0" in view, view
  assert "S p1" in view and "V p0" in view
  # Before stopping the job the supervisor had each worker print its Python stacks (SIGUSR1):
  # the victim's log shows it waiting inside the training loop.
  victim_log = (elastic / "logs" / "attempt_0.process_0.log").read_text()
  assert "(most recent call first)" in victim_log and "_run_loop" in victim_log, victim_log[-3000:]
  assert incident["action"] == "elastic" and incident["bad_processes"] == [1], incident
  assert incident["mesh_after"] == [1, 1, 4] and incident["processes_after"] == 1
  assert "train.microbatches=8 (the global batch stays 16)" in output
  report = json.loads(next((elastic / "diagnostics").glob("*.json")).read_text())
  assert report["bad_processes"] == [1]
  # The 1-process run meets the NaN steps too: skips, and the same rollback.
  start, want, got = incident["resumed_from_step"], losses(reference), losses(elastic)
  after = [s for s in range(start + 1, 13) if s not in (7, 8, 9)]     # NaN steps log a null loss
  assert start in (3, 6) and sorted(got) == [s for s in range(1, 13) if s not in (7, 8, 9)]
  np.testing.assert_allclose([got[s] for s in after], [want[s] for s in after], rtol=1e-5)


def _assert_checkpoints_finite(workdir):
  """Every checkpoint's state, restored onto the job's mesh (8 devices here), is finite."""
  from megajax.config import load_config
  from megajax.model import GPT, ModelConfig
  from megajax.parallel import ParallelPlan, make_mesh
  config = load_config(os.path.join(REPO, "configs/default.py"),
                       {arg[len("--config."):].split("=")[0]: _value(arg.split("=")[1])
                        for arg in JOB if arg.startswith("--config.")})
  plan = ParallelPlan.build(config, GPT(ModelConfig.from_config(config.model)), make_mesh(config, jax.devices()))
  checkpointer = TrainingCheckpointer(str(workdir / "checkpoints"), config)
  steps = checkpointer.all_steps()
  assert steps
  for step in steps:
    state = checkpointer.restore(step, plan.abstract_inputs()[0]).state
    for leaf in jax.tree.leaves(jax.device_get(state)):
      assert np.all(np.isfinite(leaf)), f"checkpoint {step} holds a non-finite value"
  checkpointer.close()


def _value(text: str):
  for kind in (int, float):
    try:
      return kind(text)
    except ValueError:
      pass
  return text


def test_classify_names_the_silent_process_first():
  now = 100.0
  suspects, victims = classify({0: 99.5, 1: 90.0, 2: 95.0}, {0: 80.0, 1: 80.0, 2: 80.0}, now, 3.0)
  assert suspects == [1, 2] and victims == [0]
  suspects, victims = classify({0: 99.9, 1: 99.9}, {0: 50.0, 1: 70.0}, now, 3.0)   # all alive: stuck first
  assert suspects == [0] and victims == [1]


def test_hang_view_grid():
  beats = {0: {"host": "a", "step": 9, "phase": "step 10", "devices": [{"id": 0, "coords": [0, 0, 0]},
                                                                       {"id": 1, "coords": [0, 0, 1]}]},
           1: {"host": "b", "step": 9, "phase": "step 10", "devices": [{"id": 2, "coords": [1, 0, 0]},
                                                                       {"id": 3, "coords": [1, 0, 1]}]}}
  view = format_hang_view(beats, (2, 1, 2), [1], [0])
  assert view.count("S p1 step 10") == 2 and view.count("V p0 step 10") == 2
  assert "suspects: process 1 (b, step 9)" in view and "victims: process 0 (a, step 9)" in view


def test_elastic_layout_keeps_the_global_batch():
  config = default_config()
  config.parallel.dp, config.parallel.pp, config.parallel.tp, config.train.microbatches = 4, 2, 2, 4
  # 4 processes x 4 devices (mesh 4x2x2); one bad: 3 usable -> 2 processes (dp must divide 4).
  assert elastic_layout(config, 4, 4, 3) == {"processes": 2, "parallel.dp": 2, "train.microbatches": 8}
  assert elastic_layout(config, 4, 4, 0) is None
  config.parallel.dp = 3
  assert elastic_layout(config, 3, 4, 2) == {"processes": 1, "parallel.dp": 1, "train.microbatches": 12}


def test_nonfinite_step_leaves_the_state_unchanged(tiny_config):
  """A batch whose loss is NaN: the 3D step skips the update (state bitwise unchanged) and
  says so; a finite batch then trains normally."""
  from megajax import data
  from megajax.model import GPT, ModelConfig
  from megajax.parallel import ParallelPlan, make_mesh
  tiny_config.parallel.dp = 2
  plan = ParallelPlan.build(tiny_config, GPT(ModelConfig.from_config(tiny_config.model)),
                            make_mesh(tiny_config, jax.devices()[:2]))
  batch = plan.put_batch(next(data.make_iterator(tiny_config, 0, 1)))
  step = plan.train_step()
  state = plan.init_state(jax.random.key(0))
  before = jax.device_get(state)
  poisoned = {**batch, "loss_mask": batch["loss_mask"] * float("nan")}
  state, metrics = step(state, poisoned)
  assert int(metrics["skipped"]) == 1 and not np.isfinite(float(metrics["loss"]))
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(state))):
    np.testing.assert_array_equal(a, b)
  state, metrics = step(state, batch)
  assert int(metrics["skipped"]) == 0 and int(state.step) == 1


@pytest.mark.parametrize("field, value", [("supervisor.heartbeat_timeout_s", 0.1),
                                          ("supervisor.command", "srun python train.py"),
                                          ("debug.nonfinite_steps", "7;8")])
def test_supervisor_fields_are_validated(field, value):
  from megajax.config import ConfigError, validate
  config = default_config()
  group, name = field.split(".")
  config[group][name] = value
  with pytest.raises(ConfigError, match=field):
    validate(config)


def test_command_template_keeps_the_shells_own_braces():
  from megajax.launch.supervisor import fill_template
  line = fill_template("srun --nodes={processes} ${MEGAJAX_EXCLUDE_HOSTS:+--exclude=$MEGAJAX_EXCLUDE_HOSTS} {train}",
                       ["megajax-train", "--config=c.py", "--workdir=/shared/run dir"], 3, ["h1"])
  assert line == ("srun --nodes=3 ${MEGAJAX_EXCLUDE_HOSTS:+--exclude=$MEGAJAX_EXCLUDE_HOSTS} "
                  "megajax-train --config=c.py '--workdir=/shared/run dir'")


def test_command_mode_runs_the_template_and_sees_its_failure(tmp_path):
  """supervisor.command: the job is whatever the template starts; a failing command is an
  "exit" incident, and the restart budget ends it."""
  from megajax.config import default_config
  from megajax.launch.supervisor import Supervisor
  config = default_config()
  marker = tmp_path / "ran"
  config.supervisor.command = f"echo {{args}} >> {marker}; exit 3"
  config.supervisor.max_restarts, config.supervisor.diagnose = 1, False
  code = Supervisor(config, str(tmp_path / "run"), ["--config=configs/default.py"]).run()
  assert code == 1
  runs = marker.read_text().splitlines()
  assert len(runs) == 2 and all(f"--workdir={tmp_path}/run" in r for r in runs)
  kinds = [(i["kind"], i["action"]) for i in incidents(tmp_path / "run")]
  assert kinds == [("exit", "restart"), ("exit", "give_up")]


def test_megajax_local_passes_a_failing_process_exit_code_on():
  """megajax-local (its 2-process success path runs in test_train): a process that fails ends
  the job with its exit code."""
  local = [sys.executable, "-m", "megajax.launch.local", "--processes", "2", "--devices-per-process", "4", "--"]
  failed = subprocess.run([*local, "--config=configs/default.py", "--workdir=/tmp/unused", "--config.parallel.tp=3"],
                          cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=180)
  assert failed.returncode == 2 and "parallel.tp" in failed.stderr


def test_a_crash_signal_is_told_from_a_peers_exit():
  """When a killed worker takes its peers down, the one a crash signal ended is blamed."""
  from megajax.launch.supervisor import _crash_signal
  assert _crash_signal(-9) and _crash_signal(128 + 9) and _crash_signal(-11)
  assert not _crash_signal(1) and not _crash_signal(-6) and not _crash_signal(143) and not _crash_signal(0)
