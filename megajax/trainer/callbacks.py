"""The training loop's one protocol: callbacks called at fixed points of every step.

    for step in ...:
      loop.step = step; loop.beat(phase=f"step {step}"); loop.batch = next(batches)
      for callback in callbacks: callback.before_step(loop)
      loop.state, loop.metrics = step_fn(loop.state, loop.batch)      # dispatched, not waited for
      for callback in callbacks: callback.after_step(loop)
      if loop.preempted: break
    for callback in callbacks: callback.on_end(loop)                  # after the last step

Callbacks run in list order and share the `Loop`: they read it and may replace its state
(a rollback), batch (a drill) or metrics (capture keys taken out). Each owns its own cadence:
the checkpointer says which steps it saves, the metrics log which steps it logs. The
collaborators with more to them have their own modules (nonfinite.py, drills.py); the small
ones are here. The loop itself names the step in this process's heartbeat before fetching
its batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import signal
import threading
import time
from typing import Any

from absl import logging
import jax
from jax.experimental import multihost_utils

from megajax.checkpoint import TrainingCheckpointer
from megajax.observe import ActivationLog, CompilationCacheCounter, MetricsWriter, StepTracer, Throughput
from megajax.observe.goodput import GoodputClock
from megajax.observe.metrics import seconds_since_process_start
from megajax.parallel import ParallelStep
from megajax.trainer.heartbeat import Heartbeat


@dataclasses.dataclass
class Loop:
  """What the loop shares with its callbacks."""
  train: Any                        # the run's train section (train.steps: the last step)
  parallel_step: ParallelStep
  start_step: int                   # the checkpoint step this run resumed from (0: a fresh start)
  state: Any                        # the TrainState the next step starts from
  batches: Any                      # data.DevicePrefetcher (its get_state() is the data position)
  writer: MetricsWriter | None = None   # metrics.jsonl / TensorBoard / terminal (process 0 writes)
  heartbeat: Heartbeat | None = None    # this process's heartbeat file (None without a workdir)
  step: int = 0                     # the step being run
  batch: dict | None = None         # its batch
  metrics: dict | None = None       # its metrics, on device (after_step: dispatched, maybe not done)
  preempted: bool = False           # stop after this step (a checkpoint is saved first)
  history: list = dataclasses.field(default_factory=list)   # the logged metrics, one dict per logged step
  clock: GoodputClock = dataclasses.field(default_factory=lambda: GoodputClock(started=time.time()))
                                    # this run's time by cause (observe/goodput.py)

  def beat(self, **fields) -> None:
    """Updates this process's heartbeat (nothing without a workdir)."""
    if self.heartbeat:
      self.heartbeat.update(**fields)


class Callback:
  """A collaborator of the loop. Every method is a no-op here: override the points you need."""

  def before_step(self, loop: Loop) -> None:
    """Before the step is dispatched (loop.batch is its batch)."""

  def after_step(self, loop: Loop) -> None:
    """After the step is dispatched: loop.state and loop.metrics are its outputs."""

  def on_end(self, loop: Loop) -> None:
    """After the last step (also after a preemption; not after an error). What a callback
    holds that must be released even after an error is the run's ExitStack's (train())."""


class Tracing(Callback):
  """Sampled traces (observe.trace_every): the chosen step alone, on every process."""

  def __init__(self, tracer: StepTracer, compiled_step):
    self.tracer = tracer
    if tracer.every and compiled_step is not None:    # (None: no step left to run)
      tracer.describe(compiled_step)

  def before_step(self, loop: Loop) -> None:
    if self.tracer.wants(loop.step):
      jax.block_until_ready(loop.state)     # the trace holds this step alone
      self.tracer.start(loop.step)

  def after_step(self, loop: Loop) -> None:
    if self.tracer.active:
      jax.block_until_ready(loop.metrics)
      logging.info("step %d traced: %s", loop.step, self.tracer.stop())


class ActivationCapture(Callback):
  """observe.capture: the capture/* statistics leave the metrics for activations.jsonl."""

  def __init__(self, log: ActivationLog):
    self.log = log

  def after_step(self, loop: Loop) -> None:
    loop.metrics = self.log.take(loop.step, loop.metrics)

  def on_end(self, loop: Loop) -> None:
    self.log.flush()


class StartupLog(Callback):
  """Time from process start to the end of this run's first step (compilation included), and
  the persistent compilation cache's hits and misses by then."""

  def __init__(self, cache: CompilationCacheCounter):
    self.cache = cache

  def after_step(self, loop: Loop) -> None:
    if loop.step != loop.start_step + 1:
      return
    metrics = jax.block_until_ready(loop.metrics)
    startup = seconds_since_process_start()
    cache = self.cache.counts
    logging.info("first step done %.1f s after process start (step %d, loss %.4f); persistent compilation "
                 "cache: %d hits, %d misses", startup, loop.step, float(metrics["loss"]), cache["hits"],
                 cache["misses"])
    loop.writer.write(loop.step, {"startup_s": startup, "compile_cache_hits": cache["hits"],
                                  "compile_cache_misses": cache["misses"]})
    loop.beat(startup_s=startup)


