"""MegaFBD's decoupled step (megajax.parallel.fbd): the forward on one device group, the backward
and the optimizer on another, each with its own dp x tp, equal to the single-device reference:
the first gradients, three LAMB steps' losses and gradient norms, the final parameters (the 3D
step's tolerance, tests/support/reference.py)."""

import jax
import numpy as np
import pytest

from megajax.model import GPT, ModelConfig, init_params
from megajax.parallel.fbd import FbdStep
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
                      forward_dp, forward_tp, backward_dp, backward_tp, params)
  state = fbd.place_state(jax.jit(fresh_train_state, static_argnums=1)(params, fbd.optimizer))
  assert {d for leaf in jax.tree.leaves(state) for d in leaf.sharding.device_set} == set(
      fbd.backward_mesh.devices.flat)
  batch = fixed_batch()
  losses, grad_norms = [], []
  for i in range(STEPS):
    state, metrics, grads = fbd.train_step(state, batch, with_gradients=True)
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
