"""Trained checkpoints for the checkpoint tests (the fixture two_checkpoints, in conftest.py),
the 3D step a config restores onto, and damage."""

import copy
import json
import os
import shutil

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

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


def array_files(checkpoint, item="state") -> list[str]:
  """The OCDBT data files of a checkpoint's state (item=""): a params directory's): the arrays' bytes."""
  return [os.path.join(root, name) for root, _, files in os.walk(checkpoint / item) for name in files
          if "/d" in root[len(str(checkpoint)):]]


def truncate_arrays(checkpoint, item="state"):
  for path in array_files(checkpoint, item):
    os.truncate(path, os.path.getsize(path) // 2)


def flip_bytes(checkpoint, count=256, item="state"):
  """Inverts `count` bytes in the middle of the largest array file. The chunks are zstd
  compressed, so where the flip lands decides: a chunk that no longer decodes (unreadable) or
  one that decodes to other numbers (caught by the checksums); the file layout varies between
  runs, so a test must accept either."""
  path = max(array_files(checkpoint, item), key=os.path.getsize)
  data = bytearray(open(path, "rb").read())
  middle = len(data) // 2
  data[middle:middle + count] = bytes(b ^ 0xFF for b in data[middle:middle + count])
  with open(path, "wb") as f:
    f.write(data)


def change_values(checkpoint, count=256):
  """Silent corruption: the state item rewritten as valid files, with `count` values of its
  largest array changed (what bit rot that still decodes reads as). Only the checksums can tell."""
  state = checkpoint / "state"
  with ocp.PyTreeCheckpointer() as checkpointer:
    tree = checkpointer.metadata(state).item_metadata.tree
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    values = checkpointer.restore(state, args=ocp.args.PyTreeRestore(restore_args=restore_args))
  leaves, treedef = jax.tree.flatten(values)
  largest = max(range(len(leaves)), key=lambda i: leaves[i].size)
  flat = leaves[largest].reshape(-1).copy()
  flat[:count] += 1
  leaves[largest] = flat.reshape(leaves[largest].shape)
  with ocp.PyTreeCheckpointer() as checkpointer:
    checkpointer.save(checkpoint / "state.changed", jax.tree.unflatten(treedef, leaves))
  shutil.rmtree(state)
  os.rename(checkpoint / "state.changed", state)


def change_params_values(params_dir, count=256):
  """Silent corruption of a params directory: rewritten as valid files with its own checksums
  kept (Orbax's custom metadata), `count` values of its largest array changed."""
  with ocp.StandardCheckpointer() as checkpointer:
    metadata = checkpointer.metadata(params_dir)
    values = checkpointer.restore(params_dir)
  leaves, treedef = jax.tree.flatten(values)
  largest = max(range(len(leaves)), key=lambda i: leaves[i].size)
  leaves[largest] = leaves[largest].reshape(-1).at[:count].add(1).reshape(leaves[largest].shape)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(params_dir, jax.tree.unflatten(treedef, leaves), force=True,
                      custom_metadata=metadata.custom_metadata)


# Damage to a params directory (a finished run's WORKDIR/params).
PARAMS_DAMAGES = {
    "changed_values": change_params_values,
    "flipped_bytes": lambda params: flip_bytes(params, item=""),
    "truncated_arrays": lambda params: truncate_arrays(params, item=""),
    "garbage_metadata": lambda params: (params / "_CHECKPOINT_METADATA").write_bytes(os.urandom(64)),
}


def edit_meta(checkpoint):
  """Valid JSON with one value changed (the seed): only the meta's digest can tell."""
  path = checkpoint / "meta" / "metadata"
  meta = json.loads(path.read_text())
  meta["seed"] += 1
  path.write_text(json.dumps(meta))


# Damage to a checkpoint -> the reasons its quarantine directory may be named with.
DAMAGES = {
    "changed_values": (change_values, ("checksum",)),
    "flipped_bytes": (flip_bytes, ("checksum", "unreadable")),
    "truncated_arrays": (truncate_arrays, ("unreadable",)),
    "garbage_meta": (lambda c: (c / "meta" / "metadata").write_bytes(os.urandom(64)), ("unreadable",)),
    "edited_meta": (edit_meta, ("meta-digest",)),
    "deleted_meta": (lambda c: shutil.rmtree(c / "meta"), ("unreadable",)),
    "deleted_state_metadata": (lambda c: os.remove(c / "state" / "_METADATA"), ("unreadable",)),
    "deleted_data_state": (lambda c: os.remove(c / "data" / "process_0.json"), ("unreadable",)),
}


def quarantined_as(workdir, step: int, damage: str) -> bool:
  """Whether checkpoint `step` alone is in quarantine/, under one of the damage's reasons."""
  return quarantined(workdir) in [[f"{step}-{reason}"] for reason in DAMAGES[damage][1]]


def quarantined(workdir) -> list[str]:
  directory = workdir / "checkpoints" / "quarantine"
  return sorted(os.listdir(directory)) if directory.exists() else []
