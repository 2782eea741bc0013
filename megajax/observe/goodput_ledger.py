"""The goodput ledger of a job: its wall time, first launch to end, split into disjoint causes
that add up to it, from the records in WORKDIR/goodput/ (written by goodput.py) and, under
megajax-supervise, its events.

  productive   the steps kept in the final trajectory, at their run's mean step time
  redone       steps run but not kept: those after the checkpoint a restart resumed from (the
               failed attempt ran them, the next one ran them again), and those a non-finite
               rollback discarded (their updates thrown away)
  start setup restore compile data_wait checkpoint eval rollback shutdown
               each run's laps (goodput.CAUSES)
  detection    a failed attempt's last sign of life (the supervisor's: last beat, last progress
               for a hang) to the supervisor's detection
  recovery     detection to the next attempt's process start (stopping the job, diagnostics,
               relaunch); the new attempt's start-up and compile are their own causes (the
               attempts' table also gives detection to the next attempt's first finished step)
  idle         between two runs with no failure recorded (a preempted job waiting to be
               resubmitted)
  (the supervisor's own start and launch count as start, its noticing the job's end as shutdown)
  unaccounted  a failed run's time after its last record (killed between two of its writes)

The effective training time ratio (MegaScale section 6.3: "the number of iterations multiplied
by the iteration training time, divided by the total training time") is productive / wall:
kept iterations x their mean iteration time / wall time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os

from megajax.observe.records import read_jsonl

GOODPUT_DIR = "goodput"
SUPERVISOR_EVENTS = "supervisor.jsonl"
# A run's own causes, in the order of a run (goodput.GoodputClock laps them).
CAUSES = ("start", "setup", "restore", "compile", "steps", "data_wait", "checkpoint", "eval", "rollback",
          "shutdown")
LEDGER_CAUSES = ("productive", "redone", *(c for c in CAUSES if c != "steps"), "detection", "recovery", "idle",
                 "unaccounted")
# goodput/<group>_s: the causes summed by kind.
SCALAR_GROUPS = {"productive": ("productive",), "redone": ("redone",),
                 "startup": ("start", "setup", "restore", "compile", "shutdown"),
                 "in_loop": ("data_wait", "checkpoint", "eval"),
                 "failures": ("rollback", "detection", "recovery", "idle", "unaccounted")}


@dataclasses.dataclass
class Attempt:
  """One run in the job's timeline."""
  attempt: int
  process_start: float
  end: float                  # its last recorded lap
  start_step: int
  last_step: int
  steps_run: int
  redone_steps: int
  status: str                 # finished, preempted, error, running; "failed: <kind>" from the supervisor
  cache: dict
  seconds: dict               # its own causes (goodput.CAUSES, "steps" split into productive and redone)
  after: dict = dataclasses.field(default_factory=dict)   # the gap after it, by cause (detection, recovery, ...)
  resumed_s: float | None = None   # a failed attempt: its detection to the next attempt's first finished step


@dataclasses.dataclass
class Ledger:
  wall_s: float
  seconds: dict[str, float]          # LEDGER_CAUSES
  kept_steps: int
  redone_steps: int
  attempts: list[Attempt]
  start: float                       # the job's first launch, wall clock

  @property
  def ratio(self) -> float:
    """The effective training time ratio: productive / wall."""
    return self.seconds["productive"] / self.wall_s if self.wall_s > 0 else 0.0

  @property
  def iteration_s(self) -> float:
    return self.seconds["productive"] / self.kept_steps if self.kept_steps else 0.0

  def scalars(self) -> dict[str, float]:
    """goodput/* for metrics.jsonl, TensorBoard and W&B at each logged step: the ratio and the
    causes in five groups (a scalar costs TensorBoard ~0.1 ms; megajax-goodput has them all)."""
    return {"goodput/ratio": self.ratio,
            **{f"goodput/{group}_s": sum(self.seconds[c] for c in causes) for group, causes in SCALAR_GROUPS.items()}}


def goodput_dir(workdir: str) -> str:
  return os.path.join(workdir, GOODPUT_DIR)


def step_file(record_path: str) -> str:
  """A run record's .step file: its last step, written after every step (goodput.GoodputClock)."""
  return record_path[:-len(".json")] + ".step"


