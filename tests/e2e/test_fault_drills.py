"""Robust training's fault drills on a real 2-process job (local CPU, gloo), under megajax-supervise.

The reference run meets injected NaN losses; the kill drill is compared with it bit for bit;
the hang drill ends in an elastic continue whose losses are compared with it. The reference
runs once per test run, whichever worker needs it first (tests.support.once).

metrics.jsonl holds each step's records once: a run resumed from the checkpoint of step n
drops the records after step n before it logs the steps again (megajax.observe.records), so
the drills hold whether or not a restart happened; each asserts it.
"""

import collections
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from megajax.checkpoint import TrainingCheckpointer, load_params
from megajax.config import load_config
from megajax.observe import format_table, job_ledger
from tests.support import REPO, SMALL_MESH, config_flags
from tests.support.once import once_per_run
from tests.support.processes import HANG_S, child_env
from tests.support.records import incidents, metrics
from tests.support.reference import parallel_step_for

# 2 processes x 2 CPU devices, mesh (2,1,2): the data-parallel replicas are the processes; the
# default model at a quarter of its width and sequence (the faults do not depend on its size).
# Steps 7-9 get a NaN loss: skipped, then a rollback. Single-threaded Eigen in the workers:
# XLA:CPU's multi-threaded contractions do not fix their summation order on a loaded machine,
# and these runs are compared bit for bit.
OVERRIDES = {"train.steps": 12, "optimizer.warmup_steps": 3, "train.log_every": 1, "model.compute_dtype": "float32",
             "checkpoint.every_steps": 3, **SMALL_MESH,
             "model.hidden_dim": 32, "model.seq_len": 32, "model.window": 16, "supervisor.processes": 2,
             "supervisor.heartbeat_interval_s": 0.25, "supervisor.heartbeat_timeout_s": 3,
             "supervisor.hang_timeout_s": 90, "debug.nonfinite_steps": "7,8,9"}
JOB = ["--config=configs/default.py", *config_flags(OVERRIDES)]
# The rollback comes at step 9's save, which reads that step's flag (the third skip in a row)
# first, back to the checkpoint of step 6: steps 7-9 are thrown away.
ROLLED_BACK = 9 - 6
HEARTBEAT_TIMEOUT = OVERRIDES["supervisor.heartbeat_timeout_s"]


def start_supervisor(workdir, *overrides):
  log = open(f"{workdir}.log", "w")
  return subprocess.Popen([sys.executable, "-m", "megajax.launch.supervise", *JOB, f"--workdir={workdir}", *overrides],
                          cwd=REPO, env=child_env({"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"}), stdout=log,
                          stderr=subprocess.STDOUT)


def finish(process, workdir, timeout=HANG_S) -> str:
  process.wait(timeout=timeout)
  return open(f"{workdir}.log").read()


def timed_job(workdir, *overrides) -> tuple[str, float]:
  """(the supervisor's output, the job's wall time as the test saw it: launch to exit)."""
  started = time.time()
  output = finish(start_supervisor(workdir, *overrides), workdir)
  return output, time.time() - started


def steps_run_by_the_logs(workdir) -> int:
  """The steps process 0 logged, every attempt (train.log_every=1: one line a step it finished)."""
  return sum(len(re.findall(r"step \d+/12  grad_norm=", log.read_text()))
             for log in (workdir / "logs").glob("attempt_*.process_0.log"))


def check_ledger(workdir, wall_s: float, kept: int) -> None:
  """The goodput ledger of a drill: its wall time within 2% of the test's, its causes adding up
  to it, `kept` steps kept, and as many redone as the logs show run beyond them."""
  book = job_ledger(str(workdir))
  table = format_table(book)
  print(table)
  assert abs(book.wall_s - wall_s) <= 0.02 * wall_s, (wall_s, table)
  assert sum(book.seconds.values()) == pytest.approx(book.wall_s, rel=1e-6) and min(book.seconds.values()) >= 0
  assert book.kept_steps == kept, table
  assert book.redone_steps == steps_run_by_the_logs(workdir) - kept, table


