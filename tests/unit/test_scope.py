"""MegaScope's explorer core (megajax.observe.scope): what the page shows is the model's own
computation, capture changes nothing, perturbations are exact and repeatable."""

import dataclasses

import jax
import numpy as np
import pytest

from megajax.config import default_config
from megajax.launch.bench import scope as bench
from megajax.layers.attention import sliding_window_mask
from megajax.model import GPT, ModelConfig, init_params
from megajax.observe import scope
from megajax.sampling import Sampling, generate

pytestmark = pytest.mark.unit

PROMPT = [5, 7, 9, 11, 13, 17]
NEW = 8


def _model(block="parallel", mlp="gelu", kv_heads=2) -> ModelConfig:
  m = default_config().model
  m.num_layers, m.hidden_dim, m.num_heads, m.num_kv_heads, m.seq_len, m.vocab_size = 3, 64, 4, kv_heads, 32, 256
  m.window, m.window_pattern, m.block, m.mlp = 4, "LLG", block, mlp
  return ModelConfig.from_config(m)


@pytest.fixture(scope="module")
def model():
  config = _model()
  return config, init_params(GPT(config), jax.random.key(0))


def _decode(model, sampling=Sampling(0.0, 0, 1.0), seed=0, **kwargs):
  config, params = model
  return list(scope.decode(params, config, PROMPT, NEW, sampling, seed, **kwargs))


@pytest.mark.parametrize("block, mlp, kv_heads", [("parallel", "gelu", 2), ("serial", "swiglu", 4),
                                                  ("parallel_two_norms", "gelu", 1)])
def test_decode_is_megajax_generate_with_and_without_capture(block, mlp, kv_heads):
  """Every block family, GQA and MQA, local and global layers: the tokens and the logits each
  was drawn from are megajax.generate's, bit for bit, capturing or not."""
  config = _model(block, mlp, kv_heads)
  params = init_params(GPT(config), jax.random.key(1))
  for sampling in (Sampling(0.0, 0, 1.0), Sampling(0.9, 20, 0.95)):
    tokens, logits = generate(params, config, [PROMPT], NEW, sampling.temperature, sampling.top_k, sampling.top_p,
                              seed=3, with_logits=True)
    for capture in (False, True):
      steps = list(scope.decode(params, config, PROMPT, NEW, sampling, 3, capture=capture))
      assert [s.token for s in steps] == tokens[0].tolist()
      np.testing.assert_array_equal(np.stack([s.logits for s in steps]), logits[0])
      assert bool(steps[0].internals) == capture


def test_captured_internals_are_the_forward_pass_over_the_sequence(model):
  """A decode step's captures equal one forward pass over the finished sequence at that
  position (the model is causal), so inspecting afterwards shows what decoding computed."""
  config, params = model
  steps = _decode(model, capture=True)
  inside = scope.internals(params, config, PROMPT + [s.token for s in steps])
  for k, step in enumerate(steps):
    position = len(PROMPT) + k                       # step k's internals: its token's, run through the cache
    for layer in range(config.num_layers):
      for tensor in ("residual", "attn_out", "mlp_out"):
        np.testing.assert_allclose(step.internals[tensor][layer + (tensor == "residual")],
                                   inside[f"{layer}:{tensor}"][position], atol=2e-2, rtol=2e-2)


def test_attention_map_is_the_layers_masked_softmax(model):
  config, params = model
  tokens = PROMPT + list(range(20, 30))
  inside = scope.internals(params, config, tokens)
  for layer in range(config.num_layers):
    probs = scope.attention_map(config, inside, layer, head=3)
    allowed = np.asarray(sliding_window_mask(len(tokens), len(tokens), config.layer_window(layer)))
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-5)
    assert np.all(probs[~allowed] == 0) and np.all(probs[allowed] > 0)
  # the local layers see only their window; the global one everything before
  assert np.count_nonzero(scope.attention_map(config, inside, 0, 0)[-1]) == config.window
  assert np.count_nonzero(scope.attention_map(config, inside, 2, 0)[-1]) == len(tokens)


def test_residual_pca_covers_every_layer_and_position(model):
  config, params = model
  inside = scope.internals(params, config, PROMPT)
  coords, share = scope.residual_pca(config, inside)
  assert coords.shape == (config.num_layers + 1, len(PROMPT), 2)
  assert 0 < share[1] <= share[0] < 1


