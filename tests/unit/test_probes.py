"""Activation capture and perturbation (megajax.observe.probes) in the 3D step, on 8 CPU devices.

Captured statistics against the single-device Flax model's own intermediates, on one device
and on a dp=2 x tp=2 mesh with two microbatches (the psums and the microbatch combination);
perturbations against what they must do to the loss; the default config's step free of
both; the trainer's activations.jsonl.
"""

import math
import re

import jax
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from megajax.config import ConfigError, default_config, validate
from megajax.layers import rotary_embedding, sliding_window_mask, xla_attention
from megajax.model import GPT, ModelConfig, init_params
from megajax.parallel import ParallelStep, collectives, make_mesh
from megajax.parallel.mesh import DP, batch_spec
from megajax.parallel.tensor_parallel import compute_form, loss_sums
from megajax.observe.records import ACTIVATIONS, METRICS
from megajax.trainer import train
from tests.support.records import jsonl
from tests.support.reference import parallel_step_for

BATCH, SEQ, VOCAB, WINDOW, SAMPLE = 4, 32, 256, 8, 4
POINTS = "0:attn_probs,*:residual,1:attn_out,1:mlp_out"


def probe_config(dp=1, tp=1, pp=1, microbatches=1, **observe):
  c = default_config()
  c.model.num_layers, c.model.hidden_dim, c.model.num_heads = 2, 64, 4
  c.model.seq_len, c.model.vocab_size = SEQ, VOCAB
  c.model.window, c.model.window_pattern = WINDOW, "LG"     # layer 0 local, layer 1 global
  c.model.compute_dtype = "float32"
  c.train.batch_size, c.train.microbatches = BATCH, microbatches
  c.parallel.dp, c.parallel.tp, c.parallel.pp = dp, tp, pp
  for field, value in observe.items():
    c.observe[field] = value
  validate(c)
  return c


def fixed_batch(copy=False):
  rng = np.random.default_rng(0)
  inputs = rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32)
  targets = inputs if copy else rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32)
  return {"inputs": inputs, "targets": targets, "loss_mask": np.ones((BATCH, SEQ), np.float32)}


def step_metrics(config, params=None):
  """The first step's metrics (computed on the initial params) and those params."""
  parallel_step = parallel_step_for(config)
  state = parallel_step.init_state(jax.random.key(0))
  initial = jax.device_get(parallel_step.model_params(state.params))
  _, metrics = parallel_step.train_step()(state, parallel_step.put_batch(fixed_batch()))
  return jax.device_get(metrics), initial


def forward(config, params, batch):
  """The sharded forward pass alone, as the first step runs it (cheaper to compile than the
  step): {"loss", capture/...}."""
  parallel_step = parallel_step_for(config)

  def metrics(params, batch):
    probes = parallel_step.probes.bind(None) if parallel_step.probes else None    # step 0, the first step's key
    if probes:
      batch = {**batch, "rows": probes.rows(batch)}
    c = parallel_step.model.config
    _, stats = loss_sums(compute_form(params, c), batch, c, parallel_step.overlap, probes=probes)
    out = {"loss": collectives.psum(stats["nll_sum"], DP) / collectives.psum(stats["tokens"], DP)}
    return {**out, **probes.metrics(stats["capture"])} if "capture" in stats else out

  mapped = jax.shard_map(metrics, mesh=parallel_step.mesh,
                         in_specs=(parallel_step.state_specs.params, batch_spec(parallel_step.mesh)), out_specs=P())
  return jax.device_get(jax.jit(mapped)(params, parallel_step.put_batch(batch)))


def pipeline_loss(config):
  """The loss of the step's forward / backward (its gradient program: the step without the
  optimizer, cheaper to compile) on the initial params, at step 0."""
  parallel_step = parallel_step_for(config)
  params = parallel_step.init_state(jax.random.key(0)).params
  _, stats = jax.device_get(parallel_step.summed_gradients()(params, parallel_step.put_batch(fixed_batch())))
  return stats["nll_sum"] / stats["tokens"]


def reference_tensors(config, params) -> dict:
  """The captured tensors, from the Flax model's intermediates: attention recomputed from its
  query / key / value projections, in global layouts (probabilities [b, heads, q, k])."""
  model = GPT(ModelConfig.from_config(config.model))
  _, state = model.apply({"params": params}, fixed_batch()["inputs"], capture_intermediates=True,
                         mutable=["intermediates"])
  inter = jax.device_get(state["intermediates"])
  positions = np.broadcast_to(np.arange(SEQ), (BATCH, SEQ))
  out = {f"{i}:residual": inter[f"layer_{i}"]["__call__"][0] for i in range(2)}

  def attention(layer):
    attn = inter[f"layer_{layer}"]["attention"]
    q, k, v = (attn[name]["__call__"][0] for name in ("query", "key", "value"))   # [b, s, h, d]
    q, k = (np.asarray(rotary_embedding(x, positions, config.model.rope_theta)) for x in (q, k))
    return q, k, v

  q, k, _ = attention(0)
  scores = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
  scores = np.where(np.asarray(sliding_window_mask(SEQ, SEQ, WINDOW)), scores, -np.inf)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  out["0:attn_probs"] = probs / probs.sum(-1, keepdims=True)
  q, k, v = attention(1)
  out["1:attn_out"] = np.asarray(xla_attention(q, k, v, None)).reshape(BATCH, SEQ, -1)
  out["1:mlp_out"] = np.asarray(jax.nn.gelu(inter["layer_1"]["mlp"]["wi"]["__call__"][0], approximate=True))
  return out


