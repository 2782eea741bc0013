"""On a GPU: every Pallas kernel compiled for real (Triton and, on Hopper, Mosaic GPU) and run
against XLA at `highest` matmul precision; the 3D step on one GPU with each attention_impl.

Marked `gpu` (tests/conftest.py): skipped, with the reason, where JAX sees no GPU. Run by
`python -m megajax.launch.bench gpu --parts=tests` on the GPU machine (WORKSPACE.md).

Tolerances are the GPU's, not the CPU interpreter's: fp32 kernels use TF32 tensor-core dots
(Triton's default for an fp32 dot), so fp32 is held to 3e-3 of the largest entry, bf16 to 2e-2.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from megajax.launch.bench.train import CompiledStep
from megajax.layers import NORM_MODULES, cudnn_attention, swiglu, xla_attention
from megajax.layers.kernels import default_backend, fused_bias_gelu, fused_rms_norm, fused_swiglu, pallas_attention
from megajax.layers.kernels import attention_hopper as hopper
from megajax.layers.mlp import gelu
from tests.support.kernels import assert_close, inputs, tolerance, value_and_grads

pytestmark = pytest.mark.gpu

ON_HOPPER = hopper.is_hopper(jax.devices()[0])
HOPPER_ONLY = pytest.mark.skipif(not ON_HOPPER, reason=f"the Mosaic GPU kernels need Hopper; this is "
                                                       f"{jax.devices()[0].device_kind}")


def _reference_grads(fn, q, k, v, cotangent):
  """fn's output and (dq, dk, dv) in fp32 at highest precision from the same (rounded) inputs."""
  with jax.default_matmul_precision("highest"):
    return value_and_grads(fn, *(x.astype(jnp.float32) for x in (q, k, v)), cotangent)


def _check_attention(backend, d, window, s=333, dtype=jnp.bfloat16, documents=False, heads=4, kv_heads=2,
                     backward="triton", hopper_forward=hopper.ForwardOptions()):
  q, k, v, cotangent = inputs(2, s, heads, kv_heads, d, dtype, seed=d + (window or 0))
  segment_ids = None
  if documents:   # three packed documents per row, different cut points per row
    positions = jnp.arange(s)[None]
    segment_ids = (positions >= jnp.array([[s // 3], [s // 5]])).astype(jnp.int32) + (
        positions >= jnp.array([[2 * s // 3], [s // 2]]))
  ours = value_and_grads(lambda q, k, v: pallas_attention(q, k, v, window, segment_ids, backend=backend,
                                                          backward=backward, hopper_forward=hopper_forward),
                         q, k, v, cotangent)
  want = _reference_grads(lambda q, k, v: xla_attention(q, k, v, window, segment_ids), q, k, v, cotangent)
  for name, got, ref in zip(("out", "dq", "dk", "dv"), ours, want):
    assert got.shape == ref.shape and got.dtype == dtype, name
    assert np.all(np.isfinite(np.asarray(got, np.float32))), name
    assert_close(got, ref, tolerance(dtype))


# Windows below, equal to and above the 64-row block, and none; an odd length; GQA.
WINDOWS = [32, 64, 200, None]


@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"w{w}")
@pytest.mark.parametrize("d", [64, 128, 256], ids=lambda d: f"d{d}")
def test_triton_kernels_forward_and_backward(d, window):
  _check_attention("triton", d, window)


@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"w{w}")
@pytest.mark.parametrize("d", [64, 128, 256], ids=lambda d: f"d{d}")
@HOPPER_ONLY
def test_hopper_forward_with_the_triton_backward(d, window):
  _check_attention("mosaic", d, window)


@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"w{w}")
@pytest.mark.parametrize("d", [64, 128, 256], ids=lambda d: f"d{d}")
@HOPPER_ONLY
def test_hopper_backward(d, window):
  """The opt-in Mosaic GPU backward (backward="mosaic") behind the Hopper forward."""
  _check_attention("mosaic", d, window, backward="mosaic")


@pytest.mark.parametrize("name", ["accumulate_in_place", "p_in_registers", "transpose_k_in_kernel",
                                  "schedule_barrier", "all"])
@pytest.mark.parametrize("d", [64, 128, 256], ids=lambda d: f"d{d}")
@HOPPER_ONLY
def test_hopper_forward_options(d, name):
  """Each opt-in speed-up of the Hopper forward (and all four) computes the same attention."""
  options = hopper.ForwardOptions(True, True, True, True) if name == "all" else hopper.ForwardOptions(**{name: True})
  _check_attention("mosaic", d, 200, hopper_forward=options)


@pytest.mark.parametrize("backend", ["triton", pytest.param("mosaic", marks=HOPPER_ONLY)])
def test_packed_documents(backend):
  _check_attention(backend, 128, 100, s=517, documents=True)


def test_triton_kernels_in_fp32():
  _check_attention("triton", 64, 64, dtype=jnp.float32)


def test_dispatch_picks_mosaic_on_hopper_only():
  want = "mosaic" if ON_HOPPER else "triton"
  assert default_backend(jnp.bfloat16, 128) == want
  assert default_backend(jnp.float32, 128) == "triton"


@pytest.mark.parametrize("window", [64, None], ids=lambda w: f"w{w}")
def test_cudnn_comparator_matches_xla(window):
  q, k, v, cotangent = inputs(2, 256, 4, 4, 128, jnp.bfloat16)
  ours = value_and_grads(lambda q, k, v: cudnn_attention(q, k, v, window), q, k, v, cotangent)
  want = _reference_grads(lambda q, k, v: xla_attention(q, k, v, window), q, k, v, cotangent)
  for got, ref in zip(ours, want):
    assert_close(got, ref, tolerance(jnp.bfloat16))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_fused_operators(dtype):
  keys = jax.random.split(jax.random.key(0), 4)
  x, up = (jax.random.normal(k, (4, 300, 512), dtype) for k in keys[:2])
  bias = 0.1 * jax.random.normal(keys[2], (512,), dtype)
  scale = 1 + 0.1 * jax.random.normal(keys[3], (512,))

  rms_norm = NORM_MODULES["rmsnorm"](1e-5, dtype, jnp.float32, "norm")     # the model's own norm
  pairs = [(jax.jit(fused_bias_gelu)(x, bias), gelu(x + bias)),
           (jax.jit(fused_swiglu)(x, up), swiglu(x, up)),
           (jax.jit(fused_rms_norm)(x, scale), rms_norm.apply({"params": {"scale": scale}}, x))]
  for got, want in pairs:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert_close(got, want, 2e-5 if dtype == jnp.float32 else 2e-2)   # no dots: exact fp32 either way


def test_the_3d_step_on_one_gpu_agrees_across_attention_impls(tiny_config):
  """The jitted shard_map step on a 1x1x1 GPU mesh, bf16, 3 steps with each attention_impl:
  the losses agree (the kernels reach the step compiled, not interpreted)."""
  c = tiny_config
  c.model.hidden_dim, c.model.num_heads, c.model.seq_len, c.model.vocab_size = 256, 2, 512, 512
  c.model.window, c.model.compute_dtype = 128, "bfloat16"
  losses = {}
  for impl in ("xla", "pallas", "cudnn"):
    c.model.attention_impl = impl
    step = CompiledStep(c, jax.devices()[:1])
    losses[impl] = [float(step.run()["loss"]) for _ in range(3)]
  assert all(np.isfinite(losses["xla"])), losses
  for impl in ("pallas", "cudnn"):
    np.testing.assert_allclose(losses[impl], losses["xla"], rtol=2e-2, err_msg=str(losses))
