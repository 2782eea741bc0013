"""The goodput ledger (megajax.observe.goodput, goodput_ledger): a run's laps, and a job's wall
time split into causes that add up to it across failures and restarts. The supervisor drills
check it on real faults (tests/e2e/test_fault_drills.py), megajax-goodput is run in
tests/e2e/test_commands.py."""

import time

import pytest

from megajax.observe import goodput, goodput_ledger
from megajax.observe.goodput_ledger import LEDGER_CAUSES, format_table, ledger


def run_record(process_start, seconds, start_step, last_step, attempt=0, status="finished",
               rollbacks=()):
  """A run's record as goodput.GoodputClock writes it: its causes' seconds end at `time`."""
  full = dict.fromkeys(goodput_ledger.CAUSES, 0.0) | seconds
  return {"process_start": process_start, "time": process_start + sum(full.values()), "attempt": attempt,
          "pid": attempt, "start_step": start_step, "last_step": last_step,
          "rollbacks": [{"step": s, "to_step": t} for s, t in rollbacks], "cache": {"hits": 0, "misses": 3},
          "status": status, "seconds": full}


def test_a_runs_laps_add_up_to_its_time_and_its_finished_steps_count_once():
  clock = goodput.GoodputClock(attempt=2, started=time.time() - 1.0)
  clock.lap("setup")
  clock.finished(1)
  clock.finished(2)
  clock.finished(2)           # a drill's before the guard's: counted once
  clock.lap("steps")
  clock.discarded(2, 0)
  record = clock.snapshot()
  assert record["last_step"] - record["start_step"] == 2 and record["last_step"] == 2 and record["attempt"] == 2
  assert record["rollbacks"] == [{"step": 2, "to_step": 0}]
  assert sum(record["seconds"].values()) == pytest.approx(record["time"] - record["process_start"], abs=1e-6)
  assert record["seconds"]["start"] == pytest.approx(1.0, abs=0.05)


def test_a_crash_and_restart_split_into_their_causes():
  """Attempt 0 runs steps 1-7 (5 s of steps) and is killed; the supervisor saw its last sign of
  life 1 s after its last record and detected it 2 s later; attempt 1 starts 4 s after the
  detection, resumes from the checkpoint of step 5 and runs 6-10. Steps 6 and 7 ran twice."""
  first = run_record(100.0, {"start": 2.0, "compile": 3.0, "steps": 7.0}, 0, 7, status="running")
  events = [{"event": "start", "time": 99.0},
            {"event": "failure", "attempt": 0, "kind": "exit", "last_sign_of_life": first["time"] + 1.0,
             "detected_at": first["time"] + 3.0, "last_step": 7}]
  second = run_record(first["time"] + 7.0, {"start": 1.0, "restore": 0.5, "compile": 0.5, "steps": 5.0}, 5, 10,
                      attempt=1)
  second["first_step_time"] = second["process_start"] + 3.0
  events.append({"event": "end", "time": second["time"] + 0.25, "code": 0})
  book = ledger([first, second], events)
  assert book.wall_s == pytest.approx(second["time"] + 0.25 - 99.0)
  assert sum(book.seconds.values()) == pytest.approx(book.wall_s)
  assert book.redone_steps == 2 and book.kept_steps == 10
  assert book.seconds["redone"] == pytest.approx(2.0)           # 2 of attempt 0's 7 steps, 1 s each
  assert book.seconds["productive"] == pytest.approx(5.0 + 5.0)
  assert book.seconds["unaccounted"] == pytest.approx(1.0)       # record -> last sign of life
  assert book.seconds["detection"] == pytest.approx(2.0)
  assert book.seconds["recovery"] == pytest.approx(4.0)          # detection -> the restart's process start
  assert book.seconds["idle"] == 0.0
  assert book.seconds["start"] == pytest.approx(1.0 + 3.0)       # the supervisor's start, the runs' starts
  assert book.seconds["shutdown"] == pytest.approx(0.25)         # the last run's end -> the supervisor's
  assert book.seconds["compile"] == pytest.approx(3.5)
  assert book.ratio == pytest.approx(10.0 / book.wall_s)
  assert [a.status for a in book.attempts] == ["failed: exit", "finished"]
  assert book.attempts[0].resumed_s == pytest.approx(4.0 + 3.0)  # detection -> the restart's first step
  table = format_table(book)
  assert f"= 10 x 1.0000 s / {book.wall_s:.2f} s = {100 * book.ratio:.1f}%" in table
  assert all(name in table for name in ("failure detection", "recovery", "steps run again"))


def test_a_rollback_and_a_restart_over_the_same_steps_count_them_once():
  """Attempt 0 rolls back at step 10 to the checkpoint of step 6 (steps 7-10 discarded) and is
  killed after step 10; attempt 1 resumes from 6: steps 7-10 are wasted once, not twice."""
  first = run_record(0.0, {"steps": 10.0}, 0, 10, status="running", rollbacks=[(10, 6)])
  second = run_record(20.0, {"steps": 6.0}, 6, 12, attempt=1, rollbacks=[])
  book = ledger([first, second], [{"event": "failure", "attempt": 0, "kind": "exit",
                                   "last_sign_of_life": 10.0, "detected_at": 11.0}])
  assert book.redone_steps == 4 and book.kept_steps == 12
  assert sum(book.seconds.values()) == pytest.approx(book.wall_s)


def test_runs_without_a_supervisor_leave_the_gap_idle():
  """A preempted run resubmitted later: the time between the two is idle, nothing redone."""
  first = run_record(0.0, {"start": 1.0, "steps": 4.0}, 0, 4, status="preempted")
  second = run_record(60.0, {"start": 1.0, "steps": 4.0}, 4, 8)
  book = ledger([first, second])
  assert book.seconds["idle"] == pytest.approx(55.0) and book.redone_steps == 0 and book.kept_steps == 8
  assert book.wall_s == pytest.approx(65.0) and set(book.seconds) == set(LEDGER_CAUSES)


def test_a_run_blocked_past_the_failure_gives_that_time_to_detection():
  """A hang: process 1 stops after step 5 (last sign of life at 10 s); process 0, which writes the
  record, blocks in step 6's collective and runs on in the stop's grace (its laps end at 16 s);
  the supervisor detects at 13 s. 10 -> 13 s is detection, 13 -> the restart recovery, and the
  record's 6 s past the last sign of life leave its steps."""
  first = run_record(0.0, {"start": 2.0, "steps": 14.0}, 0, 8, status="running")
  second = run_record(20.0, {"steps": 2.0}, 5, 7, attempt=1)
  book = ledger([first, second], [{"event": "failure", "attempt": 0, "kind": "heartbeat_lost",
                                   "last_sign_of_life": 10.0, "detected_at": 13.0}])
  assert book.seconds["detection"] == pytest.approx(3.0) and book.seconds["recovery"] == pytest.approx(7.0)
  assert book.seconds["productive"] + book.seconds["redone"] == pytest.approx(8.0 + 2.0)
  assert book.redone_steps == 3 and book.attempts[0].end == 10.0
  assert sum(book.seconds.values()) == pytest.approx(book.wall_s) and book.wall_s == pytest.approx(22.0)
