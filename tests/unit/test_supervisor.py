"""The supervisor's pieces in process: the hang view's suspects and victims, the elastic
layout, the command template, crash signals, its config checks. (The supervisor driving real
jobs: tests/e2e.)"""

import os

import pytest

from megajax.config import ConfigError, default_config, validate
from megajax.launch.supervisor import Supervisor, elastic_layout, fill_template
from megajax.launch.supervisor.diagnostics import SLOW_RUNS
from megajax.launch.supervisor.driver import _crash_signal
from megajax.launch.supervisor.hang_view import classify_hang, format_hang_view
from megajax.trainer.workdir import LOCK_FILE, SUPERVISOR_LOCK_FILE, WorkdirError, WorkdirLock


def test_classify_names_the_silent_process_first():
  now = 100.0
  suspects, victims = classify_hang({0: 99.5, 1: 90.0, 2: 95.0}, {0: 80.0, 1: 80.0, 2: 80.0}, now, 3.0)
  assert suspects == [1, 2] and victims == [0]
  suspects, victims = classify_hang({0: 99.9, 1: 99.9}, {0: 50.0, 1: 70.0}, now, 3.0)   # all alive: stuck first
  assert suspects == [0] and victims == [1]


def test_hang_view_grid():
  beats = {0: {"host": "a", "step": 9, "phase": "step 10", "devices": [{"id": 0, "coords": [0, 0, 0, 0]},
                                                                       {"id": 1, "coords": [0, 0, 0, 1]}]},
           1: {"host": "b", "step": 9, "phase": "step 10", "devices": [{"id": 2, "coords": [1, 0, 0, 0]},
                                                                       {"id": 3, "coords": [1, 0, 0, 1]}]}}
  view = format_hang_view(beats, (2, 1, 1, 2), [1], [0])
  assert view.count("S p1 step 10") == 2 and view.count("V p0 step 10") == 2
  assert "suspects: process 1 (b, step 9)" in view and "victims: process 0 (a, step 9)" in view
  assert view.startswith("3D hang view: dp=2 x pp=1 x tp=2;") and "cp" not in view   # cp = 1: as before cp
  assert "  pp 0: S p1 step 10 | S p1 step 10" in view.splitlines()


def test_hang_view_with_context_parallelism_has_a_row_per_stage_and_cp_rank():
  """cp = 2, one process per cp rank: each dp block's rows are (pp, cp) pairs, columns tp."""
  beats = {c: {"host": "ab"[c], "step": 4, "phase": "step 5",
               "devices": [{"id": 4 * c + 2 * s + t, "coords": [0, s, c, t]} for s in range(2) for t in range(2)]}
           for c in range(2)}
  view = format_hang_view(beats, (1, 2, 2, 2), [1], [0])
  lines = view.splitlines()
  assert lines[0].startswith("4D hang view: dp=1 x pp=2 x cp=2 x tp=2;")
  rows = {line.split(":")[0].strip(): line.split(":", 1)[1] for line in lines if line.startswith("  pp ")}
  assert list(rows) == ["pp 0 cp 0", "pp 0 cp 1", "pp 1 cp 0", "pp 1 cp 1"]
  assert all(rows[f"pp {s} cp 1"].count("S p1 step 5") == 2 for s in range(2))
  assert all(rows[f"pp {s} cp 0"].count("V p0 step 5") == 2 for s in range(2))
  header = next(line for line in lines if "tp 0" in line)
  assert header.index("tp 0") == lines[lines.index(header) + 1].index("V p0")   # the columns line up
  # A device no beat describes (or with coordinates of another mesh) stays "?".
  assert format_hang_view({0: beats[0]}, (1, 2, 2, 2), [], [0]).count("?") == 4
  assert format_hang_view({0: {**beats[0], "devices": [{"id": 0, "coords": [0, 0, 0]}]}},
                          (1, 1, 1, 1), [], [0]).count("?") == 1