@pytest.mark.parametrize("dp, tp, microbatches", [(1, 1, 1), (2, 2, 2)])
def test_captured_statistics_equal_the_reference_model(dp, tp, microbatches):
  """mean / std / rms / absmax over the global tensor and its first values, equal on one
  device and on dp=2 x tp=2 (shards over rows, sequence, heads and MLP units; 2 microbatches)."""
  config = probe_config(dp, tp, microbatches=microbatches, capture=POINTS, capture_sample=SAMPLE)
  metrics, params = step_metrics(config)
  expected = reference_tensors(config, params)
  captured = {key.split("/")[1] for key in metrics if key.startswith("capture/")}
  assert captured == set(expected)
  for point, x in expected.items():
    x = np.asarray(x, np.float64)
    got = {s: metrics[f"capture/{point}/{s}"] for s in ("mean", "std", "rms", "absmax", "sample")}
    np.testing.assert_allclose(got["mean"], x.mean(), rtol=1e-4, atol=1e-7, err_msg=point)
    np.testing.assert_allclose(got["std"], x.std(), rtol=1e-4, err_msg=point)
    np.testing.assert_allclose(got["rms"], np.sqrt((x * x).mean()), rtol=1e-4, err_msg=point)
    np.testing.assert_allclose(got["absmax"], np.abs(x).max(), rtol=1e-5, err_msg=point)
    np.testing.assert_allclose(got["sample"], x.reshape(-1)[:SAMPLE], rtol=1e-4, atol=1e-6, err_msg=point)
  # Each query's probabilities sum to 1 over its seq_len keys (masked ones 0): the mean is 1/seq_len.
  np.testing.assert_allclose(metrics["capture/0:attn_probs/mean"], 1 / SEQ, rtol=1e-6)


def test_offset_on_the_last_layer_leaves_the_loss():
  """A constant added to every element of the last layer's output moves the residual
  stream's mean by exactly that constant, and nothing else: the final LayerNorm subtracts the
  mean over the hidden units, so its output, the logits and the loss are unchanged (to float
  rounding). Layer 0's stream, before the offset, is untouched."""
  params = init_params(GPT(ModelConfig.from_config(probe_config().model)), jax.random.key(0))
  base = forward(probe_config(capture="*:residual"), params, fixed_batch())
  moved = forward(probe_config(capture="*:residual", perturb="offset", perturb_at="layer:1", perturb_scale=1.0),
                  params, fixed_batch())
  np.testing.assert_allclose(moved["loss"], base["loss"], atol=1e-5)
  np.testing.assert_allclose(moved["capture/1:residual/mean"], base["capture/1:residual/mean"] + 1.0, rtol=1e-5)
  np.testing.assert_allclose(moved["capture/1:residual/std"], base["capture/1:residual/std"], rtol=1e-3)
  for statistic in ("mean", "std", "absmax"):
    assert moved[f"capture/0:residual/{statistic}"] == base[f"capture/0:residual/{statistic}"]


def test_noise_raises_the_loss_with_its_scale():
  """A model that has learned something (a copy task: targets = inputs, tied embeddings
  scaled up, so the final LayerNorm's output points at the input token's embedding): Gaussian
  noise on the last layer's output turns that direction away, the more the larger its std.
  Same draws at every scale (the hash of step, layer and element), so the losses rise strictly."""
  config = probe_config()
  config.model.tie_embeddings = True
  params = init_params(GPT(ModelConfig.from_config(config.model)), jax.random.key(0))
  params["embedding"] = params["embedding"] * 5.0             # std 0.1: the stream's size
  losses = [forward(config, params, fixed_batch(copy=True))["loss"]]
  for scale in (0.01, 0.1, 1.0):
    config.observe.perturb, config.observe.perturb_at, config.observe.perturb_scale = "noise", "layer:1", scale
    losses.append(forward(config, params, fixed_batch(copy=True))["loss"])
  assert losses[0] < 1.0 and np.all(np.diff(losses) > 0), losses


