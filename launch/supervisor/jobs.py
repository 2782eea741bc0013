"""The jobs the supervisor starts and stops: local processes (LocalJob) or a cluster command (CommandJob).

LocalJob: N processes of `python -m module args` forming one jax.distributed job on one
machine (--coordinator_address on a free 127.0.0.1 port, --num_processes, --process_id), each
seeing its own CPU devices: the same code path as a multi-host GPU job, for development and
tests (megajax-local, and the supervisor without a command). CommandJob: the job started by
`supervisor.command` (srun / kubectl / mpirun), one shell command for all processes.
Both: poll() the exit codes, signal(), stop().
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time

POLL_SECONDS = 0.1   # how often a job's processes (and the supervisor's watch) are polled


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def local_env(devices_per_process: int, attempt: int = 0, extra: dict | None = None) -> dict:
  """A worker's environment: CPU only, `devices_per_process` devices, the attempt number."""
  env = dict(os.environ)
  flags_ = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f)
  env["XLA_FLAGS"] = f"{flags_} --xla_force_host_platform_device_count={devices_per_process}".strip()
  env["JAX_PLATFORMS"] = "cpu"
  env["MEGAJAX_ATTEMPT"] = str(attempt)
  env.update(extra or {})
  return env


class LocalJob:
  """N processes of `python -m module args` forming one jax.distributed job on 127.0.0.1.

  Each process runs in its own process group, so stopping the job stops whatever a worker
  started too. `log_path` (with {process}) sends each process's output to a file;
  otherwise it is prefixed and copied to this process's stderr.
  """

  def __init__(self, module: str, args: list[str], processes: int, devices_per_process: int,
               attempt: int = 0, log_path: str | None = None, env: dict | None = None):
    port = free_port()
    self._logs, self._pumps = [], []
    self.popen = []
    for index in range(processes):
      command = [sys.executable, "-m", module, *args]
      if processes > 1:
        command += [f"--coordinator_address=127.0.0.1:{port}", f"--num_processes={processes}",
                    f"--process_id={index}"]
      if log_path:
        log = open(log_path.format(process=index), "a")
        self._logs.append(log)
        out = dict(stdout=log, stderr=subprocess.STDOUT)
      else:
        out = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
      self.popen.append(subprocess.Popen(command, env=local_env(devices_per_process, attempt, env),
                                         start_new_session=True, **out))
      if not log_path:
        pump = threading.Thread(target=_prefix_lines, args=(self.popen[-1].stdout, f"[p{index}] "), daemon=True)
        pump.start()
        self._pumps.append(pump)

  def poll(self) -> list[int | None]:
    return [p.poll() for p in self.popen]

  def signal(self, sig: int) -> None:
    for p in self.popen:
      _signal_group(p.pid, sig)

  def stop(self, grace: float = 5.0) -> None:
    """SIGTERM, then SIGKILL whatever is left after `grace` seconds (a stopped or hung worker)."""
    self.signal(signal.SIGCONT)   # a SIGSTOPped worker cannot act on SIGTERM
    self.signal(signal.SIGTERM)
    deadline = time.time() + grace
    while time.time() < deadline and any(code is None for code in self.poll()):
      time.sleep(0.05)
    self.kill()

  def kill(self) -> None:
    self.signal(signal.SIGKILL)
    for p in self.popen:
      p.wait()
    for pump in self._pumps:
      pump.join(timeout=5)
    for log in self._logs:
      log.close()

  def wait(self) -> int:
    """Waits for the job; the first failure stops the rest. Returns the job's exit code."""
    return job_wait(self)


def _signal_group(pid: int, sig: int) -> None:
  """Signals the process group `pid` leads: the whole group, even after its leader exited (a
  worker's own children, the rest of a shell pipeline); a group already gone is no error."""
  with contextlib.suppress(ProcessLookupError, PermissionError):
    os.killpg(pid, sig)


def _prefix_lines(stream, prefix: str) -> None:
  for line in stream:
    sys.stderr.write(prefix + line)
  stream.close()


class CommandJob:
  """The job started by `supervisor.command`, one shell command for all processes.

  Stopping it signals the command's process group (srun and mpirun pass SIGTERM on to their
  tasks), then runs `supervisor.stop_command` if set (e.g. `kubectl delete jobset ...`).
  """

  def __init__(self, command: str, attempt: int, env: dict, stop_command: str = ""):
    self.stop_command = stop_command
    self.popen = subprocess.Popen(command, shell=True, env={**os.environ, **env,
                                                            "MEGAJAX_ATTEMPT": str(attempt)},
                                  start_new_session=True)

  def poll(self) -> list[int | None]:
    return [self.popen.poll()]

  def signal(self, sig: int) -> None:
    _signal_group(self.popen.pid, sig)

  def stop(self, grace: float = 30.0) -> None:
    self.signal(signal.SIGCONT)
    self.signal(signal.SIGTERM)
    try:
      self.popen.wait(timeout=max(grace, 10.0))   # give srun time to take its tasks down
    except subprocess.TimeoutExpired:
      self.signal(signal.SIGKILL)
      self.popen.wait()
    if self.stop_command:
      subprocess.run(self.stop_command, shell=True, check=False)


def job_wait(job, timeout: float = math.inf) -> int | None:
  """Waits for every process of `job`; the first non-zero code stops the rest. None on timeout."""
  deadline = time.time() + timeout
  code = None
  while time.time() < deadline:
    codes = job.poll()
    failed = [c for c in codes if c not in (None, 0)]
    if failed or all(c == 0 for c in codes):
      code = failed[0] if failed else 0
      break
    time.sleep(POLL_SECONDS)
  job.stop()
  return code
