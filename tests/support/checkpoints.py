"""Trained checkpoints for the checkpoint tests (the fixture two_checkpoints, in conftest.py),
the 3D step a config restores onto, and damage."""

import json
import os

import jax
import ml_collections

from megajax.checkpoint import TrainingCheckpointer
from megajax.trainer import train
from tests.support.reference import parallel_step_for


def run_config(workdir) -> ml_collections.ConfigDict:
  """The config a run trained with: the config.json its process 0 wrote in the workdir."""
  return ml_collections.ConfigDict(json.loads((workdir / "config.json").read_text()))


def train_two_checkpoints(workdir, config):
  """A one-device run of 6 steps with checkpoints 3 and 6 in `workdir`: (workdir, config, its 3D step)."""
  config.train.steps, config.checkpoint.every_steps = 6, 3
  train(config, str(workdir), devices=jax.devices()[:1])
  return workdir, config, parallel_step_for(config)


def restore_latest(workdir, config, parallel_step):
  checkpointer = TrainingCheckpointer(str(workdir / "checkpoints"), config)
  try:
    return checkpointer.restore_latest(parallel_step)
  finally:
    checkpointer.close()


def truncate_arrays(checkpoint):
  for root, _, files in os.walk(checkpoint / "state"):
    for name in files:
      if "/d" in root[len(str(checkpoint)):]:   # the OCDBT data files: the arrays' bytes
        path = os.path.join(root, name)
        os.truncate(path, os.path.getsize(path) // 2)
