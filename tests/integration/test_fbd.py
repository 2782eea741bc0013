"""MegaFBD's decoupled step (megajax.parallel.fbd): the forward on one device group, the backward
and the optimizer on another, each with its own dp x tp, equal to the single-device reference:
the first gradients, three LAMB steps' losses and gradient norms, the final parameters (the 3D
step's tolerance, tests/support/reference.py)."""

import math
import signal

import jax
import numpy as np
import pytest

from megajax.checkpoint import TrainingCheckpointer
from megajax.flops import training_flops_per_token
from megajax.model import GPT, ModelConfig, init_params
from megajax.observe import read_metrics
from megajax.trainer import build_parallel_step, drills, train
from megajax.parallel.fbd import FbdStep
from megajax.parallel.zero import gathers_in_compute_dtype
from megajax.reference_step import fresh_train_state
from tests.support.reference import STEPS, fixed_batch, parallel_config, reference, relative_error

# (forward devices, its dp, tp; backward dp, tp): 2+6, 4+4 and 2+2 splits, the tp of the two
# groups different in each.
SPLITS = {"2+6": (2, 2, 1, 3, 2), "4+4": (4, 2, 2, 1, 4), "2+2": (2, 1, 2, 2, 1)}


@pytest.mark.parametrize("split,block,remat,microbatches", [
    ("2+6", "parallel", "dots", 2), ("4+4", "serial", "none", 1), ("2+2", "parallel", "full", 4),
    ("2+2", "serial", "dots", 2)])
def test_fbd_matches_the_single_device_reference(split, block, remat, microbatches):
  forward_devices, forward_dp, forward_tp, backward_dp, backward_tp = SPLITS[split]
  config = parallel_config(block=block, microbatches=microbatches)
  config.model.remat = remat
  initial, ref_grads, (ref_losses, ref_grad_norms), ref_params = reference(
      tuple(sorted(config.model.to_dict().items())))
  model = GPT(ModelConfig.from_config(config.model))
  params = init_params(model, jax.random.key(0))
  devices = jax.devices()
  fbd = FbdStep.build(config, model, devices[:forward_devices],
                      devices[forward_devices:forward_devices + backward_dp * backward_tp],
                      forward_dp, forward_tp, backward_dp, backward_tp)
  state = fbd.place_state(jax.jit(fresh_train_state, static_argnums=1)(params, fbd.optimizer))
  assert {d for leaf in jax.tree.leaves(state) for d in leaf.sharding.device_set} == set(
      fbd.backward_mesh.devices.flat)
  batch = fbd.put_batch(jax.device_get(fixed_batch()))
  step = fbd.train_step(with_gradients=True)
  losses, grad_norms = [], []
  for i in range(STEPS):
    state, metrics, grads = step(state, batch)
    losses.append(float(metrics["loss"]))
    grad_norms.append(float(metrics["grad_norm"]))
    if i == 0:
      errors = jax.tree.map(relative_error, jax.device_get(grads), ref_grads)
      worst = max(jax.tree_util.tree_flatten_with_path(errors)[0], key=lambda kv: kv[1])
      assert worst[1] < 1e-5, f"gradient {jax.tree_util.keystr(worst[0])}: relative error {worst[1]:.2e}"
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  np.testing.assert_allclose(grad_norms, ref_grad_norms, rtol=1e-5)
  errors = jax.tree.map(relative_error, jax.device_get(state.params), ref_params)
  worst = max(jax.tree_util.tree_flatten_with_path(errors)[0], key=lambda kv: kv[1])
  assert worst[1] < 1e-5, f"param {jax.tree_util.keystr(worst[0])} after {STEPS} steps: {worst[1]:.2e}"
  assert int(state.step) == STEPS


def _fbd_run_config():
  """A tiny run in MegaFBD mode: the forward on 2 devices (tp 2), the backward on 4 (dp 2 x
  tp 2); checkpoints and evaluation every 3 steps, a poisoned batch at step 2 (skipped)."""
  config = parallel_config(dp=2, tp=2, microbatches=2)
  config.train.steps, config.train.log_every, config.train.eval_every = 6, 1, 3
  config.checkpoint.every_steps = 3
  config.debug.nonfinite_steps = "2"
  config.parallel.fbd.enabled = True
  config.parallel.fbd.forward_dp, config.parallel.fbd.forward_tp = 1, 2
  return config


