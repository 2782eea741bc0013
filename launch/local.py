r"""megajax-local: a real multi-process JAX job on one machine (CPU devices, gloo collectives).

  megajax-local --processes 2 --devices-per-process 4 -- \
      --config=configs/default.py --workdir=/tmp/run --config.parallel.dp=2 --config.parallel.tp=4

Starts `megajax-train <flags>` (or `--module`) once per process with --coordinator_address
(a free port on 127.0.0.1), --num_processes and --process_id, each process seeing
`--devices-per-process` CPU devices: the same code path as a multi-host GPU job, for
development and tests. Output lines are prefixed with the process index. When one process
fails, the others are stopped (they would wait for it in their next collective); the exit
code is the first failing process's. SIGINT / SIGTERM are passed on to every process.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

from absl import app
from absl import flags


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
    self.processes = processes
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

  @property
  def pids(self) -> list[int]:
    return [p.pid for p in self.popen]

  def poll(self) -> list[int | None]:
    return [p.poll() for p in self.popen]

  def signal(self, sig: int) -> None:
    for p in self.popen:
      try:              # the whole group, even after its leader exited (a worker's own children)
        os.killpg(p.pid, sig)
      except (ProcessLookupError, PermissionError):
        pass

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
    while True:
      codes = self.poll()
      failed = [code for code in codes if code not in (None, 0)]
      if failed:
        self.stop()
        return failed[0]
      if all(code == 0 for code in codes):
        self.kill()          # joins the output pumps
        return 0
      time.sleep(0.1)


def _prefix_lines(stream, prefix: str) -> None:
  for line in stream:
    sys.stderr.write(prefix + line)
  stream.close()


_PROCESSES = flags.DEFINE_integer("processes", 2, "Processes in the job.")
_DEVICES = flags.DEFINE_integer("devices_per_process", 4, "CPU devices each process sees.")
_MODULE = flags.DEFINE_string("module", "megajax.launch.train", "The Python module every process runs.")


def main(argv):
  job = LocalJob(_MODULE.value, argv[1:], _PROCESSES.value, _DEVICES.value)
  handler = lambda signum, frame: job.signal(signum)  # noqa: E731  (pass it on; the workers save and stop)
  signal.signal(signal.SIGINT, handler)
  signal.signal(signal.SIGTERM, handler)
  sys.exit(job.wait())


def run():
  # Everything after `--` belongs to the workers; absl parses only what comes before.
  argv = sys.argv
  if "--" in argv:
    split = argv.index("--")
    ours, theirs = argv[:split], argv[split + 1:]
  else:
    ours, theirs = argv, []
  ours = [arg.replace("--devices-per-process", "--devices_per_process") for arg in ours]
  app.run(main, argv=ours, flags_parser=lambda a: [*flags.FLAGS(a)[:1], *theirs])


if __name__ == "__main__":
  run()
