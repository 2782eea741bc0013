"""The training loop as a library: `train(config, workdir)` trains up to `config.train.steps`.

`train` resolves the config once (megajax.sections.RunConfig: checked, frozen, typed
sections) and hands each layer the section it needs. It reads top to bottom as named
sections, each one call: the config's memory estimate
against its devices (parallel.planner.fits) -> the workdir claimed (checked,
locked: one job per workdir) -> the model and the 3D-parallel step -> data -> the workdir
(config, heartbeat, checkpointer) -> state (resume or init) -> compile -> the loop with its
callbacks -> export. The launcher (megajax.launch.train) and the
Python API both call it. Every run, one device or many, goes through the 3D-parallel step
(megajax.parallel.ParallelStep). With a workdir, a run resumes from the latest complete
checkpoint in WORKDIR/checkpoints (`train.steps` is the total target), saves on the
checkpointer's cadence and when preempted (SIGTERM / SIGINT).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os

from absl import logging
import jax
from jax._src import distributed
import ml_collections

from megajax import data
from megajax.checkpoint import TrainingCheckpointer, initial_state, save_params
from megajax.config import validate
from megajax.model import GPT, ModelConfig
from megajax.observe import ActivationLog, CompilationCacheCounter, MetricsWriter, Probes, StepTracer
from megajax.observe.goodput import GoodputClock
from megajax.observe.wandb_tracker import WandbTracker     # imports wandb only when constructed
from megajax.parallel import FbdStep, ParallelStep, local_batch_slice, local_device_coordinates, make_mesh
from megajax.parallel.planner.fits import check_fits
from megajax.reference_step import TrainState
from megajax.sections import RunConfig
from megajax.tokenizer import check_run_identity, copy_tokenizer, record_run_identity, tokenizer_of
from megajax.trainer import callbacks, drills
from megajax.trainer.evaluation import Evaluation
from megajax.trainer.heartbeat import Heartbeat, supervisor_attempt
from megajax.trainer.nonfinite import NonFiniteGuard
from megajax.trainer.workdir import claim_workdir


@dataclasses.dataclass
class TrainResult:
  state: TrainState
  history: list[dict]       # the logged metrics, one dict per logged step
  start_step: int = 0       # the checkpoint step this run resumed from (0: a fresh start)
  preempted: bool = False   # stopped early by SIGTERM / SIGINT, after saving a checkpoint


def build_model(config: RunConfig | ml_collections.ConfigDict) -> GPT:
  """The Flax GPT of a config's model section (a RunConfig's or a ConfigDict's)."""
  return GPT(ModelConfig.from_config(config.model))


def build_parallel_step(config: RunConfig | ml_collections.ConfigDict, devices=None) -> ParallelStep | FbdStep:
  """The 3D-parallel step the trainer runs on `devices` (default: all of the job's): the
  model, the mesh, what to observe (observe.*) and the straggler drill (debug.slow_rank); with
  parallel.fbd.enabled, MegaFBD's decoupled step over the same devices (megajax.parallel.fbd).
  `config`: the run's (a ConfigDict is resolved here, unchecked)."""
  run = RunConfig.of(config)
  model = GPT(run.model)
  if run.parallel.fbd.enabled:
    return FbdStep.from_config(run, model, jax.devices() if devices is None else devices)
  return ParallelStep.build(run, model, make_mesh(run.parallel, devices),
                            probes=Probes.of(run.observe, run.model.num_layers),
                            extra_work=drills.straggler_work(run.debug, run.model))