def read_runs(workdir: str) -> list[dict]:
  """The job's run records, oldest first (a half-written or foreign file is skipped), each with
  the last step its .step file holds if that is further (a run killed between two writes)."""
  runs = []
  for path in glob.glob(os.path.join(goodput_dir(workdir), "run-*.json")):
    try:
      with open(path) as f:
        record = json.load(f)
    except (OSError, json.JSONDecodeError):
      continue
    if isinstance(record, dict) and {"process_start", "time", "seconds", "start_step", "last_step"} <= record.keys():
      with contextlib.suppress(OSError, ValueError):    # no .step file, or a torn one: the record's own
        with open(step_file(path)) as f:
          record["last_step"] = max(record["last_step"], int(f.read().strip() or 0))
      runs.append(record)
  return sorted(runs, key=lambda r: r["process_start"])


def read_supervisor_events(workdir: str) -> list[dict]:
  path = os.path.join(goodput_dir(workdir), SUPERVISOR_EVENTS)
  return read_jsonl(path) if os.path.exists(path) else []


def ledger(runs: list[dict], events: list[dict] = (), now: float | None = None) -> Ledger | None:
  """The job's ledger from its run records and supervisor events (None: no run yet). `now`: the
  end of a job still running (the live ratio), else its last record or the supervisor's end."""
  if not runs:
    return None
  runs = sorted(runs, key=lambda r: r["process_start"])
  supervisor_start = next((e["time"] for e in events if e.get("event") == "start"), None)
  supervisor_end = next((e["time"] for e in reversed(events) if e.get("event") == "end"), None)
  failures = {e["attempt"]: e for e in events if e.get("event") == "failure"}
  start = min(runs[0]["process_start"], supervisor_start or runs[0]["process_start"])
  end = now if now is not None else max(supervisor_end or 0.0, max(r["time"] for r in runs))
  totals = dict.fromkeys(LEDGER_CAUSES, 0.0)
  totals["start"] += runs[0]["process_start"] - start      # the supervisor's own start, launching the first
  attempts = []
  for i, run in enumerate(runs):
    later = runs[i + 1] if i + 1 < len(runs) else None
    steps_run = run["last_step"] - run["start_step"]      # a run's steps are consecutive
    # Redone: the steps this run ran past the checkpoint the next run resumed from, and those its
    # rollbacks discarded (each step once: a rollback's steps may be past that checkpoint too),
    # at this run's mean step time.
    wasted = [(r["to_step"], r["step"]) for r in run.get("rollbacks", ())]
    if later and later["start_step"] < run["last_step"]:
      wasted.append((later["start_step"], run["last_step"]))
    redone = min(steps_run, union_length(wasted))
    seconds = {c: float(run["seconds"].get(c, 0.0)) for c in CAUSES}
    gap_end = later["process_start"] if later else end
    failure = failures.get(run.get("attempt")) if run.get("status") != "finished" else None
    run_end = run["time"]
    if failure is not None and failure.get("last_sign_of_life", run_end) < run_end:
      # This process's laps went on past the failure's last sign of life (blocked in a collective
      # on the failed peer, its own error's shutdown, steps in the stop's grace): that time is
      # the failure's, taken from its last causes.
      run_end = max(failure["last_sign_of_life"], run["process_start"])
      _take(seconds, run["time"] - run_end, ("shutdown", "steps", *reversed(CAUSES)))
    step_s = seconds["steps"] / steps_run if steps_run else 0.0
    own = {c: v for c, v in seconds.items() if c != "steps"}
    own["redone"] = redone * step_s
    own["productive"] = seconds["steps"] - own["redone"]
    for cause, value in own.items():
      totals[cause] += value
    # The gap to the next run (or to the job's end): a failure's parts, else idle.
    status = run.get("status", "running")
    if failure is not None:
      status = f"failed: {failure.get('kind')}"
      lost = _clamp(failure.get("last_sign_of_life", run_end), run_end, gap_end)
      detected = _clamp(failure.get("detected_at", lost), lost, gap_end)
      after = {"unaccounted": lost - run_end, "detection": detected - lost, "recovery": gap_end - detected}
    elif later:
      after = {"idle": max(0.0, gap_end - run_end)}
    else:                   # after the last run: the supervisor seeing the job end
      after = {"shutdown": max(0.0, gap_end - run_end)}
    for cause, value in after.items():
      totals[cause] += value
    resumed = (later["first_step_time"] - failure["detected_at"] if failure is not None and later
               and "first_step_time" in later and "detected_at" in failure else None)
    attempts.append(Attempt(run.get("attempt", 0), run["process_start"], run_end, run["start_step"],
                            run["last_step"], steps_run, redone, status, run.get("cache", {}), own, after,
                            resumed))
  redone_steps = sum(a.redone_steps for a in attempts)
  kept = sum(a.steps_run for a in attempts) - redone_steps
  return Ledger(end - start, totals, kept, redone_steps, attempts, start)


