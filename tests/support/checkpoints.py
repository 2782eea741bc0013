"""Trained checkpoints for the checkpoint tests (the fixture two_checkpoints, in conftest.py),
the 3D step a config restores onto, and damage."""

import copy
import json
import os
import shutil

import jax
import ml_collections

from megajax.checkpoint import TrainingCheckpointer
from megajax.trainer import train
from tests.support.once import once_per_run
from tests.support.reference import parallel_step_for


def run_config(workdir) -> ml_collections.ConfigDict:
  """The config a run trained with: the config.json its process 0 wrote in the workdir."""
  return ml_collections.ConfigDict(json.loads((workdir / "config.json").read_text()))


def train_two_checkpoints(workdir, config, tmp_path_factory):
  """A one-device run of 6 steps with checkpoints 3 and 6 in `workdir`: (workdir, config, its
  3D step). The run is made once per test run (the tiny config's) and copied: tests damage it."""
  config.train.steps, config.checkpoint.every_steps = 6, 3
  source = once_per_run(tmp_path_factory, "two_checkpoints",
                        lambda path: train(copy.deepcopy(config), str(path), devices=jax.devices()[:1]))
  assert run_config(source).to_json() == config.to_json(), "two_checkpoints is made from the unchanged tiny_config"
  shutil.copytree(source, workdir, dirs_exist_ok=True)
  return workdir, config, parallel_step_for(config)


def restore_latest(workdir, config, parallel_step):
  checkpointer = TrainingCheckpointer(str(workdir / "checkpoints"), config)
  try:
    return checkpointer.restore_latest(parallel_step)
  finally:
    checkpointer.close()


def array_files(checkpoint) -> list[str]:
  """The OCDBT data files of a checkpoint's state: the arrays' bytes."""
  return [os.path.join(root, name) for root, _, files in os.walk(checkpoint / "state") for name in files
          if "/d" in root[len(str(checkpoint)):]]


def truncate_arrays(checkpoint):
  for path in array_files(checkpoint):
    os.truncate(path, os.path.getsize(path) // 2)


def flip_bytes(checkpoint, count=256):
  """Inverts `count` bytes in the middle of the largest array file: it still reads, as other numbers."""
  path = max(array_files(checkpoint), key=os.path.getsize)
  data = bytearray(open(path, "rb").read())
  middle = len(data) // 2
  data[middle:middle + count] = bytes(b ^ 0xFF for b in data[middle:middle + count])
  with open(path, "wb") as f:
    f.write(data)


def edit_meta(checkpoint):
  """Valid JSON with one value changed (the seed): only the meta's digest can tell."""
  path = checkpoint / "meta" / "metadata"
  meta = json.loads(path.read_text())
  meta["seed"] += 1
  path.write_text(json.dumps(meta))


# Damage to a checkpoint -> the reason its quarantine directory is named with.
DAMAGES = {
    "flipped_bytes": (flip_bytes, "checksum"),
    "truncated_arrays": (truncate_arrays, "unreadable"),
    "garbage_meta": (lambda c: (c / "meta" / "metadata").write_bytes(os.urandom(64)), "unreadable"),
    "edited_meta": (edit_meta, "meta-digest"),
    "deleted_meta": (lambda c: shutil.rmtree(c / "meta"), "unreadable"),
    "deleted_state_metadata": (lambda c: os.remove(c / "state" / "_METADATA"), "unreadable"),
    "deleted_data_state": (lambda c: os.remove(c / "data" / "process_0.json"), "unreadable"),
}


def quarantined(workdir) -> list[str]:
  directory = workdir / "checkpoints" / "quarantine"
  return sorted(os.listdir(directory)) if directory.exists() else []
