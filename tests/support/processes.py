"""Child processes for the e2e tests: a module run to completion, and a 2-process job on 127.0.0.1."""

import os
import signal
import subprocess
import sys
import tempfile
import time

import jax

from megajax.launch.supervisor.jobs import free_port
from tests.support import COMPILE_FLAGS, REPO, xla_flags
from tests.support.once import once_per_run


# The children of the tests compile like the tests themselves (tests/conftest.py: LLVM -O0, the
# classic kernel emitters, one LLVM module): a job of the tiny models here spends its time
# compiling, not stepping (the 2x2x2 default job's programs compile in about half the time; its
# quarter-width step runs 0.1 -> 0.3 s). A child that runs many full-width steps (the default
# job's 70) asks for optimized=True.
CHILD_XLA_FLAGS = xla_flags(COMPILE_FLAGS)


def child_env(extra=None, optimized=False) -> dict:
  """The environment for a child process: the tests' XLA_FLAGS replaced by CHILD_XLA_FLAGS
  (none when `optimized`) joined by `extra`'s XLA_FLAGS, `extra`'s other variables added."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  # The tests' compilation cache for children too: a relaunched job (resume tests) and the
  # launcher tests' repeated meshes compile once.
  env["JAX_COMPILATION_CACHE_DIR"] = jax.config.jax_compilation_cache_dir
  env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  extra = dict(extra or {})
  flags = [*([] if optimized else [CHILD_XLA_FLAGS]), *([extra.pop("XLA_FLAGS")] if "XLA_FLAGS" in extra else [])]
  if flags:
    env["XLA_FLAGS"] = " ".join(flags)
  return {**env, **extra}


# What a test waits for is an event: a child exits, a file appears, a heartbeat reaches a step.
# HANG_S only ends a test whose child hangs (a deadlock, a lost collective) well before CI's own
# limit; it is not a guess at this machine's speed: on a loaded 2-core machine the slowest
# child here (the default job's 70 steps) ends within a fifth of it.
HANG_S = 1500


def run_module(args, timeout=HANG_S, env=None, optimized=False):
  """Runs `python -m ...` from the repo root; returns the CompletedProcess.

  The child starts without the tests' XLA_FLAGS (child_env): the launcher asks for the
  devices its mesh needs itself.
  """
  return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True,
                        timeout=timeout, env=child_env(env, optimized))


def wait_until(condition, what: str, process=None, poll_s=0.05) -> None:
  """Polls `condition()` until it holds. Fails when `process` (a Popen) has ended first, with
  `what` named, or after HANG_S (a hang)."""
  deadline = time.monotonic() + HANG_S
  while not condition():
    assert process is None or process.poll() is None, f"the process ended (code {process.returncode}) before {what}"
    assert time.monotonic() < deadline, f"waited {HANG_S} s for {what}: hung"
    time.sleep(poll_s)


def launch_two_processes(args, timeout=HANG_S, optimized=False):
  """`python <args>` as a 2-process jax.distributed job on 127.0.0.1 (the launcher's topology
  flags added): (return codes, stderrs). A job still running after `timeout` s fails the test
  with each process's Python stacks (SIGUSR1: megajax-train prints them) and log tail."""
  port = free_port()
  # stderr to files, not pipes: a pipe nobody reads while we wait on the other process can
  # fill and block its writer (which then stops answering the collectives).
  logs = [tempfile.TemporaryFile("w+") for _ in range(2)]
  procs = [subprocess.Popen([sys.executable, *args, f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                             f"--process_id={i}"],
                            cwd=REPO, env=child_env(optimized=optimized), stdout=subprocess.DEVNULL, stderr=logs[i],
                            text=True)
           for i in range(2)]
  deadline = time.monotonic() + timeout
  try:
    try:
      for p in procs:
        p.wait(timeout=max(0.0, deadline - time.monotonic()))
      hung = False
    except subprocess.TimeoutExpired:
      hung = True
      for p in procs:
        p.send_signal(signal.SIGUSR1)
      time.sleep(3)     # the stacks reach the logs
  finally:
    for p in procs:
      p.kill()
      p.wait()
  errors = []
  for log in logs:
    log.seek(0)
    errors.append(log.read())
    log.close()
  if hung:
    tails = [f"--- process {i} (exit code {p.returncode}):\n{e[-8000:]}" for i, (p, e) in enumerate(zip(procs, errors))]
    raise AssertionError(f"the 2-process job did not end within {timeout} s\n" + "\n".join(tails))
  return [p.returncode for p in procs], errors


# The default 2x2x2 job (pipeline, tp, ZeRO-2 over dp), short and in fp32, checkpoints every 3 steps.
SHORT_JOB = ["-m", "megajax.launch.train", "--config=configs/default.py", "--config.train.steps=12",
             "--config.optimizer.warmup_steps=3", "--config.train.log_every=1", "--config.model.compute_dtype=float32",
             "--config.checkpoint.every_steps=3"]
# The same with its 4 layers and heads at a quarter of its width and sequence: the same programs
# on smaller arrays, a step in ~0.1 s, not ~1 s. Its uninterrupted run is the one both
# test_launcher.py (its losses and exported parameters against other meshes) and
# test_checkpoint.py (against a killed and resumed run) compare with.
SHORT_DEFAULT_JOB = [*SHORT_JOB, "--config.model.hidden_dim=32", "--config.model.seq_len=32", "--config.model.window=16"]


def short_default_job(tmp_path_factory):
  """SHORT_DEFAULT_JOB run once per test run (tests.support.once), whichever test asks first:
  its workdir (read it, do not write into it)."""
  def run(workdir):
    result = run_module([*SHORT_DEFAULT_JOB, f"--workdir={workdir}"])
    assert result.returncode == 0, result.stderr[-3000:]
  return once_per_run(tmp_path_factory, "short_default_job", run)
