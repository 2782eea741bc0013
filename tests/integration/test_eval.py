"""Held-out evaluation on the 3D mesh (ParallelStep.eval_step) against the single-device loss.

The eval step's summed cross-entropy over its token count equals megajax.reference_step's
make_loss_fn on the same parameters and tokens, on one device, on a dp x tp mesh and on pp = 2
pipelines (one and two chunks per stage), with gradient-accumulation microbatches; and over
several batches the mean is sum / sum, every token weighing the same.
"""

import jax
import numpy as np
import pytest

from megajax.reference_step import make_loss_fn
from megajax.trainer import evaluation
from megajax.config import validate
from tests.support.reference import fixed_batch, parallel_config, parallel_step_for, pipeline_config


def _configs():
  one = parallel_config(1, 1, microbatches=1)
  dp2_tp4 = parallel_config(2, 4, "parallel", "collective_matmul", microbatches=2)
  serial = parallel_config(2, 2, "serial", "none", microbatches=1)
  pp2 = pipeline_config((1, 2, 2), "1f1b", 1, microbatches=4, rows=16)
  pp2_v2 = pipeline_config((2, 2, 2), "interleaved_1f1b", 2, microbatches=2, layers=4, rows=16)
  return {"1x1x1": one, "dp2-tp4": dp2_tp4, "dp2-tp2-serial": serial, "dp1-pp2-tp2": pp2,
          "dp2-pp2-tp2-v2": pp2_v2}


CONFIGS = _configs()


def _batch(rows, seed):
  """fixed_batch's shapes, other tokens, and a mask that keeps a different number of tokens."""
  rng = np.random.default_rng(seed)
  batch = fixed_batch(rows)
  return {"inputs": rng.permutation(batch["inputs"], axis=1), "targets": rng.permutation(batch["targets"], axis=1),
          "loss_mask": (rng.random(batch["loss_mask"].shape) > 0.2 + 0.3 * seed).astype(np.float32)}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_eval_loss_equals_the_single_device_loss(name):
  config = CONFIGS[name]
  validate(config)
  parallel_step = parallel_step_for(config)
  state = parallel_step.init_state(jax.random.key(1))
  params = parallel_step.model_params(jax.device_get(state.params))
  loss_fn = jax.jit(make_loss_fn(parallel_step.model))
  rows = config.train.batch_size
  batches = [_batch(rows, seed) for seed in range(2)]

  eval_fn = parallel_step.eval_step()
  sums = eval_fn(state.params, parallel_step.put_batch(batches[0]))
  _, want = loss_fn(params, batches[0])
  np.testing.assert_allclose(float(sums["eval_tokens"]), float(want["tokens"]))
  np.testing.assert_allclose(float(sums["eval_loss_sum"] / sums["eval_tokens"]), float(want["loss"]), rtol=1e-5)

  # Over batches: the sum of nll over the sum of tokens (the masks differ per row).
  got = evaluation.evaluate(eval_fn, state.params, batches, parallel_step.put_batch)
  wants = [loss_fn(params, b)[1] for b in batches]
  nll = sum(float(w["loss"]) * float(w["tokens"]) for w in wants)
  tokens = sum(float(w["tokens"]) for w in wants)
  assert got["eval_tokens"] == tokens
  np.testing.assert_allclose(got["eval_loss"], nll / tokens, rtol=1e-5)
  np.testing.assert_allclose(got["eval_perplexity"], np.exp(nll / tokens), rtol=1e-5)


def _packed(batch, seed):
  """The batch with each row cut into documents: segment_ids 1, 2, ... and positions restarting at 0."""
  rng = np.random.default_rng(seed)
  rows, seq = batch["inputs"].shape
  segment_ids, positions = np.zeros((rows, seq), np.int32), np.zeros((rows, seq), np.int32)
  for row in range(rows):
    cuts = np.sort(rng.choice(np.arange(1, seq), size=3, replace=False))
    for doc, (start, stop) in enumerate(zip([0, *cuts], [*cuts, seq]), start=1):
      segment_ids[row, start:stop], positions[row, start:stop] = doc, np.arange(stop - start)
  return {**batch, "segment_ids": segment_ids, "positions": positions}


@pytest.mark.parametrize("name", ["dp2-tp2-serial", "dp1-pp2-tp2"])
def test_eval_of_packed_documents_equals_the_single_device_loss(name):
  """Packed rows (segment_ids, positions): every mesh's forward keeps documents apart as the
  single-device model does (and the loss differs from the same tokens unpacked)."""
  config = CONFIGS[name]
  parallel_step = parallel_step_for(config)
  state = parallel_step.init_state(jax.random.key(1))
  params = parallel_step.model_params(jax.device_get(state.params))
  plain = _batch(config.train.batch_size, 0)
  batch = _packed(plain, 0)
  got = evaluation.evaluate(parallel_step.eval_step(), state.params, [batch], parallel_step.put_batch)
  loss_fn = jax.jit(make_loss_fn(parallel_step.model))
  np.testing.assert_allclose(got["eval_loss"], float(loss_fn(params, batch)[1]["loss"]), rtol=1e-5)
  assert abs(got["eval_loss"] - float(loss_fn(params, plain)[1]["loss"])) > 1e-4
