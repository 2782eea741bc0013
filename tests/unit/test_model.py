"""The model: window masking, block types and families (norms, MLPs), grouped KV heads, tied
heads, the loss."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from megajax.config import BLOCK_CHOICES, MLP_CHOICES, NORM_CHOICES
from megajax.layers import Mlp, rms_norm, sliding_window_mask, xla_attention
from megajax.loss import cross_entropy
from megajax.model import (GPT, ModelConfig, ParallelBlock, ParallelTwoNormsBlock, SerialBlock, init_params,
                           logical_axes, norm)
from megajax.reference_step import make_loss_fn


def build(config):
  model = GPT(ModelConfig.from_config(config.model))
  return model, init_params(model, jax.random.key(0))


def random_tokens(config, batch=2, seed=0):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.integers(0, config.model.vocab_size, (batch, config.model.seq_len)), jnp.int32)


def test_window_mask_is_the_band_i_minus_w_to_i():
  mask = np.asarray(sliding_window_mask(8, 8, 3))
  for i in range(8):
    for j in range(8):
      assert mask[i, j] == (i - 3 < j <= i)
  assert np.array_equal(np.asarray(sliding_window_mask(8, 8, None)), np.tril(np.ones((8, 8), bool)))


@pytest.mark.parametrize("window", [1, 3, 7, None])
def test_attention_ignores_keys_outside_the_window(window):
  b, s, h, d = 1, 12, 4, 8
  q, k, v = (jax.random.normal(key, (b, s, h, d)) for key in jax.random.split(jax.random.key(1), 3))
  attention = jax.jit(xla_attention, static_argnums=3)
  out = attention(q, k, v, window)
  lo = lambda i: 0 if window is None else max(0, i - window + 1)
  for i in (0, 5, 11):
    for j in range(s):
      k2 = k.at[:, j].add(3.0)
      v2 = v.at[:, j].add(3.0)
      changed = not np.allclose(attention(q, k2, v2, window)[:, i], out[:, i], atol=1e-6)
      assert changed == (lo(i) <= j <= i), (i, j)


@pytest.mark.parametrize("window", [4, 0])
def test_model_output_depends_only_on_tokens_in_the_window(tiny_config, window):
  """One layer: logits at i change iff a token in [i-w+1, i] changes."""
  tiny_config.model.num_layers = 1
  tiny_config.model.window = window
  model, params = build(tiny_config)
  apply = jax.jit(model.apply)
  tokens = random_tokens(tiny_config, batch=1)
  logits = apply({"params": params}, tokens)
  s = tiny_config.model.seq_len
  for i in (3, 9, s - 1):
    lo = 0 if window == 0 else max(0, i - window + 1)
    for j in range(s):
      other = tokens.at[0, j].set((tokens[0, j] + 1) % tiny_config.model.vocab_size)
      changed = not np.allclose(apply({"params": params}, other)[0, i], logits[0, i], atol=1e-6)
      assert changed == (lo <= j <= i), (i, j)


def test_window_pattern_alternates_local_and_global(tiny_config):
  tiny_config.model.num_layers, tiny_config.model.window, tiny_config.model.window_pattern = 4, 5, "LG"
  config = ModelConfig.from_config(tiny_config.model)
  assert [config.layer_window(i) for i in range(4)] == [5, None, 5, None]


def test_every_block_trains(tiny_config):
  """Same interface and output shapes; PTB shares one norm, the others have two; every
  parameter gets a gradient (the two-norm block with RMSNorm and a bias-free SwiGLU too)."""
  results = {}
  for block, norm_kind, mlp in (("parallel", "layernorm", "gelu"), ("serial", "layernorm", "gelu"),
                                ("parallel_two_norms", "rmsnorm", "swiglu")):
    tiny_config.model.update(block=block, norm=norm_kind, mlp=mlp, use_bias=mlp == "gelu")
    model, params = build(tiny_config)
    tokens = random_tokens(tiny_config)
    assert jax.eval_shape(model.apply, {"params": params}, tokens).shape == (2, tiny_config.model.seq_len, 64)
    batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, axis=1), "loss_mask": jnp.ones(tokens.shape)}
    (loss, _), grads = jax.value_and_grad(make_loss_fn(model), has_aux=True)(params, batch)
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    assert all(float(jnp.abs(g).sum()) > 0 for g in jax.tree.leaves(grads)), "a parameter gets no gradient"
    results[block] = (params, float(loss))
  assert set(results["parallel"][0]["layer_0"]) == {"norm", "attention", "mlp"}
  assert set(results["serial"][0]["layer_0"]) == {"attention_norm", "mlp_norm", "attention", "mlp"}
  assert set(results["parallel_two_norms"][0]["layer_0"]) == {"attention_norm", "mlp_norm", "attention", "mlp"}
  assert results["parallel"][1] != results["serial"][1]


def test_parallel_block_is_x_plus_attn_plus_mlp(tiny_config):
  tiny_config.model.init_std = 0.5  # large branches, so the serial block's coupling shows
  config = ModelConfig.from_config(tiny_config.model)
  x = jax.random.normal(jax.random.key(2), (2, 16, 32))
  positions = jnp.broadcast_to(jnp.arange(16), (2, 16))
  block = ParallelBlock(config, window=None)
  params = block.init(jax.random.key(3), x, positions)["params"]
  params = jax.tree.map(lambda p: getattr(p, "value", p), params, is_leaf=lambda p: hasattr(p, "value"))
  # Zero the attention output projection: the block becomes x + MLP(LN(x)).
  no_attention = jax.tree.map(lambda p: p, params)
  no_attention["attention"]["out"] = jax.tree.map(jnp.zeros_like, params["attention"]["out"])
  no_mlp = jax.tree.map(lambda p: p, params)
  no_mlp["mlp"]["wo"] = jax.tree.map(jnp.zeros_like, params["mlp"]["wo"])
  full = block.apply({"params": params}, x, positions)
  only_mlp = block.apply({"params": no_attention}, x, positions)
  only_attention = block.apply({"params": no_mlp}, x, positions)
  np.testing.assert_allclose(full, only_mlp + only_attention - x, atol=1e-4)
  # The serial block feeds the attention result into the MLP: not additive.
  serial = SerialBlock(config, window=None)
  sp = jax.tree.map(lambda p: getattr(p, "value", p), serial.init(jax.random.key(3), x, positions)["params"],
                    is_leaf=lambda p: hasattr(p, "value"))
  sp_no_attention = {**sp, "attention": {**sp["attention"], "out": jax.tree.map(jnp.zeros_like, sp["attention"]["out"])}}
  sp_no_mlp = {**sp, "mlp": {**sp["mlp"], "wo": jax.tree.map(jnp.zeros_like, sp["mlp"]["wo"])}}
  additive = (serial.apply({"params": sp_no_attention}, x, positions) + serial.apply({"params": sp_no_mlp}, x, positions) - x)
  assert not np.allclose(serial.apply({"params": sp}, x, positions), additive, atol=1e-2)


def test_grouped_kv_heads_and_tied_embeddings(tiny_config):
  tiny_config.model.num_kv_heads = 2
  tiny_config.model.tie_embeddings = True
  model, params = build(tiny_config)
  assert params["layer_0"]["attention"]["key"]["kernel"].shape == (32, 2, 8)
  assert params["layer_0"]["attention"]["query"]["kernel"].shape == (32, 4, 8)
  assert "head" not in params
  assert model.apply({"params": params}, random_tokens(tiny_config)).dtype == jnp.float32


def test_grouped_attention_equals_repeated_kv_heads():
  b, s, d = 2, 10, 8
  q = jax.random.normal(jax.random.key(0), (b, s, 6, d))
  k, v = (jax.random.normal(key, (b, s, 2, d)) for key in jax.random.split(jax.random.key(1)))
  grouped = xla_attention(q, k, v, window=4)
  repeated = xla_attention(q, jnp.repeat(k, 3, axis=2), jnp.repeat(v, 3, axis=2), window=4)
  np.testing.assert_allclose(grouped, repeated, atol=1e-6)


def test_dtype_policy(tiny_config):
  """fp32 params, bf16 matmuls in the blocks, fp32 logits."""
  tiny_config.model.compute_dtype = "bfloat16"
  model, params = build(tiny_config)
  tokens = random_tokens(tiny_config)
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
  assert model.apply({"params": params}, tokens).dtype == jnp.float32
  jaxpr = jax.make_jaxpr(model.apply)({"params": params}, tokens)
  dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
  operand_dtypes = {str(v.aval.dtype) for e in dots for v in e.invars}
  assert operand_dtypes == {"bfloat16"}, operand_dtypes  # no matmul left in fp32
  assert str(dots[-1].outvars[0].aval.dtype) == "float32"  # the logits accumulate in fp32


def test_every_parameter_has_logical_axes(tiny_config):
  model, params = build(tiny_config)
  axes = logical_axes(model)
  shapes = jax.tree.leaves(jax.tree.map(lambda p: p.ndim, params))
  specs = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  assert [len(spec) for spec in specs] == shapes


def test_cross_entropy_mask_and_z_loss():
  logits = jax.random.normal(jax.random.key(0), (2, 5, 7))
  targets = jnp.array([[1, 2, 3, 4, 5], [6, 0, 1, 2, 3]])
  mask = jnp.array([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]], jnp.float32)
  log_probs = jax.nn.log_softmax(logits)
  nll = -jnp.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
  expected = float((nll * mask).sum() / mask.sum())
  np.testing.assert_allclose(cross_entropy(logits, targets, mask), expected, rtol=1e-6)
  lse = jax.nn.logsumexp(logits, -1)
  expected_z = expected + 0.1 * float((lse ** 2 * mask).sum() / mask.sum())
  np.testing.assert_allclose(cross_entropy(logits, targets, mask, z_loss=0.1), expected_z, rtol=1e-6)
  # Masked positions do not matter.
  noisy = logits.at[0, 4].set(100.0)
  np.testing.assert_allclose(cross_entropy(noisy, targets, mask), expected, rtol=1e-6)


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_changes_memory_not_math(tiny_config, remat):
  model, params = build(tiny_config)
  tokens = random_tokens(tiny_config)
  batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, axis=1), "loss_mask": jnp.ones(tokens.shape)}
  reference = jax.grad(lambda p: make_loss_fn(model)(p, batch)[0])(params)
  tiny_config.model.remat = remat
  remat_model = GPT(ModelConfig.from_config(tiny_config.model))
  grads = jax.grad(lambda p: make_loss_fn(remat_model)(p, batch)[0])(params)
  for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(grads)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  # The recompute is really in the program: remat lowers to optimization barriers.
  lowered = lambda m: jax.jit(jax.grad(lambda p: make_loss_fn(m)(p, batch)[0])).lower(params).as_text()
  assert "optimization_barrier" in lowered(remat_model)
  assert "optimization_barrier" not in lowered(model)


# --- Block families: model.block x model.norm x model.mlp (with use_bias, tie_embeddings).

FAMILIES = [(block, norm, mlp) for block in BLOCK_CHOICES for norm in NORM_CHOICES for mlp in MLP_CHOICES]


def test_every_family_names_its_parameters(tiny_config):
  """Norm modules by block, norm leaves by norm (RMSNorm: scale only), MLP projections by mlp
  (SwiGLU: wi_gate, wi_up [hidden, mlp], wo), biases by use_bias; every leaf has logical axes."""
  norms = {"parallel": {"norm"}, "parallel_two_norms": {"attention_norm", "mlp_norm"},
           "serial": {"attention_norm", "mlp_norm"}}
  for block, norm_kind, mlp in FAMILIES:
    use_bias = norm_kind == "layernorm"   # each MLP with and without biases
    tiny_config.model.update(block=block, norm=norm_kind, mlp=mlp, use_bias=use_bias, tie_embeddings=not use_bias)
    model = GPT(ModelConfig.from_config(tiny_config.model))
    params = jax.eval_shape(lambda: init_params(model, jax.random.key(0)))
    axes = logical_axes(model)
    layer = params["layer_0"]
    assert set(layer) == norms[block] | {"attention", "mlp"}, (block, set(layer))
    for name in norms[block] | {"final_norm"}:
      leaves = layer.get(name) or params[name]
      assert set(leaves) == ({"scale", "bias"} if norm_kind == "layernorm" else {"scale"}), (norm_kind, leaves)
    inputs = {"gelu": {"wi"}, "gelu_exact": {"wi"}, "swiglu": {"wi_gate", "wi_up"}}[mlp]
    assert set(layer["mlp"]) == inputs | {"wo"}
    for name in inputs:
      assert layer["mlp"][name]["kernel"].shape == (32, 128)
      assert set(layer["mlp"][name]) == ({"kernel", "bias"} if use_bias else {"kernel"})
      assert tuple(axes["layer_0"]["mlp"][name]["kernel"]) == ("embed", "mlp")
    assert ("head" in params) == use_bias   # tied exactly when bias-free here
    specs = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    assert [len(spec) for spec in specs] == [p.ndim for p in jax.tree.leaves(params)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_rms_norm_is_x_over_its_root_mean_square_times_scale(dtype):
  """Statistics in fp32 whatever the compute dtype; no bias, no mean subtracted."""
  x = (3 + jax.random.normal(jax.random.key(0), (2, 5, 16))).astype(dtype)
  scale = 1 + 0.1 * jax.random.normal(jax.random.key(1), (16,))
  got = rms_norm(1e-5, dtype, jnp.float32, "norm").apply({"params": {"scale": scale}}, x)
  x32 = x.astype(jnp.float32)
  want = x32 / jnp.sqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-5) * scale
  assert got.dtype == dtype
  np.testing.assert_allclose(got.astype(jnp.float32), want, rtol=1e-6 if dtype == jnp.float32 else 1e-2)


def test_swiglu_mlp_is_wo_of_silu_gate_times_up():
  keys = jax.random.split(jax.random.key(0), 5)
  x = jax.random.normal(keys[0], (2, 5, 16))
  mlp = Mlp(mlp_dim=24, family="swiglu", use_bias=True, dtype=jnp.float32)
  params = nn.unbox(mlp.init(keys[1], x)["params"])
  params["wi_gate"]["bias"] = 0.1 * jax.random.normal(keys[2], (24,))
  params["wi_up"]["bias"] = 0.1 * jax.random.normal(keys[3], (24,))
  linear = lambda name, h: h @ params[name]["kernel"] + params[name]["bias"]
  gate = linear("wi_gate", x)
  want = linear("wo", gate / (1 + jnp.exp(-gate)) * linear("wi_up", x))
  np.testing.assert_allclose(mlp.apply({"params": params}, x), want, rtol=1e-5, atol=1e-6)


def test_gelu_families_are_the_tanh_and_the_erf_forms():
  x = jax.random.normal(jax.random.key(0), (2, 5, 16))
  for family, activation in (("gelu", lambda h: 0.5 * h * (1 + jnp.tanh(0.7978845608 * (h + 0.044715 * h ** 3)))),
                             ("gelu_exact", lambda h: 0.5 * h * (1 + jax.scipy.special.erf(h / np.sqrt(2))))):
    mlp = Mlp(mlp_dim=24, family=family, use_bias=False, dtype=jnp.float32)
    params = nn.unbox(mlp.init(jax.random.key(1), x)["params"])
    want = activation(x @ params["wi"]["kernel"]) @ params["wo"]["kernel"]
    np.testing.assert_allclose(mlp.apply({"params": params}, x), want, rtol=1e-5, atol=1e-6)


def test_parallel_two_norms_block_is_x_plus_attn_of_n1_plus_mlp_of_n2(tiny_config):
  """y = x + Attn(attention_norm(x)) + MLP(mlp_norm(x)): additive, each branch reads only its norm."""
  tiny_config.model.update(block="parallel_two_norms", init_std=0.5)
  config = ModelConfig.from_config(tiny_config.model)
  x = jax.random.normal(jax.random.key(2), (2, 16, 32))
  positions = jnp.broadcast_to(jnp.arange(16), (2, 16))
  block = ParallelTwoNormsBlock(config, window=None)
  params = nn.unbox(block.init(jax.random.key(3), x, positions)["params"])
  apply = lambda p: block.apply({"params": p}, x, positions)
  zeroed = lambda p, module, name: {**p, module: {**p[module], name: jax.tree.map(jnp.zeros_like, p[module][name])}}
  only_mlp, only_attention = apply(zeroed(params, "attention", "out")), apply(zeroed(params, "mlp", "wo"))
  np.testing.assert_allclose(apply(params), only_mlp + only_attention - x, atol=1e-4)
  mlp = Mlp(mlp_dim=config.mlp_dim, dtype=jnp.float32)
  want_mlp = mlp.apply({"params": params["mlp"]}, norm(config, "n").apply({"params": params["mlp_norm"]}, x))
  np.testing.assert_allclose(only_mlp - x, want_mlp, rtol=1e-5, atol=1e-5)
  # The attention branch reads attention_norm, not mlp_norm.
  changed = lambda name: {**params, name: {"scale": 2 * params[name]["scale"], "bias": params[name]["bias"] + 1}}
  np.testing.assert_allclose(apply(zeroed(changed("mlp_norm"), "mlp", "wo")), only_attention, atol=1e-6)
  assert not np.allclose(apply(zeroed(changed("attention_norm"), "mlp", "wo")), only_attention, atol=1e-3)


@pytest.mark.parametrize("block", BLOCK_CHOICES)
def test_init_params_is_model_init_pytree_with_a_key_per_layer(tiny_config, block):
  """init_params (the layers one block's init vmapped over their keys) returns the very pytree
  `model.init` declares (names, shapes, dtypes); each layer its own values; the same values
  inside another program (a caller's jit) as called alone."""
  tiny_config.model.block = block
  tiny_config.model.num_layers = 3
  model = GPT(ModelConfig.from_config(tiny_config.model))
  tokens = jnp.zeros((1, tiny_config.model.seq_len), jnp.int32)
  declared = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.key(0), tokens)["params"]))
  params = init_params(model, jax.random.key(0))
  spec = lambda tree: jax.tree.map(lambda a: (a.shape, a.dtype), tree)
  assert jax.tree.structure(params) == jax.tree.structure(declared)
  assert spec(params) == spec(declared)
  kernels = [np.asarray(params[f"layer_{i}"]["mlp"]["wo"]["kernel"]) for i in range(3)]
  assert not np.array_equal(kernels[0], kernels[1]) and not np.array_equal(kernels[1], kernels[2])
  inside = jax.jit(lambda key: jax.tree.map(lambda leaf: leaf + 0.0, init_params(model, key)))(jax.random.key(0))
  jax.tree.map(np.testing.assert_array_equal, params, inside)