def train(config: ml_collections.ConfigDict, workdir: str | None = None,
          progress: bool | None = None, devices=None) -> TrainResult:
  """Trains on `devices` (default: all of the job's), which must number dp * pp * tp."""
  validate(config)                # a ConfigError names the field, before anything runs
  run = RunConfig.of(config)      # the config once, as frozen typed sections: the layers take theirs
  # --- Goodput: this run's time by cause from its start (WORKDIR/goodput/, observe/goodput.py).
  clock = GoodputClock(supervisor_attempt())
  # --- Python's garbage collector: collections at the same steps on every process
  # (runtime.gc_every_steps), from the run's start.
  with callbacks.manual_garbage_collection(run.runtime.gc_every_steps):
    # --- A config its devices cannot hold, by the cost model's estimate: refused before the
    # workdir, the data or any compile (the step's build compiles small programs), in an instant.
    check_fits(run, jax.devices() if devices is None else devices)
    # --- The workdir, this job's alone from before anything is written into it to the export:
    # a second job on it, or one it cannot write, fails here with a WorkdirError (workdir.py).
    with claim_workdir(workdir, run.supervisor.startup_timeout_s):
      try:
        result = _train(run, workdir, progress, devices, clock)
      except BaseException:
        clock.close("error")
        raise
      clock.close("preempted" if result.preempted else "finished")
      return result


def _train(run: RunConfig, workdir: str | None, progress: bool | None, devices, clock: GoodputClock) -> TrainResult:
  outcome = {"finished": False}       # the heartbeat's last beat reads it as the stack closes
  with contextlib.ExitStack() as cleanup:    # everything opened below closes in reverse, always
    clock.lap("start")
    # --- Watching the compiles: every one of this run's, for the persistent cache's hits and misses.
    cache = cleanup.enter_context(CompilationCacheCounter())

    # --- Model, mesh and the 3D-parallel step (refusing what this build cannot run, before any compile).
    parallel_step = build_parallel_step(run, devices)

    # --- Data: one loader per process, reading only the rows of each global batch its devices
    # hold, its held-out pass, opened once (a bad token file fails here, before anything compiles).
    pipeline = data.open_pipeline(run, *local_batch_slice(parallel_step.mesh, run.train.batch_size))
    iterator = pipeline.iterator
    evaluation = Evaluation.every_steps(run.train.eval_every, parallel_step, pipeline.eval_dataset)   # or None

    # --- Preemption: SIGTERM / SIGINT from here on ask for a save after the next step.
    preemption = cleanup.enter_context(callbacks.Preemption())

    # --- Workdir: the config, this process's heartbeat, the checkpointer.
    heartbeat, checkpointer = _open_workdir(run, workdir, parallel_step, cleanup, outcome, pipeline.token_paths)
    clock.lap("setup")
    if workdir and jax.process_index() == 0:    # written from here: a refused start leaves none
      clock.open(workdir, run.supervisor.heartbeat_interval_s)

    # --- State: the latest complete checkpoint (and the data position it saved), or a fresh one.
    state, start_step = _restore_or_init(run.train, parallel_step, checkpointer, iterator, heartbeat)
    clock.set_start_step(start_step)
    clock.lap("restore")
    for record in (pipeline.description, *parallel_step.describe()):    # data; model and mesh; pipeline
      logging.info("%s", record)

    # --- Batches onto the devices from there, prefetched (a thread) while the step compiles and runs.
    batches = cleanup.enter_context(data.DevicePrefetcher(iterator, put_fn=parallel_step.put_batch))

    # --- Step: compiled ahead of time; with several processes, every one meets the others first.
    step_fn = _compile_and_meet(run, parallel_step, heartbeat, start_step, evaluation, checkpointer)
    clock.set_cache(cache.counts)
    clock.lap("compile")

    # --- Loop: the steps, each between its collaborators' callbacks.
    writer = MetricsWriter(workdir, run.train.steps, enabled=jax.process_index() == 0, progress=progress,
                           start_step=start_step, tracker=WandbTracker.for_run(run.observe, run.record, workdir))
    cleanup.callback(writer.close)
    loop = callbacks.Loop(run.train, parallel_step, start_step, state, batches, heartbeat=heartbeat, writer=writer,
                          clock=clock)
    clock.lap("setup")
    _run_loop(loop, step_fn, _callbacks(run, loop, workdir, checkpointer, step_fn, cache, preemption, evaluation))
    outcome["finished"] = not loop.preempted

  # --- Export: the trained parameters, the model's own pytree whatever the mesh.
  if workdir and run.checkpoint.save_params and outcome["finished"]:
    # Under jit: with several processes no process holds every stage's rows.
    path = save_params(os.path.join(workdir, "params"), jax.jit(parallel_step.model_params)(loop.state.params))
    logging.info("parameters written to %s", path)
  return TrainResult(state=loop.state, history=loop.history, start_step=start_step, preempted=loop.preempted)


