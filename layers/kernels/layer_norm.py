"""Fused LayerNorm (with an optional residual add) as Pallas kernels, forward and backward.

  z = x + residual (when given);  y = (z - mean(z)) / sqrt(var(z) + eps) * scale + bias

Statistics in fp32 whatever the input dtype, as megajax.layers.layer_norm (Flax's
LayerNorm with fp32 statistics) computes them; that module is the reference these kernels
are tested against. Rows are processed in blocks of `block_rows`, the whole feature axis
in one program. The backward kernel writes dz and per-block partial sums of d_scale and
d_bias, which XLA adds up.

Whether these beat XLA's own fusion of the same ops is a GPU measurement (the kernel
issue's benchmark); until it is made, the model keeps XLA's LayerNorm.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl
import jax.numpy as jnp

from megajax.layers.kernels.support import compiler_params, out_struct, row_blocks, use_interpret

DEFAULT_BLOCK_ROWS = 16


def _forward_kernel(*refs, eps, with_residual):
  if with_residual:   # z = x + residual, computed here and written out for the next residual
    x_ref, r_ref, scale_ref, bias_ref, z_out_ref, y_ref, mean_ref, rstd_ref = refs
    z = x_ref[...].astype(jnp.float32) + r_ref[...].astype(jnp.float32)
    z_out_ref[...] = z.astype(z_out_ref.dtype)
  else:
    x_ref, scale_ref, bias_ref, y_ref, mean_ref, rstd_ref = refs
    z = x_ref[...].astype(jnp.float32)                               # [rows, features]
  mean = jnp.mean(z, axis=1)
  centered = z - mean[:, None]
  rstd = jax.lax.rsqrt(jnp.mean(centered * centered, axis=1) + eps)
  y = centered * rstd[:, None] * scale_ref[...].astype(jnp.float32) + bias_ref[...].astype(jnp.float32)
  y_ref[...] = y.astype(y_ref.dtype)
  mean_ref[...] = mean
  rstd_ref[...] = rstd


def _backward_kernel(z_ref, scale_ref, mean_ref, rstd_ref, dy_ref, dz_ref, dscale_ref, dbias_ref):
  z = z_ref[...].astype(jnp.float32)
  dy = dy_ref[...].astype(jnp.float32)
  rstd = rstd_ref[...]
  normed = (z - mean_ref[...][:, None]) * rstd[:, None]
  g = dy * scale_ref[...].astype(jnp.float32)
  dz = rstd[:, None] * (g - jnp.mean(g, axis=1, keepdims=True) - normed * jnp.mean(g * normed, axis=1, keepdims=True))
  dz_ref[...] = dz.astype(dz_ref.dtype)
  dscale_ref[...] = jnp.sum(dy * normed, axis=0)[None, :]
  dbias_ref[...] = jnp.sum(dy, axis=0)[None, :]


def _row_specs(block_rows, features):
  return (pl.BlockSpec((block_rows, features), lambda i: (i, 0)),
          pl.BlockSpec((features,), lambda i: (0,)),
          pl.BlockSpec((block_rows,), lambda i: (i,)))


def _forward(x, residual, scale, bias, eps, block_rows, interpret):
  """-> (z or None, y, mean, rstd) for rows [n, features]."""
  rows, features = x.shape
  matrix, vector, per_row = _row_specs(block_rows, features)
  with_residual = residual is not None
  stats = [out_struct((rows,), jnp.float32, x), out_struct((rows,), jnp.float32, x)]
  outs = pl.pallas_call(
      functools.partial(_forward_kernel, eps=eps, with_residual=with_residual), grid=(rows // block_rows,),
      in_specs=[matrix] * (1 + with_residual) + [vector, vector],
      out_specs=[matrix] * (1 + with_residual) + [per_row, per_row],
      out_shape=[out_struct(x.shape, x.dtype, x)] * (1 + with_residual) + stats,
      compiler_params=compiler_params(interpret, 4, 1), interpret=interpret, name="layer_norm_forward",
  )(*([x, residual] if with_residual else [x]), scale, bias)
  return tuple(outs) if with_residual else (None, *outs)


def _backward(z, scale, mean, rstd, dy, block_rows, interpret):
  rows, features = z.shape
  blocks = rows // block_rows
  matrix, vector, per_row = _row_specs(block_rows, features)
  partial_sums = pl.BlockSpec((1, features), lambda i: (i, 0))
  dz, dscale, dbias = pl.pallas_call(
      _backward_kernel, grid=(blocks,),
      in_specs=[matrix, vector, per_row, per_row, matrix], out_specs=[matrix, partial_sums, partial_sums],
      out_shape=[out_struct(z.shape, z.dtype, z), out_struct((blocks, features), jnp.float32, z),
                 out_struct((blocks, features), jnp.float32, z)],
      compiler_params=compiler_params(interpret, 4, 1), interpret=interpret, name="layer_norm_backward",
  )(z, scale, mean, rstd, dy)
  return dz, jnp.sum(dscale, axis=0).astype(scale.dtype), jnp.sum(dbias, axis=0).astype(scale.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _layer_norm(x, scale, bias, eps, block_rows, interpret):
  return _forward(x, None, scale, bias, eps, block_rows, interpret)[1]


def _layer_norm_fwd(x, scale, bias, eps, block_rows, interpret):
  _, y, mean, rstd = _forward(x, None, scale, bias, eps, block_rows, interpret)
  return y, (x, scale, mean, rstd)


def _layer_norm_bwd(eps, block_rows, interpret, residuals, dy):
  z, scale, mean, rstd = residuals
  return _backward(z, scale, mean, rstd, dy, block_rows, interpret)


_layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _add_layer_norm(x, residual, scale, bias, eps, block_rows, interpret):
  z, y, _, _ = _forward(x, residual, scale, bias, eps, block_rows, interpret)
  return z, y


def _add_layer_norm_fwd(x, residual, scale, bias, eps, block_rows, interpret):
  z, y, mean, rstd = _forward(x, residual, scale, bias, eps, block_rows, interpret)
  return (z, y), (z, scale, mean, rstd)


def _add_layer_norm_bwd(eps, block_rows, interpret, residuals, cotangents):
  z, scale, mean, rstd = residuals
  dz_out, dy = cotangents
  dz, dscale, dbias = _backward(z, scale, mean, rstd, dy, block_rows, interpret)
  dz = dz + dz_out              # z also flows on as the residual stream
  return dz, dz, dscale, dbias


_add_layer_norm.defvjp(_add_layer_norm_fwd, _add_layer_norm_bwd)


def fused_layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, residual: jax.Array | None = None,
                     eps: float = 1e-5, block_rows: int = DEFAULT_BLOCK_ROWS, interpret: bool | None = None):
  """LayerNorm over the last axis: returns y; with a residual, (z, y) where z = x + residual
  is computed in the same kernel (the residual stream the next block adds to)."""
  interpret = use_interpret(interpret)
  rows, unrows = row_blocks(x.shape, block_rows)
  if residual is None:
    return unrows(_layer_norm(rows(x), scale, bias, eps, block_rows, interpret))
  z, y = _add_layer_norm(rows(x), rows(residual), scale, bias, eps, block_rows, interpret)
  return unrows(z), unrows(y)
