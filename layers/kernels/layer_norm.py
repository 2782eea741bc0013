"""Fused LayerNorm and RMSNorm (each with an optional residual add) as Pallas kernels, forward
and backward: one kernel pair, `centered` picking the norm.

  z = x + residual (when given)
  LayerNorm (centered):  y = (z - mean(z)) / sqrt(var(z) + eps) * scale + bias
  RMSNorm:               y = z / sqrt(mean(z^2) + eps) * scale            (no mean, no bias)

Statistics in fp32 whatever the input dtype, as megajax.layers.layer_norm / rms_norm (Flax's
LayerNorm / RMSNorm with fp32 statistics) compute them; those modules are the reference
these kernels are tested against. Rows are processed in blocks of `block_rows`, the whole
feature axis in one program. The backward kernel writes dz and per-block partial sums of
d_scale (and d_bias), which XLA adds up.

Whether these beat XLA's own fusion of the same ops is a GPU measurement (the kernel
issue's benchmark); until it is made, the model keeps XLA's norms.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl
import jax.numpy as jnp

from megajax.layers.kernels.support import compiler_params, out_struct, row_blocks, use_interpret

DEFAULT_BLOCK_ROWS = 16


def _forward_kernel(*refs, eps, with_residual, centered):
  refs = list(refs)
  x = refs.pop(0)[...].astype(jnp.float32)                           # [rows, features]
  z = x + refs.pop(0)[...].astype(jnp.float32) if with_residual else x
  scale_ref = refs.pop(0)
  bias_ref = refs.pop(0) if centered else None
  if with_residual:   # z = x + residual, computed here and written out for the next residual
    z_out_ref = refs.pop(0)
    z_out_ref[...] = z.astype(z_out_ref.dtype)
  y_ref = refs.pop(0)
  mean_ref = refs.pop(0) if centered else None
  rstd_ref = refs.pop(0)
  if centered:
    mean = jnp.mean(z, axis=1)
    z = z - mean[:, None]
    mean_ref[...] = mean
  rstd = jax.lax.rsqrt(jnp.mean(z * z, axis=1) + eps)
  y = z * rstd[:, None] * scale_ref[...].astype(jnp.float32)
  if centered:
    y = y + bias_ref[...].astype(jnp.float32)
  y_ref[...] = y.astype(y_ref.dtype)
  rstd_ref[...] = rstd


def _backward_kernel(*refs, centered):
  refs = list(refs)
  z = refs.pop(0)[...].astype(jnp.float32)
  scale = refs.pop(0)[...].astype(jnp.float32)
  mean = refs.pop(0)[...] if centered else None
  rstd = refs.pop(0)[...]
  dy = refs.pop(0)[...].astype(jnp.float32)
  dz_ref, dscale_ref = refs.pop(0), refs.pop(0)
  normed = ((z - mean[:, None]) if centered else z) * rstd[:, None]
  g = dy * scale
  through_rstd = normed * jnp.mean(g * normed, axis=1, keepdims=True)
  if centered:        # and through the mean
    dz = g - jnp.mean(g, axis=1, keepdims=True) - through_rstd
    refs.pop(0)[...] = jnp.sum(dy, axis=0)[None, :]                  # d_bias partial sums
  else:
    dz = g - through_rstd
  dz_ref[...] = (rstd[:, None] * dz).astype(dz_ref.dtype)
  dscale_ref[...] = jnp.sum(dy * normed, axis=0)[None, :]


def _row_specs(block_rows, features):
  return (pl.BlockSpec((block_rows, features), lambda i: (i, 0)),
          pl.BlockSpec((features,), lambda i: (0,)),
          pl.BlockSpec((block_rows,), lambda i: (i,)))


def _forward(x, residual, scale, bias, eps, block_rows, interpret):
  """-> (z or None, y, mean or None, rstd) for rows [n, features]; bias None: RMSNorm."""
  rows, features = x.shape
  matrix, vector, per_row = _row_specs(block_rows, features)
  with_residual, centered = residual is not None, bias is not None
  stat = out_struct((rows,), jnp.float32, x)
  outs = list(pl.pallas_call(
      functools.partial(_forward_kernel, eps=eps, with_residual=with_residual, centered=centered),
      grid=(rows // block_rows,),
      in_specs=[matrix] * (1 + with_residual) + [vector] * (1 + centered),
      out_specs=[matrix] * (1 + with_residual) + [per_row] * (1 + centered),
      out_shape=[out_struct(x.shape, x.dtype, x)] * (1 + with_residual) + [stat] * (1 + centered),
      compiler_params=compiler_params(interpret, 4, 1), interpret=interpret,
      name="layer_norm_forward" if centered else "rms_norm_forward",
  )(*([x, residual] if with_residual else [x]), *([scale, bias] if centered else [scale])))
  z = outs.pop(0) if with_residual else None
  y = outs.pop(0)
  mean = outs.pop(0) if centered else None
  return z, y, mean, outs.pop(0)


def _backward(z, scale, mean, rstd, dy, block_rows, interpret):
  """-> (dz, d_scale, d_bias or None); mean None: RMSNorm."""
  rows, features = z.shape
  blocks = rows // block_rows
  centered = mean is not None
  matrix, vector, per_row = _row_specs(block_rows, features)
  partial_sums = pl.BlockSpec((1, features), lambda i: (i, 0))
  sums = out_struct((blocks, features), jnp.float32, z)
  outs = pl.pallas_call(
      functools.partial(_backward_kernel, centered=centered), grid=(blocks,),
      in_specs=[matrix, vector] + [per_row] * (1 + centered) + [matrix],
      out_specs=[matrix] + [partial_sums] * (1 + centered),
      out_shape=[out_struct(z.shape, z.dtype, z)] + [sums] * (1 + centered),
      compiler_params=compiler_params(interpret, 4, 1), interpret=interpret,
      name="layer_norm_backward" if centered else "rms_norm_backward",
  )(z, scale, *([mean] if centered else []), rstd, dy)
  reduce = lambda partial: jnp.sum(partial, axis=0).astype(scale.dtype)
  return outs[0], reduce(outs[1]), reduce(outs[2]) if centered else None


# bias None (an empty pytree: its cotangent None) is RMSNorm, throughout.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _norm(x, scale, bias, eps, block_rows, interpret):
  return _forward(x, None, scale, bias, eps, block_rows, interpret)[1]


def _norm_fwd(x, scale, bias, eps, block_rows, interpret):
  _, y, mean, rstd = _forward(x, None, scale, bias, eps, block_rows, interpret)
  return y, (x, scale, mean, rstd)


def _norm_bwd(eps, block_rows, interpret, residuals, dy):
  z, scale, mean, rstd = residuals
  return _backward(z, scale, mean, rstd, dy, block_rows, interpret)


_norm.defvjp(_norm_fwd, _norm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _add_norm(x, residual, scale, bias, eps, block_rows, interpret):
  z, y, _, _ = _forward(x, residual, scale, bias, eps, block_rows, interpret)
  return z, y


def _add_norm_fwd(x, residual, scale, bias, eps, block_rows, interpret):
  z, y, mean, rstd = _forward(x, residual, scale, bias, eps, block_rows, interpret)
  return (z, y), (z, scale, mean, rstd)


def _add_norm_bwd(eps, block_rows, interpret, residuals, cotangents):
  z, scale, mean, rstd = residuals
  dz_out, dy = cotangents
  dz, dscale, dbias = _backward(z, scale, mean, rstd, dy, block_rows, interpret)
  dz = dz + dz_out              # z also flows on as the residual stream
  return dz, dz, dscale, dbias


_add_norm.defvjp(_add_norm_fwd, _add_norm_bwd)


def _apply(x, scale, bias, residual, eps, block_rows, interpret):
  interpret = use_interpret(interpret)
  rows, unrows = row_blocks(x.shape, block_rows)
  if residual is None:
    return unrows(_norm(rows(x), scale, bias, eps, block_rows, interpret))
  z, y = _add_norm(rows(x), rows(residual), scale, bias, eps, block_rows, interpret)
  return unrows(z), unrows(y)


def fused_layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, residual: jax.Array | None = None,
                     eps: float = 1e-5, block_rows: int = DEFAULT_BLOCK_ROWS, interpret: bool | None = None):
  """LayerNorm over the last axis: returns y; with a residual, (z, y) where z = x + residual
  is computed in the same kernel (the residual stream the next block adds to)."""
  return _apply(x, scale, bias, residual, eps, block_rows, interpret)


def fused_rms_norm(x: jax.Array, scale: jax.Array, residual: jax.Array | None = None, eps: float = 1e-5,
                   block_rows: int = DEFAULT_BLOCK_ROWS, interpret: bool | None = None):
  """RMSNorm over the last axis (model.norm=rmsnorm): returns y; with a residual, (z, y) as
  fused_layer_norm."""
  return _apply(x, scale, None, residual, eps, block_rows, interpret)