def _run_loop(loop: callbacks.Loop, step_fn, collaborators: list[callbacks.Callback]) -> None:
  """The steps from the one after loop.start_step to train.steps, each between its callbacks.
  The heartbeat names the step before its batch is fetched: a data stall shows in that step.
  The goodput clock charges the wait for the batch to data_wait and the rest to the step but
  what evaluation, checkpointing and a rollback charge to themselves (loop.clock.lap)."""
  clock = loop.clock
  for step in range(loop.start_step + 1, loop.train.steps + 1):
    loop.step = step
    loop.beat(phase=f"step {step}")
    clock.lap("steps")
    loop.batch = next(loop.batches)
    clock.lap("data_wait")
    for collaborator in collaborators:
      collaborator.before_step(loop)
    loop.state, loop.metrics = step_fn(loop.state, loop.batch)
    for collaborator in collaborators:
      collaborator.after_step(loop)
    if loop.preempted:
      break
  clock.lap("steps")            # (nonfinite.NonFiniteGuard tells the clock which steps finished)
  for collaborator in collaborators:
    collaborator.on_end(loop)



def _callbacks(run: RunConfig, loop: callbacks.Loop, workdir, checkpointer, step_fn, cache, preemption,
               evaluation) -> list:
  """The loop's collaborators, in the order they are called at each point of a step; each
  takes the section it reads."""
  parallel_step, is_chief = loop.parallel_step, jax.process_index() == 0
  guard = NonFiniteGuard(run.train, checkpointer)
  return [
      drills.PoisonedBatches(run.debug),                                 # debug.nonfinite_steps: before all
      callbacks.Tracing(StepTracer(run.observe, parallel_step.mesh, workdir), step_fn),   # observe.trace_every
      guard,                                                             # non-finite: skip, roll back
      callbacks.ActivationCapture(ActivationLog(run.observe, workdir, enabled=is_chief, start_step=loop.start_step)),
      callbacks.StartupLog(cache),                                       # time to the first step
      preemption,                                                        # SIGTERM: save and stop
      callbacks.MetricsLog(run.train, parallel_step, guard),             # metrics.jsonl, progress
      *([evaluation] if evaluation else []),                             # train.eval_every: held-out loss
      callbacks.Checkpointing(checkpointer, guard),                      # the checkpointer's cadence
      drills.FailAtStep(run.debug),                                      # debug.fail_at_step: after the save
      callbacks.GarbageCollection(run.runtime.gc_every_steps),           # after the step's work is queued
  ]


# --- The sections' one calls.

def _open_workdir(run: RunConfig, workdir: str | None, parallel_step: ParallelStep, cleanup, outcome: dict,
                  token_paths: list[str]):
  """(heartbeat, checkpointer), both None without a workdir; process 0 writes config.json."""
  if not workdir:
    return None, None
  tokenizer_data = _checked_tokenizer(token_paths, workdir)    # before anything is written
  if jax.process_index() == 0:
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(run.json)
    if tokenizer_data:
      _adopt_tokenizer(tokenizer_data, workdir)
  heartbeat = Heartbeat(workdir, jax.process_index(), local_device_coordinates(parallel_step.mesh),
                        run.supervisor.heartbeat_interval_s)
  cleanup.callback(lambda: heartbeat.close(done=outcome["finished"]))
  checkpointer = TrainingCheckpointer(os.path.join(workdir, "checkpoints"), run)
  cleanup.callback(checkpointer.close)
  return heartbeat, checkpointer


