"""megajax-train and its workdir: one job per workdir, and a workdir that cannot be used, a
disk that fills during a save or no readable checkpoint each end the run with one line and
exit code 2: no traceback before it or after it."""

import json
import os
import re
import signal
import socket
import subprocess
import sys

import jax

from megajax.observe.records import METRICS, read_jsonl
from megajax.trainer import train
from megajax.trainer.workdir import WorkdirLock
from tests.support import REPO
from tests.support.checkpoints import parallel_step_for, restore_latest, truncate_arrays
from tests.support.processes import HANG_S, child_env, launch_two_processes, wait_until
from tests.support.records import metrics

TRAIN = [sys.executable, "-m", "megajax.launch.train"]
_LOG_LINE = re.compile(r"[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] ")


def _config_file(tmp_path, config) -> str:
  """`config` as a config file for the launcher."""
  path = tmp_path / "config.py"
  path.write_text(f"import ml_collections\n\n\ndef get_config():\n  return ml_collections.ConfigDict({config.to_dict()!r})\n")
  return str(path)


def _flags(workdir, config_file, *more) -> list[str]:
  return [f"--config={config_file}", f"--workdir={workdir}", *more]


def _one_line(returncode: int, stderr: str, kind: str) -> str:
  """Exit code 2 and `megajax-train: <kind>: ...` as the last line; every other line is a log
  line (no traceback, no echo of abandoned I/O)."""
  lines = [line for line in stderr.splitlines() if line.strip()]
  assert returncode == 2, stderr[-3000:]
  assert lines and lines[-1].startswith(f"megajax-train: {kind}: "), stderr[-3000:]
  strays = [line for line in lines[:-1] if not _LOG_LINE.match(line)]
  assert not strays, "\n".join(strays[:20])
  return lines[-1]


def _start(command, log_path) -> subprocess.Popen:
  with open(log_path, "w") as log:      # a file, not a pipe nobody reads (a full pipe stalls the writer)
    return subprocess.Popen(command, cwd=REPO, env=child_env(), stdout=subprocess.DEVNULL, stderr=log)


def test_one_training_job_per_workdir(tmp_path, tiny_config):
  """Two launchers started together on one workdir: exactly one trains; the other exits 2 at
  once (the first still training) with one line naming it (host, pid, since). So does a third
  started while the first trains. metrics.jsonl and the heartbeats are the trainer's alone."""
  workdir, config = tmp_path / "run", _config_file(tmp_path, tiny_config)
  command = [*TRAIN, *_flags(workdir, config, "--config.train.steps=100000", "--config.checkpoint.every_steps=5",
                              "--config.train.log_every=1")]
  jobs = [_start(command, tmp_path / f"job_{i}.log") for i in range(2)]
  try:
    wait_until(lambda: any(job.poll() is not None for job in jobs), "one of the two to stop")
    refused = 0 if jobs[0].poll() is not None else 1
    trainer = jobs[1 - refused]
    assert trainer.poll() is None, (tmp_path / f"job_{1 - refused}.log").read_text()[-3000:]
    holder = f"{workdir} is in use by another training job: process {trainer.pid} on host {socket.gethostname()} (since "
    stderr = (tmp_path / f"job_{refused}.log").read_text()
    assert holder in _one_line(jobs[refused].returncode, stderr, "workdir error")
    later = subprocess.run(command, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=HANG_S)
    assert holder in _one_line(later.returncode, later.stderr, "workdir error")
    assert trainer.poll() is None
    wait_until(lambda: (workdir / METRICS).exists() and any("loss" in r for r in read_jsonl(workdir / METRICS)),
               "the trainer's first step")     # (read leniently while it writes; strictly below)
    trainer.send_signal(signal.SIGTERM)     # saves and stops (143)
    assert trainer.wait(timeout=HANG_S) == 143
  finally:
    for job in jobs:
      job.kill()
      job.wait()
  steps = [r["step"] for r in metrics(workdir) if "loss" in r]       # every line parses
  assert steps == list(range(1, len(steps) + 1))
  assert os.listdir(workdir / "heartbeats") == ["process_0.json"]
  assert json.loads((workdir / "heartbeats" / "process_0.json").read_text())["pid"] == trainer.pid


