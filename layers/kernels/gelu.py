"""Fused bias-add + GeLU (tanh approximation, the MLP's) as Pallas kernels, forward and backward.

  y = gelu(x + bias),  gelu(u) = u/2 * (1 + tanh(sqrt(2/pi) * (u + 0.044715 u^3)))

The MLP's first projection ends in exactly this pair; one kernel reads x once and writes y
once, and the backward recomputes u = x + bias from x rather than storing it. fp32
arithmetic whatever the input dtype. Tiles of `block_rows` x `block_cols`; the backward
writes per-row-block partial sums of d_bias, which XLA adds up.

XLA fuses the same elementwise ops (on GPU often into the matmul's epilogue), so whether
this kernel earns its place is a GPU measurement (`python -m megajax.launch.bench
operators`); until one says so, the model keeps XLA's `nn.gelu`.
"""

from __future__ import annotations

import functools
import math

import jax
from jax.experimental import pallas as pl
import jax.numpy as jnp

from megajax.layers.kernels.support import column_block, compiler_params, out_struct, row_blocks, use_interpret

DEFAULT_BLOCK_ROWS = 16
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _inner(u):
  return _SQRT_2_OVER_PI * (u + 0.044715 * u * u * u)


def _forward_kernel(x_ref, bias_ref, y_ref):
  u = x_ref[...].astype(jnp.float32) + bias_ref[...].astype(jnp.float32)[None, :]
  y_ref[...] = (0.5 * u * (1.0 + jnp.tanh(_inner(u)))).astype(y_ref.dtype)


def _backward_kernel(x_ref, bias_ref, dy_ref, dx_ref, dbias_ref):
  u = x_ref[...].astype(jnp.float32) + bias_ref[...].astype(jnp.float32)[None, :]
  t = jnp.tanh(_inner(u))
  derivative = 0.5 * (1.0 + t) + 0.5 * u * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * u * u)
  du = dy_ref[...].astype(jnp.float32) * derivative
  dx_ref[...] = du.astype(dx_ref.dtype)
  dbias_ref[...] = jnp.sum(du, axis=0)[None, :]


def _specs(block_rows, block_cols):
  return (pl.BlockSpec((block_rows, block_cols), lambda i, j: (i, j)),
          pl.BlockSpec((block_cols,), lambda i, j: (j,)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _bias_gelu(x, bias, block_rows, interpret):
  rows, features = x.shape
  cols = column_block(features)
  matrix, vector = _specs(block_rows, cols)
  return pl.pallas_call(
      _forward_kernel, grid=(rows // block_rows, features // cols), in_specs=[matrix, vector],
      out_specs=matrix, out_shape=out_struct(x.shape, x.dtype, x),
      compiler_params=compiler_params(interpret, 4, 1), interpret=interpret, name="bias_gelu_forward",
  )(x, bias)


def _bias_gelu_fwd(x, bias, block_rows, interpret):
  return _bias_gelu(x, bias, block_rows, interpret), (x, bias)


def _bias_gelu_bwd(block_rows, interpret, residuals, dy):
  x, bias = residuals
  rows, features = x.shape
  cols = column_block(features)
  blocks = rows // block_rows
  matrix, vector = _specs(block_rows, cols)
  dx, dbias = pl.pallas_call(
      _backward_kernel, grid=(blocks, features // cols), in_specs=[matrix, vector, matrix],
      out_specs=[matrix, pl.BlockSpec((1, cols), lambda i, j: (i, j))],
      out_shape=[out_struct(x.shape, x.dtype, x), out_struct((blocks, features), jnp.float32, x)],
      compiler_params=compiler_params(interpret, 4, 1), interpret=interpret, name="bias_gelu_backward",
  )(x, bias, dy)
  return dx, jnp.sum(dbias, axis=0).astype(bias.dtype)


_bias_gelu.defvjp(_bias_gelu_fwd, _bias_gelu_bwd)


def fused_bias_gelu(x: jax.Array, bias: jax.Array, block_rows: int = DEFAULT_BLOCK_ROWS,
                    interpret: bool | None = None) -> jax.Array:
  """gelu(x + bias) (tanh approximation) over x [..., features], bias [features]."""
  interpret = use_interpret(interpret)
  rows, unrows = row_blocks(x.shape, block_rows)
  return unrows(_bias_gelu(rows(x), bias, block_rows, interpret))