def test_fbd_trains_in_the_trainer_and_resumes_exactly(tmp_path, monkeypatch):
  """parallel.fbd through megajax.trainer.train: metrics (MFU over all 6 devices), the skipped
  non-finite step, held-out evaluation on the forward group, checkpoints; a run stopped after
  step 3 (SIGTERM: the preemption's save) resumes to the very same losses and parameters as
  the run that never stopped; its checkpoint restores onto the 3D step's mesh as well."""
  config = _fbd_run_config()
  devices = jax.devices()[:6]
  straight = train(config, str(tmp_path / "straight"), progress=False, devices=devices)
  assert [h["step"] for h in straight.history] == list(range(1, 7))
  assert straight.history[1]["skipped"] == 1 and math.isnan(straight.history[1]["loss"])
  assert straight.history[-1]["skipped_steps"] == 1 and straight.history[0]["skipped"] == 0
  assert int(straight.state.step) == 5        # six steps, one skipped
  records = read_metrics(str(tmp_path / "straight" / "metrics.jsonl"))
  assert [step for step, _ in records["eval_loss"]] == [3, 6] and records["eval_tokens"][0][1] > 0
  # Throughput per device counts both groups' devices.
  (_, tokens_per_sec), (_, tflops_per_device) = records["tokens_per_sec"][-1], records["tflops_per_device"][-1]
  per_token = training_flops_per_token(ModelConfig.from_config(config.model))
  assert tflops_per_device * 1e12 == pytest.approx(tokens_per_sec * per_token / 6, rel=1e-6)

  monkeypatch.setattr(drills, "FAIL_SIGNALS", {"kill": signal.SIGTERM})    # the drill preempts
  config.debug.fail_at_step = 3
  stopped = train(config, str(tmp_path / "stopped"), progress=False, devices=devices)
  assert stopped.preempted and stopped.history[-1]["step"] == 4
  config.debug.fail_at_step = 0
  resumed = train(config, str(tmp_path / "stopped"), progress=False, devices=devices)
  assert resumed.start_step == 4 and [h["step"] for h in resumed.history] == [5, 6]
  assert [h["loss"] for h in resumed.history] == [h["loss"] for h in straight.history[4:]]
  same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), jax.device_get(resumed.state),
                      jax.device_get(straight.state))
  assert all(jax.tree.leaves(same))

  # The same state as the 3D step's (pp = 1): its checkpoint restores there too.
  config_3d = _fbd_run_config()
  config_3d.parallel.fbd.enabled = False
  step_3d = build_parallel_step(config_3d, jax.devices()[:4])
  with TrainingCheckpointer(str(tmp_path / "straight" / "checkpoints"), config_3d, read_only=True) as checkpointer:
    restored = checkpointer.restore_latest(step_3d)
  assert restored.step == 6
  same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), jax.device_get(restored.state.params),
                      jax.device_get(straight.state.params))
  assert all(jax.tree.leaves(same))


def test_fbd_sends_the_weights_in_the_compute_dtype():
  """bf16: the forward group receives the blocks' linears and the head in bf16 (half their
  bytes), the embedding and norms fp32; with one device a group, the losses and gradients are
  the bf16 single-device reference's (the same casts; the gradients w.r.t. the bf16 weights made
  fp32 as the cast's transpose makes them) to fp32 summation order."""
  config = parallel_config(microbatches=2)
  config.model.compute_dtype = "bfloat16"
  _, ref_grads, (ref_losses, _), ref_params = reference(tuple(sorted(config.model.to_dict().items())), microbatches=2)
  model = GPT(ModelConfig.from_config(config.model))
  devices = jax.devices()
  fbd = FbdStep.build(config, model, devices[:1], devices[1:2], 1, 1, 1, 1)
  params = init_params(model, jax.random.key(0))
  state = fbd.place_state(jax.jit(fresh_train_state, static_argnums=1)(params, fbd.optimizer))
  traffic = fbd.traffic()
  halved = sum(x.size * (2 if gathers_in_compute_dtype(tuple(k.key for k in path)) else 4)
               for path, x in jax.tree_util.tree_flatten_with_path(params)[0])
  assert traffic["weight_bytes"] == halved < sum(x.size * 4 for x in jax.tree.leaves(params))
  step = fbd.train_step(with_gradients=True)
  batch = fbd.put_batch(jax.device_get(fixed_batch()))
  losses = []
  for i in range(STEPS):
    state, metrics, grads = step(state, batch)
    losses.append(float(metrics["loss"]))
    if i == 0:
      errors = jax.tree.map(relative_error, jax.device_get(grads), ref_grads)
      assert max(jax.tree.leaves(errors)) < 1e-5
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  errors = jax.tree.map(relative_error, jax.device_get(state.params), ref_params)
  assert max(jax.tree.leaves(errors)) < 1e-5
