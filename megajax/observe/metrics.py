"""Training metrics: where they go (WORKDIR/metrics.jsonl, TensorBoard scalars, the terminal,
Weights & Biases when observe.wandb_project names a project: wandb_tracker.py),
how they are read back, and the throughput / MFU and start-up figures that join them.

Held-out evaluation (train.eval_every) writes records of its own, {"step", "eval_loss",
"eval_perplexity", "eval_tokens", "eval_batches"}, through the same writer: TensorBoard
scalars like every number, and the progress line keeps the last eval_loss beside the loss.

metrics.jsonl is started by a fresh run; a run resumed from the checkpoint of step n drops
the records after step n and appends (records.drop_after), so each step's records are there
once. Only process 0 writes. On a terminal the step shows as a progress bar; otherwise (a
batch job's log file) each logged step is one plain log line.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

from absl import logging
import jax
import tensorboardX

from megajax.flops import mfu, training_flops_per_token
from megajax.model import ModelConfig
from megajax.observe.goodput import process_start_time
from megajax.observe.records import METRICS, drop_after, read_jsonl


class CompilationCacheCounter:
  """Counts the persistent compilation cache's hits and misses (jax.monitoring events) while
  it is entered, so a restart can show it compiled nothing. A miss is a compile that asked the
  cache and was not served (jax's own miss event fires only where an entry is written).

      with CompilationCacheCounter() as cache:   # listening from here ...
        ...
        cache.counts                           # {"hits": ..., "misses": ...}
                                               # ... to here: nothing stays registered
  """

  REQUESTS, HITS = "/jax/compilation_cache/compile_requests_use_cache", "/jax/compilation_cache/cache_hits"

  def __init__(self):
    self._requests = self._hits = 0

  def __enter__(self) -> "CompilationCacheCounter":
    jax.monitoring.register_event_listener(self._on_event)
    return self

  def __exit__(self, *exc_info) -> None:
    jax.monitoring.unregister_event_listener(self._on_event)

  def _on_event(self, event: str, **kwargs) -> None:
    self._requests += event == self.REQUESTS
    self._hits += event == self.HITS

  @property
  def counts(self) -> dict:
    return {"hits": self._hits, "misses": self._requests - self._hits}


def seconds_since_process_start() -> float:
  """Wall time since this process started (time to first step includes imports and jax start)."""
  return time.time() - process_start_time()


# What the progress bar shows, in this order: each the latest value written (an eval_loss stays
# until the next evaluation, the training records in between carry none).
PROGRESS_FIELDS = ("loss", "eval_loss", "tokens_per_sec", "mfu", "goodput/ratio")


def _json_number(value):
  """JSON has no NaN/Inf: write them as null (and keep ints ints)."""
  if value is None or isinstance(value, (int, str)):
    return value
  value = float(value)
  return value if math.isfinite(value) else None


class MetricsWriter:
  """metrics.jsonl, TensorBoard and the terminal. `start_step`: the checkpoint step a resumed
  run starts from (its later records are dropped first); 0 starts the file afresh."""

  def __init__(self, workdir: str | None, total_steps: int, enabled: bool = True, progress: bool | None = None,
               start_step: int = 0, tracker=None):
    self.enabled = enabled
    self.total_steps = total_steps
    self._jsonl = self._tensorboard = self._progress = None
    self._tracker = tracker       # wandb_tracker.WandbTracker (observe.wandb_project), or None
    self._shown = {}            # PROGRESS_FIELDS' latest values
    if not enabled:
      return
    if workdir:
      os.makedirs(workdir, exist_ok=True)
      path = os.path.join(workdir, METRICS)
      if start_step:
        dropped = drop_after(path, start_step)
        if dropped:
          logging.info("%s: dropped %d records after step %d (this run resumes there)", path, dropped, start_step)
      self._jsonl = open(path, "a" if start_step else "w", buffering=1)
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
    if self._tracker:
      self._tracker.log(step, {k: v for k, v in record.items() if k != "step"})
    self._shown.update({k: record[k] for k in PROGRESS_FIELDS if record.get(k) is not None})
    if self._progress:
      self._progress.update(self._task, completed=step, description=self.progress_line())
    else:
      # goodput/*: the ratio on the line, its causes in metrics.jsonl and TensorBoard only
      summary = "  ".join(f"{k}={_fmt(v)}" for k, v in record.items()
                          if k != "step" and (not k.startswith("goodput/") or k == "goodput/ratio"))
      logging.info("step %d/%d  %s", step, self.total_steps, summary)

  def progress_line(self) -> str:
    """The progress bar's text: "loss=2.31  eval_loss=2.45  tokens_per_sec=1.2e+04  mfu=0.41"."""
    return "  ".join(f"{k}={_fmt(self._shown[k])}" for k in PROGRESS_FIELDS if k in self._shown)

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
    if self._tracker:
      self._tracker.close()


def _fmt(value) -> str:
  if value is None:
    return "n/a"
  if isinstance(value, float):
    return f"{value:.4g}"
  return str(value)


class Throughput:
  """Tokens/s, TFLOP/s per device and MFU between logged steps (the first one compiles:
  measured from its end onwards)."""

  def __init__(self, batch_size: int, model: ModelConfig, devices):
    self.tokens_per_step = batch_size * model.seq_len          # train.batch_size sequences
    self.flops_per_token = training_flops_per_token(model)
    self.device_kind = devices[0].device_kind
    self.num_devices = len(devices)
    self.last_time, self.last_step = None, None

  def measure(self, step: int) -> dict:
    now = time.perf_counter()
    if self.last_time is None:
      figures = {"tokens_per_sec": None, "tflops_per_device": None, "mfu": None}
    else:
      tokens_per_sec = (step - self.last_step) * self.tokens_per_step / (now - self.last_time)
      tflops_per_device = tokens_per_sec * self.flops_per_token / self.num_devices / 1e12
      figures = {"tokens_per_sec": tokens_per_sec, "tflops_per_device": tflops_per_device,
                 "mfu": mfu(tflops_per_device, self.device_kind)}
    self.last_time, self.last_step = now, step
    return figures


def read_metrics(path: str) -> dict[str, list[tuple[int, object]]]:
  """{name: [(step, value), ...] sorted by step} from metrics.jsonl; should a step be there
  twice (a file written before records were dropped on resume), its last record wins."""
  by_name: dict[str, dict[int, object]] = {}
  for record in read_jsonl(path):
    if "step" not in record:
      continue
    for name, value in record.items():
      if name != "step":
        by_name.setdefault(name, {})[int(record["step"])] = value
  return {name: sorted(values.items()) for name, values in by_name.items()}