@pytest.mark.parametrize("perturbation", [
    scope.Perturbation(1, "noise", std=1.0, seed=7), scope.Perturbation(1, "bitflip", rate=0.02, seed=7),
    scope.Perturbation(0, "zero_heads", heads=(0, 3)), scope.Perturbation(1, "mask_positions", positions=(0, 2)),
    scope.Perturbation(2, "offset", offset=2.0)], ids=lambda p: p.kind)
def test_perturbations_change_the_logits_and_repeat_exactly(model, perturbation):
  perturbation.check(model[0])
  plain = np.stack([s.logits for s in _decode(model)])
  once = np.stack([s.logits for s in _decode(model, perturbation=perturbation)])
  again = np.stack([s.logits for s in _decode(model, perturbation=perturbation)])
  np.testing.assert_array_equal(once, again)
  assert not np.array_equal(once, plain)


def test_a_perturbation_is_a_function_of_position_alone():
  """The perturbed stream at a position is the same whether the position went through the
  prefill or a decode step: the noise decoded after a 6-token prompt equals that of the same
  tokens given as a 9-token prompt."""
  config = _model()
  params = init_params(GPT(config), jax.random.key(2))
  noise = scope.Perturbation(1, "noise", std=0.5, seed=1)
  greedy = Sampling(0.0, 0, 1.0)
  short = list(scope.decode(params, config, PROMPT, 4, greedy, perturbation=noise))
  longer = PROMPT + [s.token for s in short[:3]]
  resumed = list(scope.decode(params, config, longer, 1, greedy, perturbation=noise))
  np.testing.assert_allclose(resumed[0].logits, short[3].logits, atol=1e-3, rtol=1e-3)


def test_bitflips_flip_bits_of_the_streams_own_dtype():
  x = jax.numpy.ones((1, 4, 512), jax.numpy.bfloat16)
  flipped = scope._perturb_residual(x, jax.numpy.arange(4)[None], scope.Perturbation(0, "bitflip", rate=0.1, seed=3))
  bits = np.asarray(jax.lax.bitcast_convert_type(flipped, jax.numpy.uint16) ^ jax.lax.bitcast_convert_type(x, jax.numpy.uint16))
  changed = bits[bits != 0]
  assert all(bin(int(b)).count("1") == 1 for b in changed)        # one bit an element
  assert 0.05 < changed.size / bits.size < 0.15


def test_divergence_and_kl():
  assert scope.first_divergence([1, 2, 3], [1, 2, 3]) is None
  assert scope.first_divergence([1, 2, 3], [1, 5, 3]) == 1
  logits = np.log(np.array([0.5, 0.25, 0.25]))
  assert scope.kl_divergence(logits, logits) == pytest.approx(0.0, abs=1e-12)
  assert scope.kl_divergence(logits, np.log(np.array([0.25, 0.5, 0.25]))) == pytest.approx(0.25 * np.log(2), rel=1e-9)
  assert scope.kl_divergence(logits, np.array([np.nan, 0.0, 0.0])) is None


@pytest.mark.parametrize("perturbation, field", [
    (scope.Perturbation(3, "noise", std=1.0), "perturbation.layer"),
    (scope.Perturbation(0, "noise", std=0.0), "perturbation.std"),
    (scope.Perturbation(0, "bitflip", rate=2.0), "perturbation.rate"),
    (scope.Perturbation(0, "zero_heads", heads=(4,)), "perturbation.heads"),
    (scope.Perturbation(0, "mask_positions"), "perturbation.positions"),
    (scope.Perturbation(0, "swap"), "perturbation.kind")])
def test_bad_perturbations_name_their_field(perturbation, field):
  with pytest.raises(scope.ScopeError, match=rf"^{field}="):
    perturbation.check(_model())


def test_heatmaps_take_the_selected_heads_slice(model):
  config, params = model
  inside = scope.internals(params, config, PROMPT)
  q, width = scope.heatmap(inside, config, 0, "q", head=3)
  np.testing.assert_array_equal(q, inside["0:q"][:, 3])
  k, _ = scope.heatmap(inside, config, 0, "k", head=3)             # 4 heads over 2 KV heads: head 3 reads KV head 1
  np.testing.assert_array_equal(k, inside["0:k"][:, 1])
  residual, width = scope.heatmap(inside, dataclasses.replace(config), 1, "residual", head=0, features=16)
  assert residual.shape == (len(PROMPT), 16) and width == config.hidden_dim


def test_the_latency_benchmark_times_plain_and_captured_decoding():
  (row,) = bench.run(repeats=1, new_tokens=2, sizes=("tiny",))
  assert row["params"] > 0 and all(row[k] > 0 for k in ("plain_ms", "capture_ms", "inspect_ms"))