def step_records(workdir) -> list[dict]:
  """metrics.jsonl's per-step metric records (not the checkpoint and start-up ones), after
  checking that no (step, kind) of record is there twice, restarts or not."""
  records = metrics(workdir)
  kinds = collections.Counter((r["step"], tuple(sorted(k for k in r if k != "step"))) for r in records)
  assert all(n == 1 for n in kinds.values()), [key for key, n in kinds.items() if n > 1]
  return [r for r in records if "skipped" in r]


def losses(workdir) -> dict:
  return {r["step"]: r["loss"] for r in step_records(workdir) if r.get("loss") is not None}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """The uninterrupted job (no fault but the NaN steps): its workdir."""
  def run(workdir):
    output, wall = timed_job(workdir)
    assert "training finished" in output, output[-3000:]
    (workdir / "wall_s.txt").write_text(str(wall))
  return once_per_run(tmp_path_factory, "fault_drills_reference", run)


def test_nan_steps_are_skipped_then_rolled_back(reference, tmp_path):
  """The injected NaN steps 7-9 are skipped, the third in a row rolls back to the latest
  checkpoint (step 6), and no checkpoint holds a non-finite value."""
  nonfinite = [i for i in incidents(reference) if i["kind"] == "nonfinite"]
  assert len(nonfinite) == 1 and nonfinite[0]["action"] == "rollback", incidents(reference)
  assert nonfinite[0]["resumed_from_step"] == 6 and nonfinite[0]["last_step"] == 9
  assert [r["skipped"] for r in step_records(reference) if r["step"] in (7, 8, 9)] == [1, 1, 1]
  _assert_checkpoints_finite(reference, tmp_path)
  # The ledger: 12 steps run; the rollback came at step 9's save (which reads its own flag first)
  # and threw steps 7-9 away: 9 kept, 3 redone.
  check_ledger(reference, float((reference / "wall_s.txt").read_text()), kept=12 - ROLLED_BACK)
  assert job_ledger(str(reference)).seconds["rollback"] > 0


def test_a_killed_worker_is_restarted_and_the_run_ends_bitwise_equal(reference, tmp_path):
  """The same job with a kill -9 of a random worker after a random step (debug.fail_at_step,
  first attempt only): the supervisor restarts it on the same hosts (the diagnostics find the
  killed one healthy: no eviction on noise), the run finishes, and the final parameters equal
  the uninterrupted run's bit for bit; the restart compiles from the workdir's persistent cache."""
  killed = tmp_path / "killed"
  rng = random.Random(os.getpid())
  victim, at_step = rng.randrange(2), rng.randrange(2, 11)
  drill = f"kill -9 of process {victim} after step {at_step}"     # random: named in every failure
  output, wall = timed_job(killed, f"--config.runtime.compilation_cache_dir={killed}/jax_cache",
                           f"--config.debug.fail_at_step={at_step}", f"--config.debug.fail_process={victim}")
  assert "training finished" in output, (drill, output[-3000:])
  # The ledger: the final trajectory keeps all but its one rollback's steps; the steps attempt 0
  # ran past the checkpoint attempt 1 resumed from are redone; detection and recovery charged.
  check_ledger(killed, wall, kept=12 - ROLLED_BACK)
  book = job_ledger(str(killed))
  assert [a.status for a in book.attempts] == ["failed: exit", "finished"], (drill, format_table(book))
  # (An exit is seen at the supervisor's next poll: detection may round to nothing.)
  assert book.seconds["recovery"] > 0 and book.seconds["idle"] == 0, (drill, format_table(book))
  crash = [i for i in incidents(killed) if i["kind"] == "exit"]
  assert len(crash) == 1 and crash[0]["processes"] == [victim], (drill, incidents(killed))
  assert crash[0]["steps_lost"] >= 0 and crash[0]["time_to_resume_s"] > 0, (drill, crash)
  assert crash[0]["action"] == "restart" and crash[0]["bad_processes"] == [], (drill, crash)
  # Detection to the restart's first finished step: the incident's time to resume, which the
  # supervisor sees a heartbeat and a poll later.
  assert 0 <= crash[0]["time_to_resume_s"] - book.attempts[0].resumed_s < 2.0, (drill, crash, format_table(book))
  assert list((killed / "diagnostics").glob("*.json")), drill     # diagnosed, found healthy
  assert sorted(losses(killed)) == sorted(losses(reference)), drill   # each step logged once, restart or not
  for a, b in zip(jax.tree.leaves(load_params(str(reference / "params"))),
                  jax.tree.leaves(load_params(str(killed / "params")))):
    np.testing.assert_array_equal(a, b, err_msg=drill)
  # The restart compiled from the workdir's persistent cache, which the first attempt filled
  # (process 0 writes the entries, and on CPU only its cache keys match its own).
  cache = [re.search(r"compilation cache: (\d+) hits, (\d+) misses", (killed / "logs" / f"attempt_{i}.process_0.log")
                     .read_text()).groups() for i in (0, 1)]
  # (A restart that restores a checkpoint may compile its restore program, which the first
  # attempt never ran: fewer misses, not none.)
  assert cache[0][0] == "0" and int(cache[0][1]) > 0, (drill, cache)
  assert int(cache[1][0]) > 0 and int(cache[1][1]) < int(cache[0][1]), (drill, cache)


