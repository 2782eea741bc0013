"""The workdir in process: its checks, the one-job lock (held, refused, taken over from a
dead holder), and a checkpoint save that fails on a full disk. (Jobs on one workdir, and
the launcher's one-line failures: tests/e2e/test_workdir.py.)"""

import glob
import json
import logging
import os
import socket
import threading
import time

import jax
import orbax.checkpoint as ocp
import pytest

from megajax.checkpoint import CheckpointError, TrainingCheckpointer
from megajax.trainer.workdir import LOCK_FILE, WorkdirError, WorkdirLock, check_workdir, claim_workdir
from tests.support.checkpoints import restore_latest
from tests.support.processes import HANG_S   # a hang guard only: each wait ends on its event


def _holder(workdir) -> dict:
  return json.loads((workdir / LOCK_FILE).read_text() or "null")


def test_a_workdir_that_is_a_file_or_under_one_is_refused(tmp_path):
  (tmp_path / "file").write_text("not a directory")
  with pytest.raises(WorkdirError, match=r"file is a file, not a directory"):
    check_workdir(str(tmp_path / "file"))
  with pytest.raises(WorkdirError, match=r"cannot make the workdir .*file/run: Not a directory"):
    check_workdir(str(tmp_path / "file" / "run"))
  assert check_workdir(str(tmp_path / "new" / "run")) == str(tmp_path / "new" / "run")   # made when missing
  assert os.listdir(tmp_path / "new" / "run") == []                                      # the write test left nothing


def test_a_workdir_no_one_may_write_is_refused():
  """sysfs: a directory where no process, root included, may make files (chmod would not stop
  root; sysfs refuses everyone, and containers mount it read-only)."""
  assert os.path.isdir("/sys/kernel")
  with pytest.raises(WorkdirError, match=r"^the workdir /sys/kernel is not writable: "):
    check_workdir("/sys/kernel")
  with pytest.raises(WorkdirError, match=r"^cannot make the workdir /sys/kernel/megajax-run: "):
    check_workdir("/sys/kernel/megajax-run")


def test_the_lock_names_its_holder_refuses_a_second_and_is_free_after(tmp_path):
  """flock conflicts between two opens of the file, even in one process: the second is
  refused with the holder's host, pid and since; a released lock names no one."""
  with claim_workdir(str(tmp_path), timeout_s=10):
    holder = _holder(tmp_path)
    assert holder["host"] == socket.gethostname() and holder["pid"] == os.getpid() and holder["since"]
    with pytest.raises(WorkdirError) as refused:
      WorkdirLock(str(tmp_path)).acquire()
    assert (f"{tmp_path} is in use by another training job: process {os.getpid()} on host {socket.gethostname()} "
            f"(since {holder['since']})") in str(refused.value)
  assert _holder(tmp_path) is None
  with WorkdirLock(str(tmp_path)):                 # free again
    assert _holder(tmp_path)["pid"] == os.getpid()


def test_the_lock_of_a_dead_process_is_taken_over_with_a_warning(tmp_path, caplog):
  """A holder killed while holding it leaves its name and no flock (the kernel dropped it)."""
  with open("/proc/sys/kernel/pid_max") as f:
    dead = int(f.read())                   # pids are below it: no process has this one
  (tmp_path / LOCK_FILE).write_text(json.dumps({"host": "node-7", "pid": dead, "since": "2025-01-02 03:04:05"}))
  with caplog.at_level("WARNING"), WorkdirLock(str(tmp_path)):
    assert _holder(tmp_path)["pid"] == os.getpid()
  assert (f"taking over from process {dead} on host node-7 (since 2025-01-02 03:04:05), which ended without "
          "releasing it") in caplog.text


class _ReleaseWhenWaiting(logging.Handler):
  """Lets the previous holder go once the relaunch says it waits for it."""

  def __init__(self, previous):
    super().__init__()
    self.previous = previous

  def emit(self, record):
    if "waiting up to" in record.getMessage():
      self.previous.release()