def test_sign_bitflip_on_every_element_negates():
  """Bit 31 of a float32 is its sign: flipped on a fraction 1.0 of layer 0's output, the
  captured stream there is exactly the negated one, and the loss changes."""
  params = init_params(GPT(ModelConfig.from_config(probe_config().model)), jax.random.key(0))
  observe = dict(capture="0:residual", capture_sample=SAMPLE)
  base = forward(probe_config(**observe), params, fixed_batch())
  flipped = forward(probe_config(**observe, perturb="bitflip", perturb_at="layer:0", perturb_bit=31,
                                 perturb_fraction=1.0), params, fixed_batch())
  assert flipped["capture/0:residual/mean"] == -base["capture/0:residual/mean"]
  assert flipped["capture/0:residual/absmax"] == base["capture/0:residual/absmax"]
  np.testing.assert_array_equal(flipped["capture/0:residual/sample"], -base["capture/0:residual/sample"])
  assert abs(flipped["loss"] - base["loss"]) > 1e-3


def test_stage_perturbation_in_the_pipeline():
  """pp=2 (one layer per stage): unperturbed, the step's loss is the reference forward's;
  with noise on what stage 0 sends on, it changes, and equals noise on layer 0's output
  without a pipeline (the same hashed draws: same step, layer, rows, positions, units)."""
  params = init_params(GPT(ModelConfig.from_config(probe_config().model)), jax.random.key(0))
  noise = dict(perturb="noise", perturb_scale=0.1)
  reference = forward(probe_config(), params, fixed_batch())["loss"]
  layer_0 = forward(probe_config(**noise, perturb_at="layer:0"), params, fixed_batch())["loss"]
  plain = pipeline_loss(probe_config(pp=2, microbatches=2))
  sent = pipeline_loss(probe_config(pp=2, microbatches=2, **noise, perturb_at="stage:0"))
  np.testing.assert_allclose(plain, reference, rtol=1e-6)
  assert abs(sent - reference) > 1e-3
  np.testing.assert_allclose(sent, layer_0, rtol=1e-6)


def test_off_by_default_and_free():
  """The default config traces no probe at all: no op of the compiled step comes from a
  "capture" / "perturb" scope, the metrics have no capture keys, and the observe fields that
  only matter once capture / perturb is on leave the program unchanged."""
  config = probe_config()
  parallel_step = parallel_step_for(config)
  assert parallel_step.probes is None
  state, batch = parallel_step.abstract_inputs()
  step = parallel_step.train_step()
  hlo = step.lower(state, batch).compile().as_text()
  assert "op_name=" in hlo and not re.search(r'op_name="[^"]*(capture|perturb)', hlo)
  _, metrics = jax.eval_shape(step, state, batch)
  assert not [key for key in metrics if key.startswith("capture/")]

  def program(config, debug_info=False):
    parallel_step = parallel_step_for(config)
    return parallel_step.train_step().lower(*parallel_step.abstract_inputs()).as_text(debug_info=debug_info)

  idle = probe_config(capture_every=3, capture_sample=5, perturb_at="layer:1", perturb_scale=1.0, perturb_bit=3)
  assert program(idle) == program(config)
  on = program(probe_config(capture="0:residual", perturb="noise", perturb_at="layer:0"), debug_info=True)
  assert "capture residual" in on and "perturb" in on       # what the check above looks for


def test_trainer_writes_activations(tmp_path, tiny_config):
  """Every capture_every steps one line per point in WORKDIR/activations.jsonl; the
  metrics (metrics.jsonl, the history) keep no capture keys."""
  tiny_config.train.steps = 4
  tiny_config.checkpoint.save_params = False
  tiny_config.observe.capture = "0:attn_probs,*:residual"
  tiny_config.observe.capture_every = 2
  tiny_config.observe.capture_sample = 3
  result = train(tiny_config, str(tmp_path), progress=False, devices=jax.devices()[:1])
  lines = jsonl(tmp_path / ACTIVATIONS)
  points = ["0:attn_probs", "0:residual", "1:residual"]
  assert [(r["step"], r["point"]) for r in lines] == [(step, p) for step in (2, 4) for p in points]
  for record in lines:
    assert set(record) == {"step", "point", "mean", "std", "rms", "absmax", "sample"}
    assert len(record["sample"]) == 3 and record["absmax"] > 0
  np.testing.assert_allclose(lines[0]["mean"], 1 / tiny_config.model.seq_len, rtol=1e-6)
  logged = jsonl(tmp_path / METRICS)
  assert not [k for record in logged + result.history for k in record if k.startswith("capture/")]


def test_a_step_built_without_the_probes_its_config_asks_for_is_refused():
  """observe.* (and the straggler drill) are handed to the 3D step by the trainer: building it
  directly from such a config names the field and the way to build it."""
  config = probe_config(capture="0:residual")
  model, mesh = GPT(ModelConfig.from_config(config.model)), make_mesh(config.parallel, jax.devices()[:1])
  with pytest.raises(ConfigError, match=r"^observe\.capture='0:residual': the 3D step was built without its probes; "
                     r"build it with megajax\.trainer\.build_parallel_step"):
    ParallelStep.build(config, model, mesh)
  config = probe_config()
  config.debug.slow_rank = "0,0,0"
  with pytest.raises(ConfigError, match=r"^debug\.slow_rank='0,0,0': .*extra_work=megajax\.trainer\.drills"):
    ParallelStep.build(config, model, mesh)
  assert parallel_step_for(config).extra_work is not None
