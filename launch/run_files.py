"""A finished (or running) training run's files, as the commands that read a workdir need
them: its config, its trained parameters on one device, its tokenizer.

    config = run_config(workdir)        # WORKDIR/config.json over today's defaults, validated
    params = run_params(workdir, config)  # the newest of WORKDIR/params and the latest checkpoint
    tokenizer = workdir_tokenizer(workdir)  # megajax.tokenizer: WORKDIR/tokenizer/, else bytes

Every failure is a ConfigError or a CheckpointError with a one-line message.
"""

from __future__ import annotations

import os

from absl import logging
import jax
import ml_collections

from megajax.checkpoint import CheckpointError, TrainingCheckpointer, load_params
from megajax.config import ConfigError, read_run_config, validate
from megajax.tokenizer import workdir_tokenizer, workdir_tokenizer_file
from megajax.trainer import build_parallel_step

__all__ = ["run_config", "run_params", "workdir_tokenizer", "workdir_tokenizer_file"]


def run_config(workdir: str) -> ml_collections.ConfigDict:
  """The run's config, validated (a ConfigError names the bad field)."""
  if not os.path.isdir(workdir):
    raise ConfigError("workdir", workdir, "no such directory", "pass the --workdir a megajax-train run wrote")
  config = read_run_config(workdir)
  try:
    validate(config)
  except (TypeError, ValueError) as error:    # a field of the wrong type in a hand-edited file
    raise ConfigError("config", os.path.join(workdir, "config.json"), str(error), "fix or rewrite it") from None
  return config


def _mtime(path: str) -> float:
  try:
    return os.path.getmtime(path)
  except FileNotFoundError:
    return float("-inf")


def _latest_checkpoint(checkpoints: str) -> tuple[str | None, float]:
  """(the newest step directory under `checkpoints`, its mtime); listed again when it vanished
  before its mtime was read (a running trainer's checkpoint.keep, after it committed a newer one)."""
  while True:
    steps = sorted(int(name) for name in os.listdir(checkpoints) if name.isdigit()) if os.path.isdir(checkpoints) else []
    if not steps:
      return None, float("-inf")
    latest = os.path.join(checkpoints, str(steps[-1]))
    if (mtime := _mtime(latest)) > float("-inf"):
      return latest, mtime


def run_params(workdir: str, config: ml_collections.ConfigDict) -> tuple[dict, str]:
  """(the model's parameter pytree on this process's first device, where it came from).

  WORKDIR/params (written when training ends) unless a checkpoint was saved after it (a run
  still going, or resumed since); a checkpoint is restored on one device through the run's own
  step (any mesh restores onto another), read-only (a running trainer's saves are left alone),
  and its parameters taken out of the step's layout. params/ that fails its checksums or
  cannot be read gives way to the latest checkpoint that passes its own, with a warning; with
  none, a CheckpointError says so."""
  exported = os.path.join(workdir, "params")
  checkpoints = os.path.join(workdir, "checkpoints")
  latest, latest_mtime = _latest_checkpoint(checkpoints)
  if os.path.isdir(exported) and _mtime(exported) >= latest_mtime:
    try:
      return load_params(exported), exported
    except CheckpointError as error:
      if latest is None:
        raise CheckpointError(f"{error}; and {workdir} has no checkpoint to read instead: restore params/ from a "
                              "copy, or train again") from None
      logging.warning("%s; reading the latest checkpoint that passes its checksums instead", error)
  if latest is None:
    raise CheckpointError(f"{workdir}: no trained parameters (neither params/ nor a checkpoint); "
                          f"megajax-train --workdir={workdir} writes them")
  one_device = config.copy_and_resolve_references()
  for axis in ("dp", "pp", "cp", "tp", "virtual_stages"):
    one_device.parallel[axis] = 1
  one_device.parallel.schedule = "1f1b"
  one_device.parallel.fbd.enabled = False     # a MegaFBD run's state is a pp = 1 state: one device reads it
  one_device.train.microbatches = 1
  parallel_step = build_parallel_step(one_device, jax.local_devices()[:1])
  with TrainingCheckpointer(checkpoints, one_device, read_only=True) as checkpointer:
    restored = checkpointer.restore_latest(parallel_step)
  if restored is None:
    raise CheckpointError(f"{checkpoints}: no checkpoint to restore")
  return jax.jit(parallel_step.model_params)(restored.state.params), checkpointer.path(restored.step)