def _take(seconds: dict, amount: float, order) -> None:
  """Removes `amount` seconds from `seconds`' causes, in `order`, none below zero."""
  for cause in order:
    taken = min(amount, seconds[cause])
    seconds[cause] -= taken
    amount -= taken
    if amount <= 0:
      return


def union_length(intervals: list[tuple[float, float]]) -> float:
  """How much the half-open ranges (after, through] cover together (steps here; bench fbd's
  trace intervals too)."""
  covered, end = 0, None
  for after, through in sorted(intervals):
    after = after if end is None else max(after, end)
    if through > after:
      covered += through - after
      end = through
  return covered


def _clamp(value: float, low: float, high: float) -> float:
  return min(max(value, low), high)


def job_ledger(workdir: str, now: float | None = None, extra_run: dict | None = None) -> Ledger | None:
  """The ledger of the job in `workdir`; `extra_run`: a live run's record in place of its file."""
  runs = read_runs(workdir)
  if extra_run is not None:
    runs = [r for r in runs if (r["process_start"], r.get("pid")) != (extra_run["process_start"], extra_run.get("pid"))]
    runs.append(extra_run)
  return ledger(runs, read_supervisor_events(workdir), now)


_NAMES = {"productive": "productive steps (kept in the final trajectory)", "redone": "steps run again / discarded",
          "start": "process start, imports, jax.distributed join", "setup": "model, mesh, data, workdir",
          "restore": "checkpoint restore (or init)", "compile": "compilation", "data_wait": "waiting for data",
          "checkpoint": "checkpoint saves (the step blocked)", "eval": "evaluation",
          "rollback": "non-finite rollbacks", "shutdown": "export and shutdown",
          "detection": "failure detection", "recovery": "recovery (stop, diagnose, relaunch)",
          "idle": "idle between runs", "unaccounted": "unaccounted (after a run's last record)"}


def format_table(book: Ledger) -> str:
  """The ledger as text: causes with seconds and shares, the ratio with the paper's formula, the
  attempts."""
  lines = [f"{'cause':48} {'seconds':>10} {'share':>7}"]
  for cause in LEDGER_CAUSES:
    seconds = book.seconds[cause]
    lines.append(f"{_NAMES[cause]:48} {seconds:>10.2f} {100 * seconds / book.wall_s if book.wall_s else 0:>6.1f}%")
  lines.append(f"{'wall time, first launch to end':48} {book.wall_s:>10.2f} {100.0:>6.1f}%")
  lines.append(f"effective training time ratio (MegaScale 6.3: iterations x iteration time / total time) = "
               f"{book.kept_steps} x {book.iteration_s:.4f} s / {book.wall_s:.2f} s = {100 * book.ratio:.1f}%")
  lines.append(f"steps kept {book.kept_steps}, run again or discarded {book.redone_steps}")
  lines.append(f"{'attempt':>7} {'start s':>8} {'end s':>8} {'steps':>11} {'run':>5} {'redone':>6} {'compile s':>9} "
               f"{'cache hit/miss':>14}  how it ended")
  for a in book.attempts:
    resumed = f", its detection to the next attempt's first step {a.resumed_s:.1f} s" if a.resumed_s is not None else ""
    lines.append(f"{a.attempt:>7} {a.process_start - book.start:>8.1f} {a.end - book.start:>8.1f} "
                 f"{f'{a.start_step}->{a.last_step}':>11} {a.steps_run:>5} {a.redone_steps:>6} "
                 f"{a.seconds['compile']:>9.2f} {'{}/{}'.format(a.cache.get('hits', 0), a.cache.get('misses', 0)):>14}"
                 f"  {a.status}{resumed}")
  return "\n".join(lines)