def test_a_relaunch_waits_for_the_previous_holder_to_let_go(tmp_path, caplog):
  """A supervisor's relaunch may start while the previous attempt's processes are still stopping."""
  previous, relaunched = WorkdirLock(str(tmp_path)), WorkdirLock(str(tmp_path))
  previous.acquire()
  release = _ReleaseWhenWaiting(previous)
  logging.getLogger().addHandler(release)
  try:
    with caplog.at_level("WARNING"):
      relaunched.acquire(wait_s=120)
  finally:
    logging.getLogger().removeHandler(release)
  assert _holder(tmp_path)["pid"] == os.getpid()
  relaunched.release()
  assert f"{tmp_path / LOCK_FILE} is held by process {os.getpid()}" in caplog.text
  assert "waiting up to 120 s for it to let go" in caplog.text and "taking over" not in caplog.text


# --- A save that fails.

class _WriteToAFullDisk:
  """An Orbax commit future (the background write of a save) that, once the test lets it go,
  writes to /dev/full: the kernel's real "No space left on device"."""

  def __init__(self):
    self._go = threading.Event()

  def go(self):
    self._go.set()

  def result(self, timeout=None):
    assert self._go.wait(timeout=HANG_S), "the test never let the write go"
    with open("/dev/full", "w") as f:
      f.write("the last bytes of a checkpoint")
      f.flush()


def _write_again_once_removed(partial: str):
  """A write still in flight when the save's first failure is reported (tensorstore's): once
  the partial directory `partial` has been removed, it is made again."""
  deadline = time.monotonic() + HANG_S
  while os.path.exists(partial):
    assert time.monotonic() < deadline, "the partial save was never removed"
    time.sleep(0.005)
  os.makedirs(os.path.join(partial, "state", "d"))
  with open(os.path.join(partial, "state", "d", "late"), "w") as f:
    f.write("a chunk written after the first write failed")


def test_a_save_that_fails_in_the_background_is_reported_at_the_next_step(two_checkpoints):
  """Reported by the per-step check alone (no further save needed), naming the checkpoint,
  the error and the free space; the partial save is removed, also what a write still in flight
  makes after the first removal, and checkpoint 6 still restores."""
  workdir, config, parallel_step = two_checkpoints
  checkpointer = TrainingCheckpointer(str(workdir / "checkpoints"), config)
  handler, write = ocp.PyTreeCheckpointHandler, _WriteToAFullDisk()   # the state item's
  original = handler.async_save

  async def async_save_onto_a_full_disk(self, *args, **kwargs):
    return [*(await original(self, *args, **kwargs) or []), write]

  handler.async_save = async_save_onto_a_full_disk
  late_write = None
  try:
    checkpointer.save(7, parallel_step.init_state(jax.random.key(0)), {"next_index": 7})
    checkpointer.check_for_errors(7)                # still writing: nothing to say yet
    deadline = time.monotonic() + HANG_S
    while not (partial := glob.glob(str(workdir / "checkpoints" / "7.orbax-checkpoint-tmp*"))):
      assert time.monotonic() < deadline, "the save made no partial directory"   # (nothing fails before go())
      time.sleep(0.005)
    late_write = threading.Thread(target=_write_again_once_removed, args=(partial[0],))
    late_write.start()
    write.go()
    deadline = time.monotonic() + HANG_S
    with pytest.raises(CheckpointError) as failed:
      while time.monotonic() < deadline:            # the steps after it (10 ms each), each checking
        checkpointer.check_for_errors(8)
        time.sleep(0.01)
  finally:
    handler.async_save = original
    if late_write:
      late_write.join()
    checkpointer.close()
  message = str(failed.value)
  assert message.startswith(f"saving checkpoint {workdir}/checkpoints/7 failed (found after step 8): ")
  assert "No space left on device" in message and "free of" in message and f"on {workdir}/checkpoints" in message
  assert message.endswith(f"the last committed checkpoint, {workdir}/checkpoints/6, is kept: a relaunch resumes from it")
  assert sorted(os.listdir(workdir / "checkpoints")) == ["3", "6"]      # no orbax-checkpoint-tmp left
  assert restore_latest(workdir, config, parallel_step).step == 6
