"""Goodput: where a job's wall time goes, across its restarts (MegaScale section 6.3's "effective
training time rate": iterations x iteration time / total time), written as the job runs.

Files in WORKDIR/goodput/ (read by goodput_ledger.Ledger):

  run-<start ms>-<pid>.json  one per training process run (process 0 of each attempt writes it):
                             its process start, the seconds spent in each cause so far, the
                             steps it ran and the last one, the steps rollbacks discarded, the
                             compilation cache's hits and misses, how it ended. Rewritten
                             atomically by a thread every `interval` seconds while it changes, at
                             each save and at the end, so a run killed between two writes loses
                             at most `interval` seconds of its record (the ledger's unaccounted).
  run-<...>.step             the run's last step, rewritten in place after every step (its steps
                             are consecutive from its start step: the count follows).
  supervisor.jsonl           megajax-supervise's events, appended: its start, each attempt's start,
                             each failure (the worker's last sign of life, the detection), its end.

A run's time is a stopwatch of laps (`GoodputClock.lap`): each lap charges the time since the
previous one to one cause, so a run's causes add up to its time from process start to its last
lap, whatever the mix. The causes (CAUSES): start (process start to train(): imports,
jax.distributed's join, the workdir's lock), setup (model, mesh, step, data, workdir files),
restore (the checkpoint read, or the fresh init), compile (the step's, evaluation's and
checksums' compiles and the start barrier), steps (the loop's steps: the step's dispatch and
wait, logging, the callbacks not named below), data_wait (the loop waiting for its batch),
checkpoint (the step blocked by a save: device -> host; the last save's commit), eval
(held-out evaluation), rollback (the non-finite rollback's restore), shutdown (after the loop:
the export, closing).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time

import jax
import psutil

from megajax.observe import goodput_ledger
from megajax.observe.goodput_ledger import CAUSES, SUPERVISOR_EVENTS, goodput_dir, step_file
from megajax.observe.records import write_atomically

def process_start_time() -> float:
  """This process's start, wall clock, to the kernel's clock tick (10 ms). psutil's create_time
  adds the tick count to the boot time in whole seconds (/proc/stat's btime): up to 1 s early.
  Here the tick count is taken from the time since boot instead (Linux); psutil elsewhere."""
  try:
    with open("/proc/self/stat") as f:
      ticks = int(f.read().rsplit(")", 1)[1].split()[19])      # field 22, starttime
    since_start = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - since_start
  except (OSError, ValueError, IndexError, AttributeError):
    return psutil.Process().create_time()


_RUNS_IN_THIS_PROCESS = [0]


class GoodputClock:
  """This run's laps by cause and its steps, counted from its start: the process's for the
  first run in a process, the call's for a later one (the Python API training twice). `open`
  starts its file (process 0 of a run with a workdir, once the workdir is this job's)."""

  def __init__(self, attempt: int = 0, started: float | None = None):
    if started is None:
      _RUNS_IN_THIS_PROCESS[0] += 1
      started = process_start_time() if _RUNS_IN_THIS_PROCESS[0] == 1 else time.time()
    self.started = started
    self.seconds = dict.fromkeys(CAUSES, 0.0)
    self.record = {"process_start": self.started, "attempt": attempt, "pid": os.getpid(), "start_step": 0,
                   "last_step": 0, "rollbacks": [],
                   "cache": {"hits": 0, "misses": 0}, "status": "running"}
    self._wall = time.time()
    self._mono = time.monotonic()
    self.seconds["start"] = max(0.0, self._wall - self.started)
    self._lock = threading.Lock()
    self._changed = threading.Event()
    self._stop = threading.Event()
    self.path = self.workdir = None
    self._earlier = None      # (earlier runs' records, the supervisor's events), read once
    self._step_fd = None      # the record's .step file, open for writing

  def open(self, workdir: str, interval: float = 2.0) -> None:
    """Writes this run's record in WORKDIR/goodput/ from now on: at once, then every `interval`
    seconds while it changes (a thread), at `flush` and at `close`."""
    self.workdir = workdir
    os.makedirs(goodput_dir(workdir), exist_ok=True)
    self.path = os.path.join(goodput_dir(workdir), f"run-{int(self.started * 1000)}-{os.getpid()}.json")
    self._step_fd = os.open(step_file(self.path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    self.flush()
    self._thread = threading.Thread(target=self._flusher, args=(interval,), name="megajax-goodput", daemon=True)
    self._thread.start()

  # --- Counting (the main thread).

  def lap(self, cause: str) -> None:
    """The time since the previous lap, charged to `cause`."""
    now = time.monotonic()
    with self._lock:
      self.seconds[cause] += now - self._mono
      self._mono, self._wall = now, self._wall + (now - self._mono)
    self._changed.set()

  def lap_after(self, cause: str, arrays) -> None:
    """A lap once `arrays` are computed: what a save or an evaluation waits for is charged to
    the step that computes it, not to them."""
    jax.block_until_ready(arrays)
    self.lap(cause)

  def finished(self, step: int) -> None:
    """Step `step` computed (its metrics read: the non-finite guard reads each step's one step
    late, and every step at a save and at the end), so the steps this run ran are its start step
    to `step` (consecutive: their count is last_step - start_step): a step dispatched but never finished (a peer died under it) is not
    counted. Written at once into the record's .step file (20 bytes in place: a few
    microseconds): a run killed between two of the record's writes leaves them on record, which
    the ledger's redone count needs."""
    with self._lock:
      if step <= self.record["last_step"]:
        return
      self.record["last_step"] = step
      self.record.setdefault("first_step_time", time.time())
    if self._step_fd is not None:
      with contextlib.suppress(OSError):    # a full or flaky filesystem: the record's next write has it
        os.pwrite(self._step_fd, f"{step:>19}\n".encode(), 0)
    self._changed.set()

  def discarded(self, step: int, to_step: int) -> None:
    """A rollback at `step` back to the state of `to_step`: the updates after it are lost."""
    with self._lock:
      self.record["rollbacks"].append({"step": step, "to_step": to_step})
    self._changed.set()

  def set_start_step(self, step: int) -> None:
    with self._lock:
      self.record["start_step"] = self.record["last_step"] = step
    self._changed.set()

  def set_cache(self, counts: dict) -> None:
    with self._lock:
      self.record["cache"] = dict(counts)

  def snapshot(self) -> dict:
    """This run's record as the file holds it (`time`: the wall clock of the last lap)."""
    with self._lock:
      return {**self.record, "rollbacks": list(self.record["rollbacks"]), "time": self._wall,
              "seconds": dict(self.seconds)}

  def live_scalars(self) -> dict:
    """goodput/* of the job so far (its earlier runs' records read once), this run's as it
    stands: {} for a run that writes no record (no workdir, a process other than 0)."""
    if not self.path:
      return {}
    if self._earlier is None:
      self._earlier = ([r for r in goodput_ledger.read_runs(self.workdir) if r["process_start"] < self.started],
                       goodput_ledger.read_supervisor_events(self.workdir))
    runs, events = self._earlier
    book = goodput_ledger.ledger([*runs, self.snapshot()], events, now=time.time())
    return book.scalars()

  # --- Writing.

  def flush(self) -> None:
    if self.path:
      write_atomically(self.path, json.dumps(self.snapshot()))

  def _flusher(self, interval: float) -> None:
    while not self._stop.wait(interval):
      if self._changed.is_set():
        self._changed.clear()
        with contextlib.suppress(OSError):    # a full or flaky filesystem: the next write tries again
          self.flush()

  def close(self, status: str) -> None:
    """The last lap ("shutdown"), how the run ended ("finished", "preempted", "error"), written."""
    self.lap("shutdown")
    with self._lock:
      self.record["status"] = status
    self._stop.set()
    if self.path:
      self._thread.join(timeout=5)
      with contextlib.suppress(OSError):    # the record is informative; never mask how the run ended
        self.flush()
      os.close(self._step_fd)


def append_supervisor_event(workdir: str, event: str, **fields) -> None:
  """One line of WORKDIR/goodput/supervisor.jsonl: {"event", "time", ...}."""
  os.makedirs(goodput_dir(workdir), exist_ok=True)
  with open(os.path.join(goodput_dir(workdir), SUPERVISOR_EVENTS), "a") as f:
    f.write(json.dumps({"event": event, "time": time.time(), **fields}) + "\n")
