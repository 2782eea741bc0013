"""The training loop as a library: `train(config, workdir)` trains up to `config.train.steps`.

Sections run in order: model, mesh and plan -> checkpoint (resume) -> data -> state ->
step -> loop (with checkpoints) -> export. The launcher (megajax.launch.train) and the
Python API both call `train`. Every run, one device or many, goes through the 3D-parallel
step (megajax.parallel.step). With a workdir, a run resumes from the latest complete
checkpoint in WORKDIR/checkpoints (`train.steps` is the total target), saves every
`checkpoint.every_steps`, at the end, and when preempted (SIGTERM / SIGINT).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import signal
import threading
import time

from absl import logging
import jax
import ml_collections

from megajax import data
from megajax.heartbeat import Heartbeat
from megajax.checkpoint import TrainingCheckpointer, save_params
from megajax.config import validate
from megajax.flops import mfu, training_flops_per_token
from megajax.metrics import CompilationCacheCounter, MetricsWriter, seconds_since_process_start
from megajax.model import GPT, ModelConfig, count_params
from megajax.parallel import ParallelPlan, local_batch_slice, local_device_coordinates, make_mesh
from megajax.probes import ActivationLog
from megajax.tracing import StepTracer
from megajax.parallel.schedule import ascii_paired_timeline, ascii_timeline
from megajax.step import TrainState


COMPILATION_CACHE = CompilationCacheCounter()


@dataclasses.dataclass
class TrainResult:
  state: TrainState
  history: list[dict]       # the logged metrics, one dict per logged step
  start_step: int = 0       # the checkpoint step this run resumed from (0: a fresh start)
  preempted: bool = False   # stopped early by SIGTERM / SIGINT, after saving a checkpoint


class PreemptionWatcher:
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

  def reached(self, step: int) -> bool:
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      return multihost_utils.reached_preemption_sync_point(step)
    return self._requested.is_set()

  def close(self):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


def build_model(config: ml_collections.ConfigDict) -> GPT:
  return GPT(ModelConfig.from_config(config.model))


def should_log(step: int, config: ml_collections.ConfigDict) -> bool:
  """Step 1 (the starting loss), every log_every steps, and the last step."""
  return step == 1 or step % config.train.log_every == 0 or step == config.train.steps


def _run_loop(config, plan: ParallelPlan, batches, workdir, progress, is_chief, state, start_step,
              checkpointer: TrainingCheckpointer | None, heartbeat: Heartbeat | None):
  """Step -> the loop (with checkpoints); returns the final state, the logged metrics, and
  whether it stopped for a preemption."""
  logging.info("model: %s block, %d layers, %.2fM parameters; mesh dp=%d pp=%d tp=%d, tp_overlap=%s",
               config.model.block, config.model.num_layers, count_params(state.params) / 1e6,
               *plan.mesh.devices.shape, config.parallel.tp_overlap)
  if plan.pipeline is not None:
    schedule = plan.pipeline.schedule
    logging.info("pipeline: %s, %d virtual stages, %s, %d microbatches: bubble %.3f of ideal (one op per "
                 "tick), stash of up to %d activations per stage\n%s\n%s", schedule.name, schedule.virtual_stages, config.parallel.traversal,
                 schedule.microbatches, schedule.bubble_fraction, plan.pipeline.stash_slots,
                 ascii_timeline(schedule), ascii_paired_timeline(schedule))

  # --- Step.
  train_step = plan.train_step()
  meter = _Throughput(config, plan)
  guard = _NonFiniteGuard(config, plan, checkpointer, heartbeat)
  activations = ActivationLog(config, workdir, enabled=is_chief, append=start_step > 0)
  tracer = StepTracer(config, plan.mesh, workdir)

  # --- Loop.
  writer = MetricsWriter(workdir, config.train.steps, enabled=is_chief, progress=progress, append=start_step > 0)
  history = []
  watcher, preempted = PreemptionWatcher(), False
  every = config.checkpoint.every_steps
  poisoned = {int(x) for x in config.debug.nonfinite_steps.split(",") if x.strip()}
  beat = heartbeat.update if heartbeat else lambda **_: None
  try:
    for step in range(start_step + 1, config.train.steps + 1):
      beat(phase=f"step {step}" if step > start_step + 1 else f"step {step} (compiling)")
      batch = next(batches)
      if step in poisoned:     # fault injection: this batch's loss is NaN, as a corrupt batch's would be
        batch = {**batch, "loss_mask": batch["loss_mask"] * float("nan")}
      if step == start_step + 1:
        train_step = _compile_and_meet(train_step, state, batch, config.supervisor.startup_timeout_s)
        if tracer.every:
          tracer.describe(train_step)
      if tracer.wants(step):
        jax.block_until_ready(state)     # the trace holds this step alone
        tracer.start(step)
      state, metrics = train_step(state, batch)
      if tracer.active:
        jax.block_until_ready(metrics)
        logging.info("step %d traced: %s", step, tracer.stop())
      writer.step_done(step)
      # The previous step's loss and skip flag, read while this step runs (no stall): a
      # rollback, if due, replaces the state this step is computing from.
      state = guard.after_dispatch(step, state, metrics)
      metrics = activations.after_dispatch(step, metrics)    # capture/*: to activations.jsonl, one step late
      if step == start_step + 1:
        _log_startup(jax.block_until_ready(metrics), step, writer, heartbeat)
      preempted = watcher.reached(step)
      if should_log(step, config):
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}  # waits for the step
        record = {**metrics, **meter.measure(step), "skipped_steps": guard.skipped}
        history.append({"step": step, **record})
        writer.write(step, record)
      if checkpointer and (preempted or step == config.train.steps or (every and step % every == 0)):
        beat(phase=f"checkpoint save {step}")
        state = guard.before_save(step, state)
        if guard.in_a_row:      # resuming inside a run of skips would forget it: keep the last good one
          logging.warning("step %d: no checkpoint inside a run of %d skipped steps", step, guard.in_a_row)
        else:
          blocking = checkpointer.save(step, state, batches.get_state())
          logging.info("checkpoint %d: the step waited %.3f s (device -> host); writing in the background",
                       step, blocking)
          writer.write(step, {"ckpt_blocking_s": blocking})
      _log_committed(checkpointer, writer)
      if preempted:
        logging.warning("preempted at step %d: %s, stopping", step, "no checkpoint inside a run of skipped steps "
                        "(a restart resumes from the latest one)" if guard.in_a_row else "checkpoint saved")
        break
      if step == config.debug.fail_at_step and config.debug.fail_process in (-1, jax.process_index()):
        os.kill(os.getpid(), signal.SIGKILL)    # fault injection: die as a crash would
    state = guard.flush(state)
    activations.flush()
    if checkpointer:
      beat(phase="checkpoint commit")
      checkpointer.wait()                       # stage 2 of the last save
      _log_committed(checkpointer, writer)
  finally:
    watcher.close()
    writer.close()
  return state, history, preempted


_BARRIERS = itertools.count()


def _compile_and_meet(train_step, state, batch, timeout_s: float):
  """Compiles the step (ahead of time: the trace analysis reads its operations); with several
  processes, then waits at a coordination-service barrier until every process has:
  all enter the step's collectives together. Without it a process that compiles much later (a
  cache miss, a loaded host) leaves the others waiting inside collectives; on CPU, gloo's
  reduce-scatter has a fixed 30 s timeout whose error path can hang (jax-ml/jax#40831), and
  2-process CPU jobs hung, rarely, in their first step that way. The coordination service's
  barrier waits as long as we say."""
  compiled = train_step.lower(state, batch).compile()
  if jax.process_count() == 1:
    return compiled
  from jax._src import distributed   # the job's coordination client (what jax.distributed set up)
  # A barrier's name is used once per job: numbered, for a process that trains more than once.
  distributed.global_state.client.wait_at_barrier(f"megajax_step_compiled_{next(_BARRIERS)}", int(timeout_s * 1000))
  return compiled


def _log_startup(metrics, step: int, writer, heartbeat) -> None:
  """Time from process start to the end of this run's first step (compilation included)."""
  startup = seconds_since_process_start()
  cache = COMPILATION_CACHE.counts
  logging.info("first step done %.1f s after process start (step %d, loss %.4f); persistent compilation "
               "cache: %d hits, %d misses", startup, step, float(metrics["loss"]), cache["hits"], cache["misses"])
  writer.write(step, {"startup_s": startup, "compile_cache_hits": cache["hits"],
                      "compile_cache_misses": cache["misses"]})
  if heartbeat:
    heartbeat.update(startup_s=startup)


class _NonFiniteGuard:
  """The non-finite loss policy around the step, and the heartbeat's step counter.

  The step skips an update whose loss or gradients are not finite (megajax.parallel.step).
  Here each step's skip flag is read one step late (while the next step runs): after
  `train.nonfinite_rollback_after` skips in a row the state itself is suspect, and the run
  rolls back to the latest checkpoint (or the initial state) while the data reads on past
  the failed batches. A save first reads its own step's flag; none is written inside a run
  of skips, so a checkpoint is always a good state to
  roll back to, and a resume from it repeats the uninterrupted run exactly.
  """

  def __init__(self, config, plan: ParallelPlan, checkpointer, heartbeat):
    self.config, self.plan, self.checkpointer, self.heartbeat = config, plan, checkpointer, heartbeat
    self.skipped, self.in_a_row, self.rollbacks = 0, 0, 0
    self.pending = None                     # (step, metrics) not yet read
    self.last_time = None

  def after_dispatch(self, step: int, state, metrics):
    previous, self.pending = self.pending, (step, {"loss": metrics["loss"], "skipped": metrics["skipped"]})
    return self._read(previous, state) if previous else state

  def flush(self, state):
    previous, self.pending = self.pending, None
    return self._read(previous, state) if previous else state

  def _read(self, pending, state):
    step, metrics = pending
    metrics = jax.device_get(metrics)       # waits for that step only
    now = time.time()
    step_time = now - self.last_time if self.last_time else None
    self.last_time = now
    if int(metrics["skipped"]):
      self.skipped += 1
      self.in_a_row += 1
      logging.warning("step %d: non-finite loss (%s) or gradients: update skipped (%d in a row, %d in all)",
                      step, float(metrics["loss"]), self.in_a_row, self.skipped)
    else:
      self.in_a_row = 0
    if self.heartbeat:
      self.heartbeat.update(step=step, loss=float(metrics["loss"]), step_time_s=step_time,
                            skipped_steps=self.skipped)
    if self.in_a_row >= self.config.train.nonfinite_rollback_after:
      return self.rollback(step)
    return state

  def before_save(self, step: int, state):
    """Reads this step's skip flag too (a save waits for the step anyway). The step never
    applies a non-finite update, so the state saved is finite."""
    return self.flush(state)

  def rollback(self, step: int):
    self.rollbacks += 1
    self.in_a_row, self.pending = 0, None   # the step in flight ran on the state being replaced
    restored = None
    if self.checkpointer:
      self.checkpointer.wait()
      restored = self.checkpointer.restore_latest(self.plan)
    if restored is not None:
      state, to_step = restored.state, restored.step
    else:
      state, to_step = self.plan.init_state(jax.random.key(self.config.train.seed)), 0
    logging.warning("step %d: %d non-finite steps in a row: rolled back to the state of step %d (rollback %d); "
                    "the data reads on", step, self.config.train.nonfinite_rollback_after, to_step, self.rollbacks)
    if self.heartbeat:
      self.heartbeat.update(rollbacks=self.rollbacks,
                            last_rollback={"step": step, "to_step": to_step, "time": time.time()})
    return state


class _Throughput:
  """Tokens/s, TFLOP/s per device and MFU between logged steps (the first one compiles:
  measured from its end onwards)."""

  def __init__(self, config, plan: ParallelPlan):
    self.tokens_per_step = config.train.batch_size * config.model.seq_len
    self.flops_per_token = training_flops_per_token(plan.model.config)
    self.device_kind = plan.mesh.devices.flat[0].device_kind
    self.num_devices = plan.mesh.size
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


def _log_committed(checkpointer, writer) -> None:
  """Stage 2 done: each committed save's start-to-commit time, to the log and the metrics."""
  for saved, total in checkpointer.take_finished() if checkpointer else ():
    logging.info("checkpoint %d committed: %.3f s from the start of its save", saved, total)
    writer.write(saved, {"ckpt_total_s": total})


def train(config: ml_collections.ConfigDict, workdir: str | None = None,
          progress: bool | None = None, devices=None) -> TrainResult:
  """Trains on `devices` (default: all of the job's), which must number dp * pp * tp."""
  validate(config)
  is_chief = jax.process_index() == 0

  # --- Model, mesh, and the plan: each parameter's sharding and the optimizer over the shards
  # (the plan refuses what this build cannot run, before anything compiles).
  model = build_model(config)
  mesh = make_mesh(config, devices)
  plan = ParallelPlan.build(config, model, mesh)

  # --- Data (before anything compiles: a bad token file fails fast). One loader per process,
  # reading only the rows of each global batch its devices hold; batches are prefetched onto
  # the devices while the step runs.
  iterator = data.make_iterator(config, *local_batch_slice(mesh, config.train.batch_size))
  if workdir and is_chief:
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(config.to_json(indent=2))

  # --- Checkpoint and state: resume from the latest complete checkpoint, or initialize
  # (each device only its own shards).
  heartbeat = Heartbeat(workdir, jax.process_index(), local_device_coordinates(mesh),
                        config.supervisor.heartbeat_interval_s) if workdir else None
  done = False
  try:
    checkpointer = TrainingCheckpointer(os.path.join(workdir, "checkpoints"), config) if workdir else None
    if heartbeat:
      heartbeat.update(phase="restore")
    restored = checkpointer.restore_latest(plan) if checkpointer else None
    if restored is not None:
      state, start_step = restored.state, restored.step
      iterator.set_state(restored.data_state)
      logging.info("resumed from %s (step %d of %d)", checkpointer.path(restored.step), restored.step,
                   config.train.steps)
    else:
      state, start_step = plan.init_state(jax.random.key(config.train.seed)), 0
    if heartbeat:
      heartbeat.update(start_step=start_step, step=start_step)
    try:
      with data.DevicePrefetcher(iterator, put_fn=plan.put_batch) as batches:
        state, history, preempted = _run_loop(config, plan, batches, workdir, progress, is_chief, state,
                                              start_step, checkpointer, heartbeat)
    finally:
      if checkpointer:
        checkpointer.close()
    done = not preempted
  finally:
    if heartbeat:
      heartbeat.close(done=done)

  # --- Export.
  if workdir and config.checkpoint.save_params and not preempted:
    # The model's own pytree whatever the mesh (the pipeline's stacked layers unstacked),
    # under jit: with several processes no process holds every stage's rows.
    path = save_params(os.path.join(workdir, "params"), jax.jit(plan.model_params)(state.params))
    logging.info("parameters written to %s", path)
  return TrainResult(state=state, history=history, start_step=start_step, preempted=preempted)
