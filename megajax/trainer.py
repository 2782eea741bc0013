"""The training loop as a library: `train(config, workdir)` runs `config.train.steps` steps.

Sections run in order: model and optimizer -> data -> state -> step -> loop -> export.
The launcher (megajax.launch.train) and the Python API both call `train`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

from absl import logging
import jax
import ml_collections

from megajax import data
from megajax.checkpoint import save_params
from megajax.config import check_runnable, validate
from megajax.flops import mfu, training_flops_per_token
from megajax.metrics import MetricsWriter
from megajax.model import GPT, ModelConfig, count_params
from megajax.optim import make_optimizer
from megajax.parallel import mesh_shape
from megajax.step import TrainState, init_train_state, make_train_step


@dataclasses.dataclass
class TrainResult:
  state: TrainState
  history: list[dict]   # the logged metrics, one dict per logged step


def build_model(config: ml_collections.ConfigDict) -> GPT:
  return GPT(ModelConfig.from_config(config.model))


def should_log(step: int, config: ml_collections.ConfigDict) -> bool:
  """Step 1 (the starting loss), every log_every steps, and the last step."""
  return step == 1 or step % config.train.log_every == 0 or step == config.train.steps


def _run_loop(config, model, optimizer, batches, workdir, progress, is_chief):
  """State -> step -> the loop; returns the final state and the logged metrics."""
  # --- State.
  state = init_train_state(model, optimizer, jax.random.key(config.train.seed))
  logging.info("model: %s block, %d layers, %.2fM parameters", config.model.block,
               config.model.num_layers, count_params(state.params) / 1e6)

  # --- Step.
  train_step = make_train_step(model, optimizer, config)
  tokens_per_step = config.train.batch_size * config.model.seq_len
  flops_per_token = training_flops_per_token(model.config)
  device_kind = jax.devices()[0].device_kind
  num_devices = math.prod(mesh_shape(config))

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
          progress: bool | None = None) -> TrainResult:
  validate(config)
  check_runnable(config, jax.process_count())
  is_chief = jax.process_index() == 0

  # --- Model and optimizer.
  model = build_model(config)
  optimizer = make_optimizer(config)

  # --- Data (before anything compiles: a bad token file fails fast). One loader per process;
  # batches are prefetched onto the device while the step runs.
  iterator = data.make_iterator(config)
  if workdir and is_chief:
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
      f.write(config.to_json(indent=2))
  with data.DevicePrefetcher(iterator, put_fn=jax.device_put) as batches:
    state, history = _run_loop(config, model, optimizer, batches, workdir, progress, is_chief)

  # --- Export.
  if workdir and config.checkpoint.save_params:
    path = save_params(os.path.join(workdir, "params"), state.params)
    logging.info("parameters written to %s", path)
  return TrainResult(state=state, history=history)
