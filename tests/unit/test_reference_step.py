"""The single-device reference step: accumulation over microbatches equals the full batch."""

import jax
import numpy as np

from megajax import data
from megajax.model import GPT, ModelConfig
from megajax.optim import make_optimizer
from megajax.reference_step import init_train_state, make_reference_step


def test_gradient_accumulation_equals_the_full_batch(tiny_config):
  tiny_config.train.batch_size = 8
  batch = next(data.make_iterator(tiny_config, 0, 1))
  batch["loss_mask"][0, :5] = 0.0  # unequal token counts per microbatch: weighting must still be exact
  states = {}
  for microbatches in (1, 4):
    tiny_config.train.microbatches = microbatches
    model = GPT(ModelConfig.from_config(tiny_config.model))
    optimizer = make_optimizer(tiny_config.optimizer, tiny_config.train.steps)
    state = init_train_state(model, optimizer, jax.random.key(0))
    step = make_reference_step(model, optimizer, tiny_config)
    for _ in range(3):
      state, metrics = step(state, batch)
    states[microbatches] = (state, metrics)
  (one, m1), (four, m4) = states[1], states[4]
  np.testing.assert_allclose(m1["loss"], m4["loss"], rtol=1e-5)
  np.testing.assert_allclose(m1["grad_norm"], m4["grad_norm"], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(four.params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
