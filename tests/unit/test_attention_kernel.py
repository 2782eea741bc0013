"""The sliding-window attention kernels' structure: block skipping against brute force, the
dispatch between the portable and Hopper kernels, the registry, and the kernel inside the
model against XLA's attention. (Every shape and dtype in the interpreter: tests/integration.)"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from megajax.config import ATTENTION_IMPL_CHOICES, ConfigError
from megajax.layers import ATTENTION_IMPLS, cudnn_attention, xla_attention
from megajax.layers.kernels import attention_hopper as hopper
from megajax.layers.kernels import default_backend, pallas_attention
from megajax.layers.kernels.band import kv_block_ranges, q_block_ranges, visited_blocks
from megajax.model import GPT, ModelConfig, init_params
from megajax.parallel import ParallelStep, make_mesh
from megajax.reference_step import make_loss_fn
from tests.support.kernels import assert_close, inputs, tolerance


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


def test_streamed_blocks_cover_both_warpgroups_and_stay_linear():
  """A program streams the union of its two warpgroups' bands, nothing more: O(s * w)."""
  window, kv_blocks = 512, 32768 // hopper.BLOCK
  total = 0
  for tile in range(kv_blocks // hopper.COMPUTE_WARPGROUPS):
    first, last = hopper.streamed_kv_blocks(tile, window, kv_blocks)
    bands = [kv_block_ranges(tile * 2 + w, hopper.BLOCK, hopper.BLOCK, window, kv_blocks) for w in (0, 1)]
    assert first == min(b[0] for b in bands) and last == max(b[3] for b in bands)
    total += last - first
  assert total <= (kv_blocks // 2) * (window // hopper.BLOCK + 3)


# --- Dispatch and the model.

def test_dispatch_by_device_kind_and_dtype():
  gpu = lambda kind: types.SimpleNamespace(platform="gpu", device_kind=kind)
  assert hopper.is_hopper(gpu("NVIDIA H200")) and hopper.is_hopper(gpu("NVIDIA H100 80GB HBM3"))
  assert not hopper.is_hopper(gpu("NVIDIA A100-SXM4-80GB"))
  assert not hopper.is_hopper(types.SimpleNamespace(platform="cpu", device_kind="cpu"))
  assert hopper.supports(jnp.bfloat16, 128) and not hopper.supports(jnp.float32, 128)
  assert not hopper.supports(jnp.bfloat16, 96)
  assert default_backend(jnp.bfloat16, 128) == ("mosaic" if hopper.is_hopper(jax.devices()[0]) else "triton")
  assert default_backend(jnp.float32, 128) == "triton"


def test_mosaic_backend_refuses_fp32_with_the_fix():
  q, k, v, _ = inputs(1, 128, 1, 1, 64, jnp.float32)
  with pytest.raises(ValueError, match="backend='mosaic' takes bf16/fp16.*use backend='triton'"):
    pallas_attention(q, k, v, 16, backend="mosaic")


def test_mosaic_backward_refuses_fp32_and_unknown_names_with_the_fix():
  q, k, v, _ = inputs(1, 128, 1, 1, 64, jnp.float32)
  with pytest.raises(ValueError, match="backward='mosaic' takes bf16/fp16.*use backward='triton'"):
    pallas_attention(q, k, v, 16, backward="mosaic")
  with pytest.raises(ValueError, match=r"backward='cuda': use one of \('triton', 'mosaic'\)"):
    pallas_attention(q, k, v, 16, backward="cuda")


def test_hopper_forward_options_the_interpreter_cannot_run_are_refused():
  q, k, v, _ = inputs(1, 128, 1, 1, 64, jnp.bfloat16)
  with pytest.raises(ValueError, match="only schedule_barrier runs in the GPU interpreter"):
    hopper.hopper_attention_forward(q, k, v, 16, interpret=True, options=hopper.ForwardOptions(p_in_registers=True))


def test_registered_in_the_model_and_the_config():
  assert set(ATTENTION_IMPL_CHOICES) == set(ATTENTION_IMPLS) == {"xla", "pallas", "cudnn"}


@pytest.mark.parametrize("window", [1, 7, None, 100])
def test_cudnn_comparator_uses_the_same_window(window):
  """`cudnn` is jax.nn.dot_product_attention with local_window_size=(w-1, 0); its XLA
  implementation (the only one on CPU) shows the mapping equals our mask."""
  q, k, v, _ = inputs(2, 40, 4, 2, 64, jnp.float32)
  assert_close(cudnn_attention(q, k, v, window, implementation="xla"), xla_attention(q, k, v, window),
               tolerance(jnp.float32))


@pytest.mark.cpu_only
def test_model_with_pallas_attention_matches_xla(tiny_config):
  """fp32 to 1e-5: the interpreter's exact fp32 dots (on a GPU, TF32: tests/gpu)."""
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


@pytest.mark.cpu_only
@pytest.mark.parametrize("impl", ["pallas", "cudnn"])
def test_the_3d_step_refuses_what_this_cpu_cannot_run(tiny_config, impl):
  """On CPU the Pallas kernels run in interpret mode, which jax 0.10 cannot trace inside the
  step's shard_map, and cuDNN does not exist: the 3D step says so before compiling."""
  tiny_config.model.attention_impl = impl
  with pytest.raises(ConfigError, match=rf"^model\.attention_impl='{impl}': .*; use model\.attention_impl=xla"):
    ParallelStep.build(tiny_config, GPT(ModelConfig.from_config(tiny_config.model)),
                       make_mesh(tiny_config.parallel, jax.devices()[:1]))
