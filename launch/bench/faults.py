r"""Fault soak: kill -9 a random worker at a random step, many times, under megajax-supervise.

  python -m megajax.launch.bench faults --trials 20

A 2-process local job (4 CPU devices each, mesh dp=2 x tp=4, 16 steps, a checkpoint every 4,
single-threaded Eigen so that CPU runs repeat bit for bit)
runs once without faults (the reference), then `--trials` times with one kill -9 of a random
worker at a random step. A trial recovers when the supervisor restarts the job and it
finishes; it is bitwise-equal when its final parameters equal the reference's exactly. Prints
recoveries / trials, bitwise-equal / trials, and the incidents' time to detect, time to
resume and steps lost.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

from megajax.checkpoint import load_params
from megajax.config import REPO
from megajax.trainer.heartbeat import read_heartbeats

STEPS = 16
JOB = ["--config=configs/default.py", f"--config.train.steps={STEPS}", "--config.optimizer.warmup_steps=3",
       "--config.train.log_every=4", "--config.model.compute_dtype=float32", "--config.checkpoint.every_steps=4",
       "--config.parallel.dp=2", "--config.parallel.pp=1", "--config.parallel.virtual_stages=1",
       "--config.parallel.tp=4", "--config.parallel.tp_overlap=none", "--config.model.num_layers=2",
       "--config.supervisor.processes=2", "--config.supervisor.heartbeat_interval_s=0.25",
       "--config.supervisor.heartbeat_timeout_s=5", "--config.supervisor.max_restarts=2",
       "--config.supervisor.diagnose=false"]


def _supervise(workdir: str, cache: str) -> subprocess.Popen:
  log = open(f"{workdir}.log", "w")
  # Single-threaded Eigen: XLA:CPU's multi-threaded contractions do not fix their summation
  # order on a loaded machine, and the trials are compared with the reference bit for bit.
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
  env["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false"
  return subprocess.Popen([sys.executable, "-m", "megajax.launch.supervise", *JOB, f"--workdir={workdir}",
                           f"--config.runtime.compilation_cache_dir={cache}"],
                          cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def _kill_at(process: subprocess.Popen, workdir: str, victim: int, step: int, timeout: float = 600) -> bool:
  """kill -9 of process `victim` once both workers have finished `step`; False if the job ended first."""
  deadline = time.time() + timeout
  while time.time() < deadline and process.poll() is None:
    beats = read_heartbeats(workdir)
    if len(beats) == 2 and min(b["step"] for b in beats.values()) >= step:
      os.kill(beats[victim]["pid"], signal.SIGKILL)
      return True
    time.sleep(0.02)
  return False


def _params(workdir: str):
  return jax.tree.leaves(load_params(os.path.join(workdir, "params")))


def faults(trials: int, seed: int = 0) -> None:
  rng = random.Random(seed)
  root = tempfile.mkdtemp(prefix="megajax-faults-")
  cache = os.path.join(root, "jax_cache")
  reference = os.path.join(root, "reference")
  if _supervise(reference, cache).wait() != 0:
    raise SystemExit(f"the reference run failed; see {reference}.log")
  want = _params(reference)
  recovered = equal = 0
  incidents = []
  print(f"{'trial':>5} {'killed':>7} {'at step':>7} {'recovered':>9} {'bitwise':>7} {'detect s':>8} "
        f"{'resume s':>8} {'steps lost':>10}")
  for trial in range(trials):
    workdir = os.path.join(root, f"trial_{trial}")
    victim, at_step = rng.randrange(2), rng.randrange(1, STEPS)
    process = _supervise(workdir, cache)
    killed = _kill_at(process, workdir, victim, at_step)
    ok = process.wait(timeout=900) == 0 and killed
    same = ok and all(np.array_equal(a, b) for a, b in zip(want, _params(workdir)))
    recovered += ok
    equal += same
    path = os.path.join(workdir, "incidents.jsonl")
    found = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    incident = found[0] if found else {}
    incidents += found
    # (None: a kill after the last step leaves no step to resume, so no time to resume nor steps lost.)
    seconds = {field: float("nan") if incident.get(field) is None else incident[field]
               for field in ("time_to_detect_s", "time_to_resume_s")}
    print(f"{trial:>5} {victim:>7} {at_step:>7} {str(ok):>9} {str(same):>7} "
          f"{seconds['time_to_detect_s']:>8.2f} {seconds['time_to_resume_s']:>8.2f} "
          f"{'-' if incident.get('steps_lost') is None else incident['steps_lost']:>10}")
  print(f"\nrecoveries / trials: {recovered} / {trials}")
  print(f"bitwise-equal / trials: {equal} / {trials}")
  for field in ("time_to_detect_s", "time_to_resume_s", "steps_lost"):
    values = [i[field] for i in incidents if i.get(field) is not None]
    if values:
      print(f"{field}: median {statistics.median(values):.2f}, max {max(values):.2f} ({len(values)} incidents)")
  print(f"(runs in {root})")
