"""A checkpoint saved on one mesh, restored onto others: the same values, and training on."""

import copy
import json
import shutil

import jax
import numpy as np
import pytest

from megajax.checkpoint import TrainingCheckpointer
from megajax.trainer import train
from tests.support.checkpoints import parallel_step_for
from tests.support.once import once_per_run


def _small(tiny_config, dp, pp, tp, steps=10, cp=1):
  c = tiny_config
  c.model.num_layers, c.train.batch_size, c.train.microbatches, c.train.steps = 4, 16, 2, steps
  c.train.log_every, c.checkpoint.every_steps, c.checkpoint.keep = 1, 3, 10
  c.parallel.dp, c.parallel.pp, c.parallel.tp, c.parallel.virtual_stages = dp, pp, tp, 2 if pp > 1 else 1
  c.parallel.cp = cp
  if cp > 1:   # local and global layers, the window a whole chunk at cp = 4
    c.model.window, c.model.window_pattern = 3, "LG"
  return c


def _copy_checkpoint(source, workdir, step):
  shutil.copytree(source / "checkpoints" / str(step), workdir / "checkpoints" / str(step))


@pytest.mark.parametrize("mesh", [(1, 2, 4), (4, 1, 2), (8, 1, 1)], ids=["1x2x4", "4x1x2", "8x1x1"])
def test_restore_onto_another_mesh(tmp_path_factory, tiny_config, mesh):
  """Saved at (2,2,2) with interleaved stages, restored at another (dp, pp, tp): the same
  values bit for bit, and training on from step 6 logs the reference run's losses."""
  def reference_run(source):                # 10 steps at (2,2,2), checkpoints 3, 6, 9, 10
    reference = train(_small(_copy_of(tiny_config), 2, 2, 2), str(source), devices=jax.devices())
    (source / "losses.json").write_text(json.dumps({h["step"]: h["loss"] for h in reference.history}))

  source = once_per_run(tmp_path_factory, "reshard_source", reference_run)
  want = {int(k): v for k, v in json.loads((source / "losses.json").read_text()).items()}

  config = _small(tiny_config, *mesh)
  saved_step, parallel_step = parallel_step_for(_small(_copy_of(tiny_config), 2, 2, 2)), parallel_step_for(config)
  saved_copy = tmp_path_factory.mktemp("saved")    # the source is shared: read a copy of it
  _copy_checkpoint(source, saved_copy, 6)
  saved = TrainingCheckpointer(str(saved_copy / "checkpoints"), _small(_copy_of(tiny_config), 2, 2, 2)).restore(6, saved_step.abstract_inputs()[0])
  workdir = tmp_path_factory.mktemp("target")
  _copy_checkpoint(source, workdir, 6)
  checkpointer = TrainingCheckpointer(str(workdir / "checkpoints"), config)
  restored = checkpointer.restore_latest(parallel_step)
  checkpointer.close()
  assert restored.step == 6 and restored.data_state == saved.data_state
  for a, b in zip(jax.tree.leaves(jax.jit(saved_step.model_params)(saved.state.params)),
                  jax.tree.leaves(jax.jit(parallel_step.model_params)(restored.state.params))):
    np.testing.assert_array_equal(a, b)
  result = train(config, str(workdir), devices=jax.devices()[:8])
  assert result.start_step == 6
  np.testing.assert_allclose([h["loss"] for h in result.history], [want[s] for s in range(7, 11)], rtol=1e-5)


def _copy_of(tiny_config):
  """A second, independent copy of the tiny config (the fixture is one object per test)."""
  return copy.deepcopy(tiny_config)


@pytest.mark.parametrize("mesh", [(1, 1, 1, 1), (2, 1, 2, 2)], ids=["cp1", "2x1x2x2"])
def test_restore_across_context_parallel(tmp_path_factory, tiny_config, mesh):
  """Saved at cp = 4 (dp 2 x cp 4), restored at cp = 1 (one device) and cp = 2 (with dp and
  tp): parameters are laid out whatever cp is (cp replicates them), so training on from step
  6 logs the cp = 4 run's losses."""
  def reference_run(source):                # 10 steps at dp 2 x cp 4, checkpoints 3, 6, 9, 10
    reference = train(_small(_copy_of(tiny_config), 2, 1, 1, cp=4), str(source), devices=jax.devices())
    (source / "losses.json").write_text(json.dumps({h["step"]: h["loss"] for h in reference.history}))

  source = once_per_run(tmp_path_factory, "reshard_cp_source", reference_run)
  want = {int(k): v for k, v in json.loads((source / "losses.json").read_text()).items()}
  dp, pp, cp, tp = mesh
  config = _small(tiny_config, dp, pp, tp, cp=cp)
  config.model.window, config.model.window_pattern = 3, "LG"
  workdir = tmp_path_factory.mktemp("target")
  _copy_checkpoint(source, workdir, 6)
  result = train(config, str(workdir), devices=jax.devices()[:dp * pp * cp * tp])
  assert result.start_step == 6
  np.testing.assert_allclose([h["loss"] for h in result.history], [want[s] for s in range(7, 11)], rtol=1e-5)
