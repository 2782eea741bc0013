"""LAMB equals the hand-written formula; masks keep biases and norms out of decay and trust."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from megajax.config import default_config
from megajax.optim import learning_rate_schedule, make_optimizer, matrix_mask


def small_tree():
  rng = np.random.default_rng(0)
  return {
      "layer": {"kernel": rng.normal(size=(4, 3)), "bias": rng.normal(size=(3,)) * 0.1},
      "norm": {"scale": 1 + rng.normal(size=(3,)) * 0.1},
      "embedding": rng.normal(size=(5, 2, 3)),
  }


def lamb_by_hand(params, grads_per_step, lr, b1, b2, eps, wd):
  """LAMB (You et al. 2020), numpy, with decay and trust ratio on matrices only."""
  matrix = {"kernel", "embedding"}
  m = {k: np.zeros_like(v) for k, v in params.items()}
  v = {k: np.zeros_like(val) for k, val in params.items()}
  w = dict(params)
  for t, grads in enumerate(grads_per_step, start=1):
    for name in w:
      g = grads[name]
      m[name] = b1 * m[name] + (1 - b1) * g
      v[name] = b2 * v[name] + (1 - b2) * g * g
      m_hat = m[name] / (1 - b1 ** t)
      v_hat = v[name] / (1 - b2 ** t)
      update = m_hat / (np.sqrt(v_hat) + eps)
      if name.split("/")[-1] in matrix:
        update = update + wd * w[name]
        w_norm, u_norm = np.linalg.norm(w[name]), np.linalg.norm(update)
        update = update * (w_norm / u_norm if w_norm > 0 and u_norm > 0 else 1.0)
      w[name] = w[name] - lr * update
  return w


def flat(tree):
  return {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v)
          for path, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_lamb_matches_the_formula():
  config = default_config()
  o = config.optimizer
  o.grad_clip_norm, o.warmup_steps, o.end_lr_ratio, o.learning_rate = 0.0, 0, 1.0, 0.05  # constant lr
  o.weight_decay, o.b1, o.b2, o.eps = 0.1, 0.9, 0.99, 1e-6
  params = jax.tree.map(jnp.asarray, small_tree())
  rng = np.random.default_rng(1)
  grads_per_step = [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape)), params) for _ in range(3)]

  optimizer = make_optimizer(config.optimizer, config.train.steps)
  state = optimizer.init(params)
  current = params
  for grads in grads_per_step:
    updates, state = optimizer.update(grads, state, current)
    current = optax.apply_updates(current, updates)

  expected = lamb_by_hand(flat(params), [flat(g) for g in grads_per_step], 0.05, 0.9, 0.99, 1e-6, 0.1)
  got = flat(current)
  for name in expected:
    np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_trust_ratio_and_decay_skip_biases_and_norm_scales():
  mask = flat(matrix_mask(small_tree()))
  assert mask == {"embedding": True, "layer/bias": False, "layer/kernel": True, "norm/scale": False}
  # optax.lamb would apply a trust ratio to the bias too: ours differs exactly there.
  config = default_config()
  config.optimizer.grad_clip_norm, config.optimizer.warmup_steps = 0.0, 0
  params = jax.tree.map(jnp.asarray, small_tree())
  grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.3), params)
  ours, _ = make_optimizer(config.optimizer, config.train.steps).update(grads, make_optimizer(config.optimizer, config.train.steps).init(params), params)
  lr = float(learning_rate_schedule(config.optimizer, config.train.steps)(0))
  plain = optax.lamb(lr, b1=0.9, b2=0.999, eps=1e-6, weight_decay=0.01, mask=matrix_mask)
  theirs, _ = plain.update(grads, plain.init(params), params)
  np.testing.assert_allclose(ours["layer"]["kernel"], theirs["layer"]["kernel"], rtol=1e-6)
  assert not np.allclose(ours["layer"]["bias"], theirs["layer"]["bias"])


def test_warmup_cosine_schedule():
  config = default_config()
  config.train.steps, config.optimizer.warmup_steps = 100, 10
  config.optimizer.learning_rate, config.optimizer.end_lr_ratio = 1.0, 0.1
  schedule = learning_rate_schedule(config.optimizer, config.train.steps)  # indexed by update count: 0 is the first update
  np.testing.assert_allclose(float(schedule(0)), 0.1, rtol=1e-6)   # 1/10 of the warmup, not 0
  np.testing.assert_allclose(float(schedule(9)), 1.0, rtol=1e-6)   # warmup done
  np.testing.assert_allclose(float(schedule(99)), 0.1, rtol=1e-6)  # the last update: end value
  assert float(schedule(50)) > float(schedule(90))


def second_update(config, params, first_scale, second_scale):
  optimizer = make_optimizer(config.optimizer, config.train.steps)
  state = optimizer.init(params)
  for scale in (first_scale, second_scale):
    grads = jax.tree.map(lambda p: jnp.full(p.shape, scale), params)
    updates, state = optimizer.update(grads, state, params)
  return flat(updates)


def test_global_norm_clipping_with_adamw():
  """A clipped huge gradient no longer dominates Adam's moments at the next step."""
  config = default_config()
  config.optimizer.name, config.optimizer.warmup_steps = "adamw", 0
  params = jax.tree.map(jnp.asarray, small_tree())
  config.optimizer.grad_clip_norm = 0.0
  unclipped = second_update(config, params, 100.0, 0.01)
  config.optimizer.grad_clip_norm = 1e9
  never_triggers = second_update(config, params, 100.0, 0.01)
  config.optimizer.grad_clip_norm = 0.5
  clipped = second_update(config, params, 100.0, 0.01)
  for name in unclipped:
    np.testing.assert_allclose(never_triggers[name], unclipped[name], rtol=1e-6)
    assert not np.allclose(clipped[name], unclipped[name], rtol=1e-2), name
