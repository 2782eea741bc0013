"""The Pallas sliding-window attention kernels (interpret mode on CPU) against xla_attention.

Forward output and dq, dk, dv: fp32 within 1e-5, bf16 within 2e-2 (of the largest entry),
over sequence lengths that are and are not block multiples, windows smaller than a block,
larger than the sequence and None, grouped KV heads, head dims 64 and 128, plus a small
hypothesis sweep. Then the block-skipping bounds against brute force, and the model.
"""

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from megajax.config import ATTENTION_IMPLS as CONFIG_ATTENTION_IMPLS, ConfigError
from megajax.layers import ATTENTION_IMPLS, cudnn_attention, xla_attention
from megajax.layers.attention_blocks import kv_block_ranges, q_block_ranges, visited_blocks
from megajax.layers.pallas_attention import pallas_attention


def inputs(b, s, heads, kv_heads, d, dtype, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(keys[0], (b, s, heads, d), dtype)
  k = jax.random.normal(keys[1], (b, s, kv_heads, d), dtype)
  v = jax.random.normal(keys[2], (b, s, kv_heads, d), dtype)
  cotangent = jax.random.normal(keys[3], (b, s, heads, d), jnp.float32)
  return q, k, v, cotangent


def value_and_grads(attention, q, k, v, cotangent):
  loss = lambda q, k, v: jnp.sum(attention(q, k, v).astype(jnp.float32) * cotangent)
  out = attention(q, k, v)
  return (out, *jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v))


def assert_close(got, want, tol):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  # Relative to the largest entry (at least 1: with one token dq is exactly 0 in both).
  scale = max(float(np.max(np.abs(want))), 1.0)
  assert np.max(np.abs(got - want)) <= tol * scale, np.max(np.abs(got - want)) / scale


def check(b, s, heads, kv_heads, d, window, dtype, block=16, seed=0):
  q, k, v, cotangent = inputs(b, s, heads, kv_heads, d, dtype, seed)
  ours = value_and_grads(lambda q, k, v: pallas_attention(q, k, v, window, block, block), q, k, v, cotangent)
  reference = value_and_grads(lambda q, k, v: xla_attention(q, k, v, window), q, k, v, cotangent)
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  for name, got, want in zip(("out", "dq", "dk", "dv"), ours, reference):
    assert got.shape == want.shape and got.dtype == want.dtype, name
    assert_close(got, want, tol)


@pytest.mark.parametrize("s", [64, 50], ids=["block_multiple", "padded"])
@pytest.mark.parametrize("window", [5, 24, None, 100], ids=["w<block", "w=24", "causal", "w>s"])
def test_matches_xla_fp32(s, window):
  check(2, s, 4, 2, 64, window, jnp.float32)


