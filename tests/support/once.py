"""A result made once per test run, whichever xdist worker asks first (pytest-xdist's recipe for
a session-wide fixture: a directory all workers share, and a file lock)."""

import fcntl
import os
import shutil

# The run's tmp_path_factory (tests/conftest.py registers it), for helpers called without one.
RUN_TMP_PATH_FACTORY = None


def once_per_run(tmp_path_factory, name: str, make):
  """`make(path)` fills the directory `path` once for the whole run; every caller gets `path`.
  Under xdist the workers share it: the first one makes it, the others wait on the lock.
  tmp_path_factory=None: the run's (RUN_TMP_PATH_FACTORY)."""
  root = (tmp_path_factory or RUN_TMP_PATH_FACTORY).getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    root = root.parent                      # the run's directory, above each worker's
  path, done = root / name, root / f"{name}.done"
  with open(root / f"{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
      if not done.exists():
        shutil.rmtree(path, ignore_errors=True)      # what a failed earlier attempt left
        make(path)
        done.touch()
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)
  return path
