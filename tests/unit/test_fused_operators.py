"""The fused-operator Pallas kernels (interpret mode) against the XLA code they replace: the
fused LayerNorm and RMSNorm (+ residual add) against megajax.layers' norms, the fused bias +
GeLU against the MLP's GeLU, the fused SwiGLU against the MLP's SwiGLU."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from megajax.layers import NORM_MODULES, swiglu
from megajax.layers.kernels import fused_bias_gelu, fused_layer_norm, fused_rms_norm, fused_swiglu
from tests.support.kernels import assert_close, tolerance


@pytest.mark.parametrize("shape", [(3, 7, 64), (2, 16, 128)], ids=["padded_rows", "block_rows"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "add_norm"])
def test_matches_the_flax_layer_norm(shape, dtype, with_residual):
  _check_norm("layernorm", shape, dtype, with_residual)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "add_norm"])
def test_matches_the_flax_rms_norm(dtype, with_residual):
  """The same kernels without the mean and the bias (model.norm=rmsnorm)."""
  _check_norm("rmsnorm", (3, 7, 64), dtype, with_residual)


def _check_norm(kind, shape, dtype, with_residual):
  """The fused norm's outputs and every gradient against the model's Flax module."""
  keys = jax.random.split(jax.random.key(0), 5)
  x, residual = (jax.random.normal(k, shape, dtype) for k in keys[:2])
  scale = 1 + 0.1 * jax.random.normal(keys[2], shape[-1:])
  bias = 0.1 * jax.random.normal(keys[3], shape[-1:]) if kind == "layernorm" else None
  cotangent = jax.random.normal(keys[4], shape)
  module = NORM_MODULES[kind](1e-5, dtype, jnp.float32, "norm")
  weights = lambda scale, bias: {"scale": scale} if bias is None else {"scale": scale, "bias": bias}
  reference = lambda z, scale, bias: module.apply({"params": weights(scale, bias)}, z)

  def loss(norm, x, residual, scale, bias):   # through y, and through z (the residual stream) when fused
    if not with_residual:
      return jnp.sum(norm(x, scale, bias).astype(jnp.float32) * cotangent)
    z, y = norm(x, scale, bias, residual)
    return jnp.sum((y.astype(jnp.float32) + z.astype(jnp.float32)) * cotangent)

  def ours(x, scale, bias, residual=None):
    if kind == "rmsnorm":
      return fused_rms_norm(x, scale, residual, block_rows=8)
    return fused_layer_norm(x, scale, bias, residual, block_rows=8)

  plain = lambda x, scale, bias, residual=None: (
      reference(x, scale, bias) if residual is None else (x + residual, reference(x + residual, scale, bias)))
  tol = tolerance(dtype)
  for got, want in zip(jax.tree.leaves(ours(x, scale, bias, residual if with_residual else None)),
                       jax.tree.leaves(plain(x, scale, bias, residual if with_residual else None))):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert_close(got, want, tol)
  grads = jax.grad(loss, argnums=(1, 2, 3, 4))
  got, want = grads(ours, x, residual, scale, bias), grads(plain, x, residual, scale, bias)
  assert len(jax.tree.leaves(got)) == len(jax.tree.leaves(want)) == (3 if bias is None else 4)
  for got, want in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert_close(got, want, tol)


@pytest.mark.parametrize("shape", [(3, 7, 64), (2, 16, 1024), (4, 8, 96)],
                         ids=["padded_rows", "tiled_columns", "whole_row"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_matches_xla_gelu(shape, dtype):
  keys = jax.random.split(jax.random.key(0), 3)
  x = 2 * jax.random.normal(keys[0], shape, dtype)
  bias = 0.5 * jax.random.normal(keys[1], shape[-1:])
  cotangent = jax.random.normal(keys[2], shape)
  ours = lambda x, bias: fused_bias_gelu(x, bias, block_rows=8)
  reference = lambda x, bias: nn.gelu(x + bias.astype(x.dtype), approximate=True)
  _assert_same_output_and_grads(ours, reference, (x, bias), cotangent, dtype)


@pytest.mark.parametrize("shape,dtype", [((3, 7, 64), jnp.float32), ((3, 7, 64), jnp.bfloat16),
                                         ((2, 16, 1024), jnp.bfloat16)],
                         ids=["padded_rows-fp32", "padded_rows-bf16", "tiled_columns-bf16"])
def test_matches_xla_swiglu(shape, dtype):
  """fused_swiglu against the model's SwiGLU (megajax.layers.swiglu): output, d_gate, d_up."""
  keys = jax.random.split(jax.random.key(0), 3)
  gate, up = (2 * jax.random.normal(k, shape, dtype) for k in keys[:2])
  cotangent = jax.random.normal(keys[2], shape)
  ours = lambda gate, up: fused_swiglu(gate, up, block_rows=8)
  _assert_same_output_and_grads(ours, swiglu, (gate, up), cotangent, dtype)


def _assert_same_output_and_grads(ours, reference, args, cotangent, dtype):
  """Output (dtype, shape, values) and the gradients of both arguments, fp32 or bf16 tolerance."""
  got, want = ours(*args), reference(*args)
  assert got.dtype == want.dtype and got.shape == want.shape
  tol = tolerance(dtype)
  assert_close(got, want, tol)
  loss = lambda f, *args: jnp.sum(f(*args).astype(jnp.float32) * cotangent)
  grads = jax.grad(loss, argnums=(1, 2))
  for got, want in zip(grads(ours, *args), grads(reference, *args)):
    assert_close(got, want, tol)