def test_a_hung_worker_is_found_and_the_job_continues_without_it(reference, tmp_path):
  """Process 1 stops itself (SIGSTOP, debug.fail_mode=hang) after step 5, before the NaN
  steps. Its heartbeat goes silent and the other, blocked in a collective, keeps beating:
  detected within 2x the heartbeat timeout, the 3D view names 1 the suspect and 0 the victim.
  The diagnostics find process 1 slow (the drill), so the job continues on process 0 alone:
  dp 2 -> 1 with twice the accumulation and the same global batch, so the steps after the
  restart have the uninterrupted run's losses."""
  elastic = tmp_path / "elastic"
  output, wall = timed_job(elastic, "--config.debug.diagnose_slow_process=1", "--config.debug.fail_at_step=5",
                           "--config.debug.fail_process=1", "--config.debug.fail_mode=hang")
  assert "training finished" in output, output[-3000:]
  # The ledger: steps 4-5 run again after the restart from 3 (none from 6), and the rollback's;
  # the heartbeat timeout is the detection, the diagnostics the recovery.
  check_ledger(elastic, wall, kept=12 - ROLLED_BACK)
  book = job_ledger(str(elastic))
  assert [a.status for a in book.attempts] == ["failed: heartbeat_lost", "finished"], format_table(book)
  assert book.seconds["detection"] >= HEARTBEAT_TIMEOUT * 0.9, format_table(book)
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
  assert incident["mesh_after"] == [1, 1, 1, 2] and incident["processes_after"] == 1     # (dp, pp, cp, tp)
  assert "train.microbatches=8 (the global batch stays 16)" in output
  report = json.loads(next((elastic / "diagnostics").glob("*.json")).read_text())
  assert report["bad_processes"] == [1]
  # The 1-process run meets the NaN steps too: skips, and the same rollback.
  start, want, got = incident["resumed_from_step"], losses(reference), losses(elastic)
  after = [s for s in range(start + 1, 13) if s not in (7, 8, 9)]     # NaN steps log a null loss
  assert start in (3, 6) and sorted(got) == [s for s in range(1, 13) if s not in (7, 8, 9)]
  np.testing.assert_allclose([got[s] for s in after], [want[s] for s in after], rtol=1e-5)


def _assert_checkpoints_finite(workdir, scratch):
  """Every checkpoint's state, restored onto the job's mesh (its 4 devices here), is finite (read
  from a copy in `scratch`: the reference run is shared with the other drills)."""
  config = load_config(os.path.join(REPO, "configs/default.py"), OVERRIDES)
  parallel_step = parallel_step_for(config)
  copy = shutil.copytree(workdir / "checkpoints", scratch / "checkpoints")
  checkpointer = TrainingCheckpointer(str(copy), config)
  steps = checkpointer.all_steps()
  assert steps
  for step in steps:
    state = checkpointer.restore(step, parallel_step.abstract_inputs()[0]).state
    for leaf in jax.tree.leaves(jax.device_get(state)):
      assert np.all(np.isfinite(leaf)), f"checkpoint {step} holds a non-finite value"
  checkpointer.close()