def _checked_tokenizer(paths: list[str], workdir: str) -> str | None:
  """The token file whose tokenizer the run adopts (every file's is the same: data.make_sources
  checks), None for synthetic data. Checked on every process before the workdir is written,
  the restore or the compile: its tokenizer file must load and match its sidecar, and be the
  one this workdir's run trained with, if any (a ConfigError: a refused start leaves the
  workdir as it was). `paths`: the run's token files (data.token_file_paths)."""
  if not paths:
    return None
  tokenizer_of(paths[0])
  check_run_identity(workdir, paths[0])
  return paths[0]


def _adopt_tokenizer(data_path: str, workdir: str) -> None:
  """data_path's tokenizer recorded (WORKDIR/tokenizer.identity.json) and copied into
  WORKDIR/tokenizer/, so that the run's samples and exported weights are read with the very
  vocabulary they were trained on (no file for bytes)."""
  copied = copy_tokenizer(data_path, os.path.join(workdir, "tokenizer"))
  record_run_identity(workdir, data_path, write=True)
  if copied:
    logging.info("tokenizer of %s copied to %s", data_path, copied)


def _restore_or_init(train, parallel_step: ParallelStep, checkpointer, iterator, heartbeat):
  """(state, its step): the latest readable checkpoint onto this run's mesh, with the data
  iterator set to the position it saved; else a fresh state: from train.init_params when set
  (fine-tuning), or each device initializing only its own shards."""
  if heartbeat:
    heartbeat.update(phase="restore")
  restored = checkpointer.restore_latest(parallel_step) if checkpointer else None
  if restored is not None:
    state, start_step = restored.state, restored.step
    iterator.set_state(restored.data_state)
    logging.info("resumed from %s (step %d of %d)", checkpointer.path(restored.step), restored.step,
                 train.steps)
  elif train.init_params:
    state, start_step = initial_state(parallel_step, train.init_params), 0
    logging.info("initialized from the parameters in %s (train.init_params)", train.init_params)
  else:
    state, start_step = parallel_step.init_state(jax.random.key(train.seed)), 0
  if heartbeat:
    heartbeat.update(start_step=start_step, step=start_step)
  return state, start_step


_BARRIERS = itertools.count()


def _compile_and_meet(run: RunConfig, parallel_step: ParallelStep, heartbeat, start_step: int, evaluation=None,
                      checkpointer=None):
  """Compiles the step ahead of time (from its abstract inputs: the trace analysis reads its
  operations); with several processes, then waits at a coordination-service barrier until
  every process has: all enter the step's collectives together. Without it a process that
  compiles much later (a cache miss, a loaded host) leaves the others waiting inside
  collectives; on CPU, gloo's reduce-scatter has a fixed 30 s timeout whose error path can
  hang (jax-ml/jax#40831), and 2-process CPU jobs hung, rarely, in their first step that way.
  The coordination service's barrier waits as long as we say. None when the checkpoint is
  at train.steps already: nothing to run (every process restored the same step). The
  evaluation's program (train.eval_every) and the checkpoints' checksums compile here too, before
  the barrier, for the same reason (and so that the first save does not hold the step for a compile)."""
  if start_step >= run.train.steps:
    return None
  if heartbeat:
    heartbeat.update(phase="compiling the step")
  compiled = parallel_step.compiled_train_step()
  if evaluation:
    evaluation.compile()
  if checkpointer:
    checkpointer.compile_checksums(parallel_step.abstract_inputs()[0])
  if jax.process_count() > 1:
    # A barrier's name is used once per job: numbered, for a process that trains more than once.
    distributed.global_state.client.wait_at_barrier(f"megajax_step_compiled_{next(_BARRIERS)}",
                                                    int(run.supervisor.startup_timeout_s * 1000))
  return compiled
