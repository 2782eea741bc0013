"""Worker heartbeats: what each training process is doing, as a file in the shared workdir.

Every process writes WORKDIR/heartbeats/process_<i>.json every `interval` seconds from a
daemon thread (atomically: write, then rename), so the supervisor (megajax.launch.supervisor)
needs nothing but the shared filesystem the checkpoints already use, and no listener is
opened. The thread keeps beating while the main thread waits in a collective, so a live
but stuck worker (a victim) still beats with an unchanging step and phase; a stopped or
dead one (a suspect) goes silent.

A beat: {"process", "host", "pid", "time", "attempt", "step" (the last step known finished),
"phase" (e.g. "step 12", "checkpoint save 100", "restore"), "step_time_s", "loss",
"skipped_steps", "rollbacks", "start_step", "startup_s", "devices": [{"id", "coords"}],
"errors": [log keywords seen], "done"}.

Both ends of the file are here: `Heartbeat` (written by every megajax-train process with a
workdir, from the training loop) and `read_heartbeats` (read by the supervisor).
"""

from __future__ import annotations

import json
import logging as std_logging
import os
import socket
import threading
import time

from megajax.observe.records import write_atomically

HEARTBEAT_DIR = "heartbeats"
REQUIRED_FIELDS = ("process", "time", "attempt", "step", "phase", "start_step", "rollbacks", "done")


def supervisor_attempt() -> int:
  """This process's attempt under megajax-supervise (MEGAJAX_ATTEMPT, which its jobs set; 0
  for the first attempt and for a process started without a supervisor)."""
  return int(os.environ.get("MEGAJAX_ATTEMPT", "0"))


# Words in a worker's own log lines that point at the cause of a failure (MegaScale 4.2:
# the driver scans the logs for error keywords).
ERROR_KEYWORDS = ("nccl", "cuda", "xid", "ecc", "out of memory", "timeout", "deadline", "xlaruntimeerror",
                  "connection", "gloo", "nan")


def heartbeat_path(workdir: str, process: int) -> str:
  return os.path.join(workdir, HEARTBEAT_DIR, f"process_{process}.json")


def read_heartbeats(workdir: str) -> dict[int, dict]:
  """{process index: its latest beat}; files that are missing or half-written are left out."""
  directory = os.path.join(workdir, HEARTBEAT_DIR)
  beats = {}
  for name in os.listdir(directory) if os.path.isdir(directory) else ():
    if name.startswith("process_") and name.endswith(".json"):
      try:
        with open(os.path.join(directory, name)) as f:
          beat = json.load(f)
      except (OSError, ValueError):
        continue
      if isinstance(beat, dict) and all(key in beat for key in REQUIRED_FIELDS):
        beats[beat["process"]] = beat
  return beats


class _KeywordScanner(std_logging.Handler):
  """Collects the error keywords that appear in this process's WARNING-and-above log records."""

  def __init__(self, found: set):
    super().__init__(level=std_logging.WARNING)
    self.found = found

  def emit(self, record):
    try:
      text = record.getMessage().lower()
    except Exception:  # pylint: disable=broad-except  (a bad format string must not stop training)
      return
    self.found.update(word for word in ERROR_KEYWORDS if word in text)


class Heartbeat:
  """Writes this process's beat every `interval` seconds; `update(...)` changes its fields."""

  def __init__(self, workdir: str, process: int, devices: list[dict], interval: float = 1.0):
    self._path = heartbeat_path(workdir, process)
    os.makedirs(os.path.dirname(self._path), exist_ok=True)
    self._interval = interval
    self._lock = threading.Lock()
    self._errors: set = set()
    self._fields = {"process": process, "host": socket.gethostname(), "pid": os.getpid(),
                    "attempt": supervisor_attempt(), "step": 0, "phase": "start",
                    "step_time_s": None, "loss": None, "skipped_steps": 0, "rollbacks": 0, "start_step": 0,
                    "startup_s": None, "devices": devices, "done": False}
    self._scanner = _KeywordScanner(self._errors)
    std_logging.getLogger().addHandler(self._scanner)
    self._stop = threading.Event()
    self.write()
    self._thread = threading.Thread(target=self._beat, name="megajax-heartbeat", daemon=True)
    self._thread.start()

  def update(self, **fields) -> None:
    with self._lock:
      self._fields.update(fields)

  def write(self) -> None:
    """Writes the beat now (the thread writes it every `interval` seconds)."""
    with self._lock:
      beat = {**self._fields, "time": time.time(), "errors": sorted(self._errors)}
    write_atomically(self._path, json.dumps(beat))

  def _beat(self) -> None:
    while not self._stop.wait(self._interval):
      try:
        self.write()
      except OSError:     # a full or flaky filesystem: the supervisor sees a missed beat
        pass

  def close(self, done: bool = False) -> None:
    self._stop.set()
    self._thread.join(timeout=5)
    std_logging.getLogger().removeHandler(self._scanner)
    self.update(done=done, phase="done" if done else self._fields["phase"])
    try:
      self.write()
    except OSError:     # the last beat is informative; never mask how the run ended
      pass