@contextlib.contextmanager
def manual_garbage_collection(every_steps: int):
  """runtime.gc_every_steps > 0: Python's automatic cyclic collections off inside (the build,
  the compile and the loop, where GarbageCollection collects), as they were after."""
  was_enabled = gc.isenabled()
  if every_steps:
    gc.disable()
  try:
    yield
  finally:
    if was_enabled:
      gc.enable()


class GarbageCollection(Callback):
  """With the automatic collections off (manual_garbage_collection), a full collection after
  every `every_steps`-th step: at the same step on every process, so no rank pauses alone."""

  def __init__(self, every_steps: int):
    self.every_steps = every_steps

  def after_step(self, loop: Loop) -> None:
    if self.every_steps and loop.step % self.every_steps == 0:
      gc.collect()


class Preemption(Callback):
  """Has the job been asked to stop? Every process must agree on the step at which it saves.

  One process: SIGTERM and SIGINT set a flag (checked after each step). Several: jax's
  coordination service already receives the SIGTERM and picks one sync step for all
  processes (`multihost_utils.reached_preemption_sync_point`), so no handler replaces it.
  """

  def __init__(self):
    self._requested = threading.Event()
    self._previous = {}
    if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._handle)

  def _handle(self, signum, frame):
    logging.warning("received %s: saving a checkpoint after this step, then stopping",
                    signal.Signals(signum).name)
    self._requested.set()

  def after_step(self, loop: Loop) -> None:
    if jax.process_count() > 1:
      loop.preempted = multihost_utils.reached_preemption_sync_point(loop.step)
    else:
      loop.preempted = self._requested.is_set()

  def __enter__(self) -> "Preemption":
    return self

  def __exit__(self, *exc_info) -> None:
    """Gives SIGTERM / SIGINT back to the handlers before ours."""
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


class MetricsLog(Callback):
  """The progress bar every step; metrics at step 1 (the starting loss), every train.log_every
  steps and the last step, with throughput and MFU, into metrics.jsonl and the history."""

  def __init__(self, train, parallel_step: ParallelStep, guard):
    self.train = train                      # the train section: log_every, steps
    self.meter = Throughput(train.batch_size, parallel_step.model.config, parallel_step.devices)
    self.guard = guard                      # nonfinite.NonFiniteGuard: the updates skipped so far

  def due(self, step: int) -> bool:
    return step == 1 or step % self.train.log_every == 0 or step == self.train.steps

  def after_step(self, loop: Loop) -> None:
    loop.writer.step_done(loop.step)
    if not self.due(loop.step):
      return
    metrics = {k: float(v) for k, v in jax.device_get(loop.metrics).items()}   # waits for the step
    record = {**metrics, **self.meter.measure(loop.step), "skipped_steps": self.guard.skipped}
    loop.history.append({"step": loop.step, **record})
    loop.writer.write(loop.step, {**record, **loop.clock.live_scalars()})


class Checkpointing(Callback):
  """Saves when the checkpointer says a step is due (its cadence, or a preemption), never inside
  a run of skipped updates; records how long the step waited and, once committed, how long
  the save took; on a preemption, stops the loop after the save."""

  def __init__(self, checkpointer: TrainingCheckpointer | None, guard):
    self.checkpointer = checkpointer
    self.guard = guard                      # nonfinite.NonFiniteGuard: reads a step's flag before its save

  def after_step(self, loop: Loop) -> None:
    if self.checkpointer:     # a save that failed in the background ends the run now, not at the next save
      self.checkpointer.check_for_errors(loop.step)
    saved = False
    if self.checkpointer and self.checkpointer.due(loop.step, loop.preempted):
      loop.beat(phase=f"checkpoint save {loop.step}")
      self.guard.flush(loop)
      # Resuming inside a run of skips would forget it (and after a rollback the state is an older
      # one): keep the last good checkpoint until an update applies.
      if self.guard.skipping_since is not None:
        logging.warning("step %d: no checkpoint inside a run of skipped updates (since step %d)", loop.step,
                        self.guard.skipping_since)
      else:
        loop.clock.lap_after("steps", loop.state)     # the step it saves is the step's time
        blocking = self.checkpointer.save(loop.step, loop.state, loop.batches.get_state())
        loop.clock.lap("checkpoint")
        loop.clock.flush()
        logging.info("checkpoint %d: the step waited %.3f s (device -> host); writing in the background",
                     loop.step, blocking)
        loop.writer.write(loop.step, {"ckpt_blocking_s": blocking})
        saved = True
    self._log_committed(loop)
    if loop.preempted:
      logging.warning("preempted at step %d: %s, stopping", loop.step, "checkpoint saved" if saved else
                      "no checkpoint inside a run of skipped steps (a restart resumes from the latest one)"
                      if self.checkpointer else "no workdir, nothing saved")

  def on_end(self, loop: Loop) -> None:
    if self.checkpointer:
      loop.beat(phase="checkpoint commit")
      loop.clock.lap("steps")
      self.checkpointer.wait()              # stage 2 of the last save
      loop.clock.lap("checkpoint")
      self._log_committed(loop)

  def _log_committed(self, loop: Loop) -> None:
    """Stage 2 done: each committed save's start-to-commit time, to the log and the metrics."""
    for saved, total in self.checkpointer.take_finished() if self.checkpointer else ():
      logging.info("checkpoint %d committed: %.3f s from the start of its save", saved, total)
      loop.writer.write(saved, {"ckpt_total_s": total})
