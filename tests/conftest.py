"""Shared fixtures: tiny configs and models, built once per test session."""

import os
import sys
import tempfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Eight CPU devices in every test process (set before jax starts its backend), so every mesh
# shape of the 3D step is testable; single-device tests pass devices=jax.devices()[:1].
TEST_DEVICES = 8
_XLA_FLAGS = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _XLA_FLAGS:
  os.environ["XLA_FLAGS"] = f"{_XLA_FLAGS} --xla_force_host_platform_device_count={TEST_DEVICES}".strip()

import jax  # noqa: E402  (after XLA_FLAGS)

# Tests compile many identical programs (a mesh's state initialization for every schedule,
# the reference steps): JAX's persistent compilation cache, shared by the xdist workers,
# compiles each once. Keys are the program, the options and the jax version.
jax.config.update("jax_compilation_cache_dir", os.path.join(tempfile.gettempdir(), "megajax-tests-jax-cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


@pytest.fixture
def tiny_config():
  """A fresh, valid, fast config (tests mutate it freely)."""
  from megajax.config import default_config
  config = default_config()
  config.model.num_layers = 2
  config.model.hidden_dim = 32
  config.model.num_heads = 4
  config.model.seq_len = 16
  config.model.vocab_size = 64
  config.model.compute_dtype = "float32"
  config.train.batch_size = 4
  config.train.steps = 10
  config.optimizer.warmup_steps = 2
  return config


def run_module(args, timeout=300, env=None):
  """Runs `python -m ...` from the repo root; returns the CompletedProcess.

  The child starts without the tests' XLA_FLAGS: the launcher asks for the devices its
  mesh needs itself.
  """
  import subprocess
  return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True,
                        timeout=timeout, env=child_env(env))


def child_env(extra=None) -> dict:
  """The environment for a child process: the tests' XLA_FLAGS removed, `extra` added."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  # The tests' compilation cache for children too: a relaunched job (resume tests) and the
  # launcher tests' repeated meshes compile once.
  env["JAX_COMPILATION_CACHE_DIR"] = jax.config.jax_compilation_cache_dir
  env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  env.update(extra or {})
  return env


def launch_two_processes(args, timeout=300):
  """`python <args>` as a 2-process jax.distributed job on 127.0.0.1 (the launcher's topology
  flags added): (return codes, stderrs). A job still running after `timeout` s fails the test
  with each process's Python stacks (SIGUSR1: megajax-train prints them) and log tail."""
  import signal
  import subprocess
  import time
  from megajax.launch.local import free_port
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
      time.sleep(3)
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