def test_a_job_of_two_processes_on_a_held_workdir_stops_on_both(tmp_path, tiny_config):
  """Process 0 finds the lock taken; process 1, which takes none, learns it from process 0
  and says the same: neither writes anything into the workdir."""
  workdir = tmp_path / "run"
  workdir.mkdir()
  tiny_config.parallel.dp = 2
  with WorkdirLock(str(workdir)):
    codes, errors = launch_two_processes([*TRAIN[1:], *_flags(workdir, _config_file(tmp_path, tiny_config))], 240)
  holder = f"{workdir} is in use by another training job: process {os.getpid()} on host {socket.gethostname()}"
  for code, stderr in zip(codes, errors):
    assert holder in _one_line(code, stderr, "workdir error")
  assert os.listdir(workdir) == ["lock"]


def test_a_workdir_that_is_a_file_or_read_only_is_one_line(tmp_path, tiny_config):
  """Before anything starts. Read-only: sysfs, where no one may make files, root included
  (chmod would not stop root)."""
  (tmp_path / "file").write_text("")
  config = _config_file(tmp_path, tiny_config)
  for workdir, want in ((tmp_path / "file", f"{tmp_path}/file is a file, not a directory"),
                        ("/sys/kernel", "the workdir /sys/kernel is not writable: ")):
    result = subprocess.run([*TRAIN, *_flags(workdir, config)], cwd=REPO, env=child_env(), capture_output=True, text=True,
                            timeout=HANG_S)
    assert want in _one_line(result.returncode, result.stderr, "workdir error")


# The launcher with every file it writes capped at 64 KiB (RLIMIT_FSIZE, SIGXFSZ ignored): a write
# past it fails with the kernel's EFBIG as one to a full disk fails with ENOSPC. A checkpoint's
# array data outgrows it; its logs (pipes), metrics and heartbeats do not.
_FILES_UP_TO_64_KIB = ("import resource, runpy, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
                       "resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536)); sys.argv[0] = 'megajax-train'; "
                       "runpy.run_module('megajax.launch.train', run_name='__main__')")


def test_a_disk_that_fills_during_a_save_is_one_line_and_the_last_checkpoint_stays(tmp_path, tiny_config):
  """Checkpoint 4 saved, then a relaunch whose first save (step 8) cannot be written: exit 2,
  one line naming the checkpoint, the error and the free space (the per-step check finds it
  when the write fails, the save of step 16 at the latest: tests/unit/test_workdir.py shows
  the check alone); Orbax's partial directory is removed and checkpoint 4 still restores."""
  workdir = tmp_path / "run"
  tiny_config.train.steps, tiny_config.checkpoint.every_steps = 4, 4
  train(tiny_config, str(workdir), devices=jax.devices()[:1])
  command = [sys.executable, "-c", _FILES_UP_TO_64_KIB,
             *_flags(workdir, _config_file(tmp_path, tiny_config), "--config.train.steps=1000",
                     "--config.checkpoint.every_steps=8", "--config.runtime.compilation_cache_dir=none")]
  result = subprocess.run(command, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=HANG_S)
  line = _one_line(result.returncode, result.stderr, "checkpoint error")
  found = re.match(rf"megajax-train: checkpoint error: saving checkpoint {workdir}/checkpoints/8 failed "
                   r"\(found after step (\d+)\): .*File too large.*; [\d.]+ \w+ free of [\d.]+ \w+ on "
                   rf"{workdir}/checkpoints; the last committed checkpoint, {workdir}/checkpoints/4, is kept", line)
  assert found and 8 <= int(found.group(1)) <= 16, line
  assert sorted(os.listdir(workdir / "checkpoints")) == ["4"]
  assert restore_latest(workdir, tiny_config, parallel_step_for(tiny_config)).step == 4


def test_no_readable_checkpoint_is_one_line_without_tracebacks(tmp_path, tiny_config):
  """The only checkpoint's arrays truncated: the restore gives up on it, and the reads still in
  flight finish into Orbax's closed event loop; they used to print a traceback each."""
  workdir = tmp_path / "run"
  tiny_config.train.steps = tiny_config.checkpoint.every_steps = 3
  train(tiny_config, str(workdir), devices=jax.devices()[:1])
  truncate_arrays(workdir / "checkpoints" / "3")
  result = subprocess.run([*TRAIN, *_flags(workdir, _config_file(tmp_path, tiny_config))], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=HANG_S)
  assert "no readable checkpoint in" in _one_line(result.returncode, result.stderr, "checkpoint error")