@pytest.mark.parametrize("heads,kv_heads,d", [(2, 2, 128), (4, 1, 64), (2, 1, 256)], ids=["mha_d128", "gqa4_d64", "gqa2_d256"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_heads_and_dtypes(heads, kv_heads, d, dtype):
  check(1, 40, heads, kv_heads, d, 16, dtype)


@hypothesis.settings(max_examples=8, deadline=None, derandomize=True)
@hypothesis.given(s=st.integers(1, 70), window=st.one_of(st.none(), st.integers(1, 80)),
                  groups=st.sampled_from([(1, 1), (2, 1), (4, 2)]), block=st.sampled_from([8, 16]))
def test_shape_sweep(s, window, groups, block):
  check(1, s, *groups, 64, window, jnp.float32, block=block, seed=s)


# --- Block skipping.

def brute_force_blocks(s, window, block_q, block_k):
  """Per query block: the KV blocks with any visible (query, key) pair, and those where all are."""
  i, j = np.arange(s)[:, None], np.arange(s)[None, :]
  visible = (j <= i) & ((j > i - window) if window is not None else True)
  per_block = visible.reshape(s // block_q, block_q, s // block_k, block_k)
  return per_block.any(axis=(1, 3)), per_block.all(axis=(1, 3))


@pytest.mark.parametrize("s,window,block_q,block_k", [
    (64, 5, 16, 16), (64, 16, 16, 16), (128, 40, 16, 32), (128, 40, 32, 16), (96, None, 16, 16),
    (64, 200, 16, 16), (256, 1, 32, 32), (240, 33, 16, 48)])
def test_block_ranges_are_exactly_the_band(s, window, block_q, block_k):
  """The kernels' loop bounds: every block with a visible pair is visited, no other; the
  unmasked range is exactly the blocks where every pair is visible."""
  any_visible, all_visible = brute_force_blocks(s, window, block_q, block_k)
  for qb in range(s // block_q):
    lo, full_lo, full_hi, hi = kv_block_ranges(qb, block_q, block_k, window, s // block_k)
    assert set(range(lo, hi)) == set(np.flatnonzero(any_visible[qb]))
    assert set(range(full_lo, full_hi)) == set(np.flatnonzero(all_visible[qb]))
  for kb in range(s // block_k):
    lo, full_lo, full_hi, hi = q_block_ranges(kb, block_q, block_k, window, s // block_q)
    assert set(range(lo, hi)) == set(np.flatnonzero(any_visible[:, kb]))
    assert set(range(full_lo, full_hi)) == set(np.flatnonzero(all_visible[:, kb]))


def test_block_skipping_makes_the_work_linear_in_the_sequence():
  """KV blocks visited: O(s * w / block^2) with a window, O(s^2 / block^2) without."""
  block, window = 64, 512
  windowed = [visited_blocks(s, window, block, block) for s in (2048, 8192, 32768)]
  causal = [visited_blocks(s, None, block, block) for s in (2048, 8192, 32768)]
  for s, blocks in zip((2048, 8192, 32768), windowed):
    assert blocks <= (s // block) * (window // block + 1)
  assert windowed[2] / windowed[1] < 4.2                                          # linear (4096 -> 4572)
  assert causal[2] / causal[1] > 15                                                # quadratic


# --- The model.

def test_registered_in_the_model_and_the_config():
  assert set(CONFIG_ATTENTION_IMPLS) == set(ATTENTION_IMPLS) == {"xla", "pallas", "cudnn"}


@pytest.mark.parametrize("window", [1, 7, None, 100])
def test_cudnn_comparator_uses_the_same_window(window):
  """`cudnn` is jax.nn.dot_product_attention with local_window_size=(w-1, 0); its XLA
  implementation (the only one on CPU) shows the mapping equals our mask."""
  q, k, v, _ = inputs(2, 40, 4, 2, 64, jnp.float32)
  assert_close(cudnn_attention(q, k, v, window, implementation="xla"), xla_attention(q, k, v, window), 1e-5)


def test_model_with_pallas_attention_matches_xla(tiny_config):
  from megajax.model import GPT, ModelConfig, init_params
  from megajax.step import make_loss_fn
  tiny_config.model.window, tiny_config.model.window_pattern = 6, "LG"
  tokens = jax.random.randint(jax.random.key(1), (2, tiny_config.model.seq_len), 0, tiny_config.model.vocab_size)
  batch = {"inputs": tokens, "targets": jnp.roll(tokens, -1, axis=1), "loss_mask": jnp.ones(tokens.shape)}
  results = {}
  for impl in ("xla", "pallas"):
    tiny_config.model.attention_impl = impl
    model = GPT(ModelConfig.from_config(tiny_config.model))
    params = init_params(model, jax.random.key(0))
    results[impl] = jax.jit(jax.value_and_grad(make_loss_fn(model), has_aux=True))(params, batch)
  (loss, _), grads = results["pallas"]
  (want_loss, _), want_grads = results["xla"]
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("impl", ["pallas", "cudnn"])
def test_the_3d_step_refuses_what_this_cpu_cannot_run(tiny_config, impl):
  """On CPU the Pallas kernels run in interpret mode, which jax 0.10 cannot trace inside the
  step's shard_map, and cuDNN does not exist: the plan says so before compiling."""
  from megajax.model import GPT, ModelConfig
  from megajax.parallel import ParallelPlan, make_mesh
  tiny_config.model.attention_impl = impl
  with pytest.raises(ConfigError, match=rf"^model\.attention_impl='{impl}': .*; use model\.attention_impl=xla"):
    ParallelPlan.build(tiny_config, GPT(ModelConfig.from_config(tiny_config.model)),
                       make_mesh(tiny_config, jax.devices()[:1]))


def test_attention_benchmark_runs_side_by_side_on_cpu():
  """`python -m megajax.launch.bench attention` on CPU: the reduced grid, said to be interpret mode."""
  from tests.conftest import run_module
  result = run_module(["-m", "megajax.launch.bench", "attention", "--repeats=1"], timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "Pallas kernels in interpret mode (times the interpreter: no GPU figure)" in result.stdout
  rows = [line.split() for line in result.stdout.splitlines() if line.split()[:1] in (["128"], ["512"])]
  assert {(row[0], row[1], row[2]) for row in rows} == {
      (s, w, impl) for s in ("128", "512") for w in ("32", "None") for impl in ("pallas", "xla")}
  assert "pallas fwd+bwd time(s=512) / time(s=128) at w=32:" in result.stdout
