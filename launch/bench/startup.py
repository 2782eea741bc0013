"""`python -m megajax.launch.bench startup`: what the persistent compilation cache saves a restart.

Runs `megajax-train` (configs/default.py, 2 steps, 1 warmup step, no params export) twice, each in a fresh
workdir but with one compilation cache directory: cold (the cache empty) then warm (the
cache the cold run wrote). Prints, side by side, the time from process start to the end of
the first step (the `startup_s` record the trainer writes to metrics.jsonl; the whole run's
wall time when there is none), the whole run's wall time, the cache entries each run wrote,
and warm / cold.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

from megajax.config import REPO
from megajax.observe.records import METRICS, read_jsonl



def _child_env() -> dict:
  """This environment without a compilation cache of its own or a forced CPU device count."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  flags = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f)
  if flags:
    env["XLA_FLAGS"] = flags
  else:
    env.pop("XLA_FLAGS", None)
  return env


def _startup_record(workdir: str) -> dict | None:
  """The first metrics.jsonl record with startup_s, if the trainer wrote one."""
  path = os.path.join(workdir, METRICS)
  records = read_jsonl(path) if os.path.exists(path) else []
  return next((record for record in records if "startup_s" in record), None)


def _cache_entries(cache_dir: str) -> int:
  return len(os.listdir(cache_dir)) if os.path.isdir(cache_dir) else 0


def run_once(root: str, name: str, cache_dir: str, steps: int, timeout: int) -> dict:
  """One megajax-train run in ROOT/NAME; its timings and the cache entries it added."""
  workdir = os.path.join(root, name)
  before = _cache_entries(cache_dir)
  command = [sys.executable, "-m", "megajax.launch.train", f"--config={os.path.join(REPO, 'configs', 'default.py')}",
             f"--workdir={workdir}", f"--config.train.steps={steps}", "--config.optimizer.warmup_steps=1",
             "--config.checkpoint.save_params=False",
             f"--config.runtime.compilation_cache_dir={cache_dir}"]
  start = time.perf_counter()
  result = subprocess.run(command, cwd=REPO, env=_child_env(), capture_output=True, text=True, timeout=timeout)
  wall = time.perf_counter() - start
  if result.returncode != 0:
    sys.stderr.write(result.stderr[-4000:])
    raise SystemExit(f"bench startup: the {name} run failed with exit code {result.returncode}")
  record = _startup_record(workdir)
  return {"wall_s": wall, "startup_s": record["startup_s"] if record else None, "record": record or {},
          "entries": _cache_entries(cache_dir) - before}


def startup(steps: int = 2, timeout: int = 1200, keep: bool = False) -> dict:
  root = tempfile.mkdtemp(prefix="megajax-bench-startup-")
  cache_dir = os.path.join(root, "cache")
  try:
    print(f"\n== start-up: megajax-train configs/default.py, {steps} steps, cold then warm compilation cache "
          f"({cache_dir})")
    cold = run_once(root, "cold", cache_dir, steps, timeout)
    warm = run_once(root, "warm", cache_dir, steps, timeout)
  finally:
    if not keep:
      shutil.rmtree(root, ignore_errors=True)
  measured = cold["startup_s"] is not None and warm["startup_s"] is not None
  first = "startup_s" if measured else "wall_s"
  print(f"{'':28} {'cold':>9} {'warm':>9} {'warm / cold':>12}")
  rows = [("process start -> first step", "startup_s")] if measured else []
  for text, key in rows + [("whole run (wall)", "wall_s")]:
    print(f"{text:28} {cold[key]:>8.1f}s {warm[key]:>8.1f}s {warm[key] / cold[key]:>11.2f}x")
  print(f"{'cache entries written':28} {cold['entries']:>9} {warm['entries']:>9}")
  for key in sorted(set(cold["record"]) | set(warm["record"])):
    if "cache" in key:
      print(f"{key[:28]:28} {cold['record'].get(key, '-')!s:>9} {warm['record'].get(key, '-')!s:>9}")
  if not measured:
    print("(metrics.jsonl has no startup_s record yet: the ratio is of the whole run's wall time, which "
          "includes the steps and the exit)")
  return {"cold": cold, "warm": warm, "ratio": warm[first] / cold[first], "measured": first}
