"""The training loop as a library: `train(config, workdir)` runs `config.train.steps` steps.

Sections run in order: model, mesh and plan -> data -> state -> step -> loop -> export.
The launcher (megajax.launch.train) and the Python API both call `train`. Every run, one
device or many, goes through the 3D-parallel step (megajax.parallel.step).
"""

from __future__ import annotations

import dataclasses
import os
import time

from absl import logging
import jax
import ml_collections

from megajax import data
from megajax.checkpoint import save_params
from megajax.config import validate
from megajax.flops import mfu, training_flops_per_token
from megajax.metrics import MetricsWriter
from megajax.model import GPT, ModelConfig, count_params
from megajax.parallel import ParallelPlan, local_batch_slice, make_mesh
from megajax.parallel.schedule import ascii_paired_timeline, ascii_timeline
from megajax.step import TrainState


@dataclasses.dataclass
class TrainResult:
  state: TrainState
  history: list[dict]   # the logged metrics, one dict per logged step


def build_model(config: ml_collections.ConfigDict) -> GPT:
  return GPT(ModelConfig.from_config(config.model))


def should_log(step: int, config: ml_collections.ConfigDict) -> bool:
  """Step 1 (the starting loss), every log_every steps, and the last step."""
  return step == 1 or step % config.train.log_every == 0 or step == config.train.steps


def _run_loop(config, plan: ParallelPlan, batches, workdir, progress, is_chief):
  """State -> step -> the loop; returns the final state and the logged metrics."""
  # --- State: each device initializes only its own shards.
  state = plan.init_state(jax.random.key(config.train.seed))
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
  tokens_per_step = config.train.batch_size * config.model.seq_len
  flops_per_token = training_flops_per_token(plan.model.config)
  device_kind = plan.mesh.devices.flat[0].device_kind
  num_devices = plan.mesh.size

  # --- Loop.
  writer = MetricsWriter(workdir, config.train.steps, enabled=is_chief, progress=progress)
  history = []
  last_log_time, last_log_step = None, 0
  try:
    for step in range(1, config.train.steps + 1):
      state, metrics = train_step(state, next(batches))
      writer.step_done(step)
      if not should_log(step, config):
        continue
      metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}  # waits for the step
      now = time.perf_counter()
      # Step 1 includes compilation: throughput is measured from its end onwards.
      if last_log_time is None:
        throughput = {"tokens_per_sec": None, "tflops_per_device": None, "mfu": None}
      else:
        tokens_per_sec = (step - last_log_step) * tokens_per_step / (now - last_log_time)
        tflops_per_device = tokens_per_sec * flops_per_token / num_devices / 1e12
        throughput = {"tokens_per_sec": tokens_per_sec, "tflops_per_device": tflops_per_device,
                      "mfu": mfu(tflops_per_device, device_kind)}
      last_log_time, last_log_step = now, step
      record = {**metrics, **throughput}
      history.append({"step": step, **record})
      writer.write(step, record)
  finally:
    writer.close()
  return state, history


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
  with data.DevicePrefetcher(iterator, put_fn=plan.put_batch) as batches:
    state, history = _run_loop(config, plan, batches, workdir, progress, is_chief)

  # --- Export.
  if workdir and config.checkpoint.save_params:
    # The model's own pytree whatever the mesh (the pipeline's stacked layers unstacked),
    # under jit: with several processes no process holds every stage's rows.
    path = save_params(os.path.join(workdir, "params"), jax.jit(plan.model_params)(state.params))
    logging.info("parameters written to %s", path)
  return TrainResult(state=state, history=history)
