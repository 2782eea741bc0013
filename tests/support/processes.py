"""Child processes for the e2e tests: a module run to completion, and a 2-process job on 127.0.0.1."""

import os
import signal
import subprocess
import sys
import tempfile
import time

import jax

from megajax.launch.supervisor.jobs import free_port
from tests.support import REPO


def child_env(extra=None) -> dict:
  """The environment for a child process: the tests' XLA_FLAGS removed, `extra` added."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  # The tests' compilation cache for children too: a relaunched job (resume tests) and the
  # launcher tests' repeated meshes compile once.
  env["JAX_COMPILATION_CACHE_DIR"] = jax.config.jax_compilation_cache_dir
  env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  env.update(extra or {})
  return env


def run_module(args, timeout=300, env=None):
  """Runs `python -m ...` from the repo root; returns the CompletedProcess.

  The child starts without the tests' XLA_FLAGS: the launcher asks for the devices its
  mesh needs itself.
  """
  return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True,
                        timeout=timeout, env=child_env(env))


def launch_two_processes(args, timeout=300):
  """`python <args>` as a 2-process jax.distributed job on 127.0.0.1 (the launcher's topology
  flags added): (return codes, stderrs). A job still running after `timeout` s fails the test
  with each process's Python stacks (SIGUSR1: megajax-train prints them) and log tail."""
  port = free_port()
  # stderr to files, not pipes: a pipe nobody reads while we wait on the other process can
  # fill and block its writer (which then stops answering the collectives).
  logs = [tempfile.TemporaryFile("w+") for _ in range(2)]
  procs = [subprocess.Popen([sys.executable, *args, f"--coordinator_address=127.0.0.1:{port}", "--num_processes=2",
                             f"--process_id={i}"],
                            cwd=REPO, env=child_env(), stdout=subprocess.DEVNULL, stderr=logs[i], text=True)
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
