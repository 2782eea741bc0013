"""The workdir: checked before it is used, and one training job's alone.

`claim_workdir(workdir)` is the first thing train() does with a workdir, before anything is
written into it (config.json, heartbeats, checkpoints, metrics.jsonl, the compilation cache
jax makes at the first compile), and it is held until train() returns, the export included:

- every process checks that the workdir is a directory it can write (`check_workdir`, made
  if missing): a regular file, a read-only filesystem, a directory it may not write is one
  WorkdirError naming the path and the reason, never a traceback from deep inside a save;
- process 0 takes WORKDIR/lock (`WorkdirLock`): an exclusive flock on the open file, and a
  JSON body naming the holder {host, pid, since}. A second job finds it taken and fails at
  once, naming the holder; the other processes of the job take nothing (they are not blocked).
  Every process learns the others' verdicts (jax.distributed's key-value store) before it goes
  on, so a refused job's other processes write no heartbeat either.

The kernel drops a flock with the last descriptor of its open file, so the lock goes with the
process however that ends (an exception, SIGKILL, a host's crash on NFSv4 once its lease
lapses): a supervisor that relaunches on the same workdir after its job exited finds it free.
A clean release empties the body; a body found in a free lock is the name of a holder that
died holding it, and taking it over says so. A supervisor's relaunch (MEGAJAX_ATTEMPT > 0)
waits up to RELAUNCH_WAIT_S for a holder to go: the previous attempt's processes may still be
stopping (a pod in its grace period, a task slurmd has yet to kill). Caveats: a process forked (not exec'd) by the
holder would hold the flock too (megajax forks none); Lustre locks across hosts only when
mounted with -o flock; where a filesystem cannot lock at all, training goes on with a warning.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import json
import os
import socket
import tempfile
import time

from absl import logging
import jax
from jax._src import distributed

from megajax.checkpoint.manager import free_space
from megajax.trainer.heartbeat import supervisor_attempt

LOCK_FILE = "lock"                 # the training job's (its process 0's)
SUPERVISOR_LOCK_FILE = "supervisor.lock"   # megajax-supervise's, held across its attempts
HOLDER_WRITE_WAIT_S = 2.0    # how long a refused job waits for a holder that just locked to write its name
RELAUNCH_WAIT_S = 120.0      # how long a supervisor's relaunch waits for the previous attempt to let go
_CLAIMS = itertools.count()  # a claim's key is used once per job: numbered, for a process that trains twice


class WorkdirError(Exception):
  """The workdir cannot be used: not a directory, not writable, or held by another job."""


def check_workdir(workdir: str) -> str:
  """The workdir's absolute path, made if missing; WorkdirError unless this process can write in it."""
  path = os.path.abspath(workdir)
  if os.path.exists(path) and not os.path.isdir(path):
    raise WorkdirError(f"{path} is a file, not a directory; give --workdir a directory (made if missing)")
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as error:
    raise WorkdirError(f"cannot make the workdir {path}: {_reason(error, path)}") from error
  try:
    # A real write, not os.access (which says yes to root on any mode, and cannot see an NFS
    # server's refusal); an unnamed file (O_TMPFILE) leaves nothing behind.
    with tempfile.TemporaryFile(dir=path) as probe:
      probe.write(b"\0")
      probe.flush()
  except OSError as error:
    raise WorkdirError(f"the workdir {path} is not writable: {_reason(error, path)}") from error
  return path


def _reason(error: OSError, path: str) -> str:
  """'Permission denied', with the path that refused when it is above `path` (a parent), and
  the free space when the disk is full."""
  reason = error.strerror or str(error)
  refused = os.path.abspath(error.filename) if error.filename else path
  if refused != path and not refused.startswith(path + os.sep):
    reason += f" ({refused})"
  if error.errno in (errno.ENOSPC, errno.EDQUOT):
    reason += f"; {free_space(path)}"
  return reason