def test_elastic_layout_keeps_the_global_batch():
  config = default_config()
  config.parallel.dp, config.parallel.pp, config.parallel.tp, config.train.microbatches = 4, 2, 2, 4
  # 4 processes x 4 devices (mesh 4x2x2); one bad: 3 usable -> 2 processes (dp must divide 4).
  assert elastic_layout(config, 4, 4, 3) == {"processes": 2, "parallel.dp": 2, "train.microbatches": 8}
  assert elastic_layout(config, 4, 4, 0) is None
  config.parallel.dp = 3
  assert elastic_layout(config, 3, 4, 2) == {"processes": 1, "parallel.dp": 1, "train.microbatches": 12}
  # cp is kept too: a dp replica is pp x cp x tp = 8 devices, two processes of 4 (8 x 4 devices,
  # one bad: 7 usable -> 4 processes, dp 2; without cp, 16 devices would have been taken for dp 4).
  config.parallel.dp, config.parallel.pp, config.parallel.cp, config.parallel.tp = 4, 1, 2, 4
  assert elastic_layout(config, 8, 4, 7) == {"processes": 4, "parallel.dp": 2, "train.microbatches": 8}


@pytest.mark.parametrize("field, value", [("supervisor.heartbeat_timeout_s", 0.1),
                                          ("supervisor.command", "srun python train.py"),
                                          ("debug.nonfinite_steps", "7;8"), ("debug.fail_mode", "stop")])
def test_supervisor_fields_are_validated(field, value):
  config = default_config()
  group, name = field.split(".")
  config[group][name] = value
  with pytest.raises(ConfigError, match=field):
    validate(config)


def test_command_template_keeps_the_shells_own_braces():
  line = fill_template("srun --nodes={processes} ${MEGAJAX_EXCLUDE_HOSTS:+--exclude=$MEGAJAX_EXCLUDE_HOSTS} {train}",
                       ["megajax-train", "--config=c.py", "--workdir=/shared/run dir"], 3, ["h1"])
  assert line == ("srun --nodes=3 ${MEGAJAX_EXCLUDE_HOSTS:+--exclude=$MEGAJAX_EXCLUDE_HOSTS} "
                  "megajax-train --config=c.py '--workdir=/shared/run dir'")


def test_a_crash_signal_is_told_from_a_peers_exit():
  """When a killed worker takes its peers down, the one a crash signal ended is blamed."""
  assert _crash_signal(-9) and _crash_signal(128 + 9) and _crash_signal(-11)
  assert not _crash_signal(1) and not _crash_signal(-6) and not _crash_signal(143) and not _crash_signal(0)


@pytest.mark.parametrize("slow_in_runs, runs, bad", [
    ([[]], 1, []),                                # healthy: one run, the same hosts
    ([[1], []], 2, []),                           # slow once (noise): run again, not again: the same hosts
    ([[1]] * SLOW_RUNS, SLOW_RUNS, [1]),          # slow every time: bad
    ([[0]], 1, []),                               # a slow bystander (0), process 1 blamed: the same hosts
])
def test_the_supervisor_runs_the_diagnostics_again_before_evicting(slow_in_runs, runs, bad, tmp_path, monkeypatch):
  config = default_config()
  config.supervisor.processes = 2
  supervisor = Supervisor(config, str(tmp_path), [])
  reports = iter({"bad_processes": slow, "devices": []} for slow in slow_in_runs)
  ran = []
  monkeypatch.setattr(supervisor, "_diagnose_once", lambda attempt, run: ran.append(run) or next(reports))
  assert supervisor._diagnose(0, blamed=[1]) == bad
  assert ran == list(range(runs))


@pytest.mark.parametrize("held", [SUPERVISOR_LOCK_FILE, LOCK_FILE])
def test_a_supervisor_refuses_a_workdir_another_supervisor_or_job_holds(held, tmp_path):
  """Another supervisor (supervisor.lock) or a training job started without one (lock): refused
  before a worker starts or the heartbeats are cleared; the holder is named."""
  (tmp_path / "heartbeats").mkdir()
  holder = WorkdirLock(str(tmp_path), held)
  holder.acquire()
  try:
    with pytest.raises(WorkdirError, match=f"in use by another training job: process {os.getpid()} on host"):
      Supervisor(default_config(), str(tmp_path), []).run()
  finally:
    holder.release()
  assert (tmp_path / "heartbeats").is_dir() and not (tmp_path / "logs").exists()
  # Both locks free again: a later supervisor may take them.
  for name in (SUPERVISOR_LOCK_FILE, LOCK_FILE):
    lock = WorkdirLock(str(tmp_path), name)
    lock.acquire()
    lock.release()
