"""Training end to end: accumulation, the default job via the launcher, the README's API example."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np

from megajax import data
from megajax.checkpoint import load_params
from megajax.model import GPT, ModelConfig
from megajax.optim import make_optimizer
from megajax.step import init_train_state, make_train_step
from tests.conftest import REPO, run_module


def test_gradient_accumulation_equals_the_full_batch(tiny_config):
  tiny_config.train.batch_size = 8
  batch = next(data.make_iterator(tiny_config, 0, 1))
  batch["loss_mask"][0, :5] = 0.0  # unequal token counts per microbatch: weighting must still be exact
  states = {}
  for microbatches in (1, 4):
    tiny_config.train.microbatches = microbatches
    model = GPT(ModelConfig.from_config(tiny_config.model))
    optimizer = make_optimizer(tiny_config)
    state = init_train_state(model, optimizer, jax.random.key(0))
    step = make_train_step(model, optimizer, tiny_config)
    for _ in range(3):
      state, metrics = step(state, batch)
    states[microbatches] = (state, metrics)
  (one, m1), (four, m4) = states[1], states[4]
  np.testing.assert_allclose(m1["loss"], m4["loss"], rtol=1e-5)
  np.testing.assert_allclose(m1["grad_norm"], m4["grad_norm"], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(four.params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_default_job_through_the_launcher(tmp_path):
  """`megajax-train --config=configs/default.py`: loss falls to <= 0.6x, metrics and params written."""
  workdir = tmp_path / "run"
  result = run_module(["-m", "megajax.launch.train", "--config=configs/default.py", f"--workdir={workdir}"],
                      timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  for key in ("step", "loss", "tokens_per_sec", "tflops_per_device", "mfu"):
    assert all(key in r for r in records), key
  assert records[0]["step"] == 1 and records[-1]["step"] == 300
  assert records[-1]["loss"] <= 0.6 * records[0]["loss"], (records[0]["loss"], records[-1]["loss"])
  assert records[-1]["tokens_per_sec"] > 0 and records[-1]["tflops_per_device"] > 0
  if jax.default_backend() == "cpu":
    assert records[-1]["mfu"] is None  # no known bf16 peak
  else:
    assert 0 < records[-1]["mfu"] < 1
  assert list((workdir / "tensorboard").iterdir()), "no TensorBoard events"
  params = load_params(str(workdir / "params"))
  assert params["layer_0"]["attention"]["query"]["kernel"].shape == (128, 4, 32)


def test_readme_api_example(tmp_path, monkeypatch):
  """The README's Python example runs as written."""
  readme = open(f"{REPO}/README.md").read()
  example = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
  monkeypatch.chdir(REPO)
  namespace = {}
  exec(compile(example.replace("/tmp/megajax-api", str(tmp_path / "api")), "README.md", "exec"), namespace)
  result = namespace["result"]
  assert int(result.state.step) == 40
  assert result.history[-1]["loss"] < result.history[0]["loss"]
  assert bool(jnp.isfinite(namespace["loss"]))