class WorkdirLock:
  """WORKDIR/lock (or another `name`), held by this process from acquire() to release()."""

  def __init__(self, workdir: str, name: str = LOCK_FILE):
    self.workdir = os.path.abspath(workdir)
    self.path = os.path.join(self.workdir, name)
    self._file = None

  def acquire(self, wait_s: float = 0.0) -> None:
    """Takes the lock, waiting up to `wait_s` for a holder to let go, or raises WorkdirError
    naming the holder (host, pid, since)."""
    try:
      # Opened without truncating: the holder's name stays readable to whoever finds it taken.
      file = open(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644), "r+")
    except OSError as error:
      raise WorkdirError(f"cannot open the workdir's lock {self.path}: {_reason(error, self.workdir)}") from error
    deadline, said = time.monotonic() + wait_s, False
    while True:
      try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        break
      except BlockingIOError:
        holder = _holder_of(file)
        if time.monotonic() >= deadline:
          file.close()
          raise WorkdirError(f"{self.workdir} is in use by another training job: {_describe(holder)} holds "
                             f"{self.path}; stop that job, or give this one another --workdir") from None
        if not said:
          logging.warning("%s is held by %s: waiting up to %.0f s for it to let go", self.path, _describe(holder),
                          wait_s)
          said = True
        time.sleep(0.5)
      except OSError as error:     # a filesystem without locks: say so, and train unguarded
        logging.warning("%s: this filesystem cannot lock (%s); nothing stops a second job from using the workdir",
                        self.path, error.strerror)
        break
    previous = _read_holder(file)
    if previous:
      logging.warning("%s: taking over from %s, which ended without releasing it (killed or crashed)", self.path,
                      _describe(previous))
    me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S %z")}
    try:
      _rewrite(file, json.dumps(me) + "\n")
    except OSError as error:
      file.close()
      raise WorkdirError(f"cannot write the workdir's lock {self.path}: {_reason(error, self.workdir)}") from error
    self._file = file

  def release(self) -> None:
    """Empties the body (a free lock names no one) and lets go; a no-op when not held."""
    if self._file is None:
      return
    with contextlib.suppress(OSError):     # a full or gone filesystem: the lock goes with the file anyway
      _rewrite(self._file, "")
    self._file.close()                     # closing the last descriptor drops the flock
    self._file = None

  def __enter__(self) -> "WorkdirLock":
    self.acquire()
    return self

  def __exit__(self, *exc_info) -> None:
    self.release()


def _rewrite(file, text: str) -> None:
  file.seek(0)
  file.truncate()
  file.write(text)
  file.flush()


def _read_holder(file) -> dict | None:
  file.seek(0)
  try:
    holder = json.loads(file.read() or "null")
  except ValueError:
    return None
  return holder if isinstance(holder, dict) else None


def _holder_of(file) -> dict | None:
  """The holder's name; a holder that has just locked writes it a moment later."""
  deadline = time.monotonic() + HOLDER_WRITE_WAIT_S
  while (holder := _read_holder(file)) is None and time.monotonic() < deadline:
    time.sleep(0.05)
  return holder


def _describe(holder: dict | None) -> str:
  if not holder:
    return "a process that has not written its name"
  return f"process {holder.get('pid')} on host {holder.get('host')} (since {holder.get('since')})"


@contextlib.contextmanager
def claim_workdir(workdir: str | None, timeout_s: float):
  """The workdir as this job's (nothing without one): checked by every process, locked by
  process 0, until the block ends. Raises WorkdirError on every process when any of them
  cannot use it; the processes wait up to `timeout_s` for each other's checks."""
  if not workdir:
    yield
    return
  lock, problem = None, ""
  try:
    check_workdir(workdir)
    if jax.process_index() == 0:
      lock = WorkdirLock(workdir)
      lock.acquire(RELAUNCH_WAIT_S if supervisor_attempt() > 0 else 0.0)
  except WorkdirError as error:
    lock, problem = None, str(error)
  try:
    problem = _first_problem(problem, timeout_s)
    if problem:
      raise WorkdirError(problem)
    yield
  finally:
    if lock is not None:
      lock.release()


def _first_problem(problem: str, timeout_s: float) -> str:
  """The lowest-numbered process's problem ('' when none has one), known to every process:
  through the coordination service's key-value store, after a barrier they all reach."""
  if jax.process_count() == 1:
    return problem
  client, key = distributed.global_state.client, f"megajax_workdir_{next(_CLAIMS)}"
  try:
    client.key_value_set(f"{key}/{jax.process_index()}", problem or "ok")
    client.wait_at_barrier(key, int(timeout_s * 1000))
    answers = dict(client.key_value_dir_get(f"{key}/"))
  except Exception as error:  # pylint: disable=broad-except  (the coordination service's timeout or loss)
    raise WorkdirError(problem or f"the job's processes did not all check the workdir within {timeout_s:g} s "
                       f"({type(error).__name__}: {str(error).splitlines()[0][:200]})") from None
  problems = sorted((int(name.rsplit("/", 1)[1]), value) for name, value in answers.items() if value != "ok")
  return problems[0][1] if problems else ""

