"""Where training metrics go: WORKDIR/metrics.jsonl, TensorBoard scalars, and the terminal.

metrics.jsonl is started by a fresh run and continued (appended to) by a resumed one.

Only process 0 writes. On a terminal the step shows as a progress bar; otherwise (a batch
job's log file) each logged step is one plain log line.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

from absl import logging
import psutil
import tensorboardX


class CompilationCacheCounter:
  """Counts the persistent compilation cache's hits and misses in this process (jax.monitoring
  events), so a restart can show it compiled nothing. A miss is a compile that asked the
  cache and was not served (jax's own miss event fires only where an entry is written)."""

  REQUESTS, HITS = "/jax/compilation_cache/compile_requests_use_cache", "/jax/compilation_cache/cache_hits"

  def __init__(self):
    self._requests = self._hits = 0
    import jax
    jax.monitoring.register_event_listener(self._on_event)

  def _on_event(self, event: str, **kwargs) -> None:
    self._requests += event == self.REQUESTS
    self._hits += event == self.HITS

  @property
  def counts(self) -> dict:
    return {"hits": self._hits, "misses": self._requests - self._hits}


def seconds_since_process_start() -> float:
  """Wall time since this process started (time to first step includes imports and jax start)."""
  return time.time() - psutil.Process().create_time()


def _json_number(value):
  """JSON has no NaN/Inf: write them as null (and keep ints ints)."""
  if value is None or isinstance(value, (int, str)):
    return value
  value = float(value)
  return value if math.isfinite(value) else None


class MetricsWriter:

  def __init__(self, workdir: str | None, total_steps: int, enabled: bool = True, progress: bool | None = None,
               append: bool = False):
    self.enabled = enabled
    self.total_steps = total_steps
    self._jsonl = self._tensorboard = self._progress = None
    if not enabled:
      return
    if workdir:
      os.makedirs(workdir, exist_ok=True)
      self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a" if append else "w", buffering=1)
      self._tensorboard = tensorboardX.SummaryWriter(os.path.join(workdir, "tensorboard"))
    if progress if progress is not None else sys.stderr.isatty():
      from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
      self._progress = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(), TimeRemainingColumn(),
                                TextColumn("{task.description}"), transient=False)
      self._task = self._progress.add_task("", total=total_steps)
      self._progress.start()

  def write(self, step: int, metrics: dict) -> None:
    if not self.enabled:
      return
    record = {"step": step, **{k: _json_number(v) for k, v in metrics.items()}}
    if self._jsonl:
      self._jsonl.write(json.dumps(record) + "\n")
    if self._tensorboard:
      for name, value in record.items():
        if name != "step" and isinstance(value, (int, float)):
          self._tensorboard.add_scalar(name, value, step)
    if self._progress:
      short = {k: record.get(k) for k in ("loss", "tokens_per_sec", "mfu") if record.get(k) is not None}
      self._progress.update(self._task, completed=step,
                            description="  ".join(f"{k}={_fmt(v)}" for k, v in short.items()))
    else:
      summary = "  ".join(f"{k}={_fmt(v)}" for k, v in record.items() if k != "step")
      logging.info("step %d/%d  %s", step, self.total_steps, summary)

  def step_done(self, step: int) -> None:
    """Moves the progress bar (a cheap call; rich redraws at its own pace)."""
    if self.enabled and self._progress:
      self._progress.update(self._task, completed=step)

  def close(self) -> None:
    if self._progress:
      self._progress.stop()
    if self._jsonl:
      self._jsonl.close()
    if self._tensorboard:
      self._tensorboard.close()


def _fmt(value) -> str:
  if value is None:
    return "n/a"
  if isinstance(value, float):
    return f"{value:.4g}"
  return str(value)
