"""The Hopper (Mosaic GPU) sliding-window forward, run by Pallas's GPU interpreter on CPU.

The interpreter simulates the warpgroups, shared memory, TMA copies and mbarriers (it
fails on a barrier phase a warpgroup never observed), so these tests check the kernel's
synchronization as well as its values. The backward is the portable kernels', reading the
Hopper forward's logsumexp: the gradients check that hand-off.
"""

import types

import jax
import jax.numpy as jnp
import pytest

from megajax.layers import pallas_attention_hopper as hopper, xla_attention
from megajax.layers.attention_blocks import kv_block_ranges
from megajax.layers.pallas_attention import default_backend, pallas_attention
from tests.test_pallas_attention import assert_close, inputs, value_and_grads


@pytest.mark.parametrize("s,heads,kv_heads,d,window", [
    (256, 2, 1, 64, None),     # causal, two programs, grouped KV heads
    (200, 1, 1, 128, 16),      # padded to 256, window smaller than a block
    (384, 2, 2, 64, 100),      # window across block edges: skipped, masked and full blocks
])
def test_hopper_forward_and_gradients_match_xla(s, heads, kv_heads, d, window):
  q, k, v, cotangent = inputs(1, s, heads, kv_heads, d, jnp.bfloat16)
  ours = value_and_grads(lambda q, k, v: pallas_attention(q, k, v, window, backend="mosaic"), q, k, v, cotangent)
  reference = value_and_grads(lambda q, k, v: xla_attention(q, k, v, window), q, k, v, cotangent)
  for name, got, want in zip(("out", "dq", "dk", "dv"), ours, reference):
    assert got.shape == want.shape and got.dtype == want.dtype, name
    assert_close(got, want, 2e-2)


def test_hopper_logsumexp_is_the_portable_kernels():
  """The backward reads the forward's logsumexp: both back ends must write the same one."""
  from megajax.layers.pallas_attention import _forward
  q, k, v, _ = inputs(1, 256, 2, 1, 64, jnp.bfloat16)
  _, lse_hopper = hopper.hopper_attention_forward(q, k, v, 80, interpret=True)
  _, lse_portable = _forward(q, k, v, 80, 64, 64, True, "triton")
  assert_close(lse_hopper, lse_portable, 1e-2)


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


def test_dispatch_by_device_kind_and_dtype():
  gpu = lambda kind: types.SimpleNamespace(platform="gpu", device_kind=kind)
  assert hopper.is_hopper(gpu("NVIDIA H200")) and hopper.is_hopper(gpu("NVIDIA H100 80GB HBM3"))
  assert not hopper.is_hopper(gpu("NVIDIA A100-SXM4-80GB")) and not hopper.is_hopper(jax.devices()[0])
  assert hopper.supports(jnp.bfloat16, 128) and not hopper.supports(jnp.float32, 128)
  assert not hopper.supports(jnp.bfloat16, 96)
  assert default_backend(jnp.bfloat16, 128) == "triton"          # this machine is no Hopper


def test_mosaic_backend_refuses_fp32_with_the_fix():
  q, k, v, _ = inputs(1, 128, 1, 1, 64, jnp.float32)
  with pytest.raises(ValueError, match="backend='mosaic' takes bf16/fp16.*use backend='triton'"):
    pallas_attention(q, k, v, 16, backend="mosaic")


@pytest.fixture(autouse=True)
def fresh_gpu_interpreter():
  """The GPU interpreter keeps per-process state that a failed kernel leaves dirty (its docs:
  reset after an exception); reset after each test so one failure cannot hang the next."""
  yield
  from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import reset_gpu_interpret_mode_state
  reset_gpu_interpret_mode_state()
