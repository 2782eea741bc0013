"""Fused SwiGLU (the activation of model.mlp=swiglu) as Pallas kernels, forward and backward.

  y = silu(gate) * up,  silu(g) = g * sigmoid(g)

The MLP's two input projections end in this product; one kernel reads gate and up once and
writes y once, and the backward recomputes sigmoid(gate) from gate rather than storing it.
fp32 arithmetic whatever the input dtype. Tiles of `block_rows` x up to 512 columns.

XLA fuses the same elementwise ops, so whether this kernel earns its place is a GPU
measurement (`python -m megajax.launch.bench operators`); until one says so, the model keeps
XLA's `megajax.layers.swiglu`, the reference this kernel is tested against.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl
import jax.numpy as jnp

from megajax.layers.kernels.support import column_block, compiler_params, out_struct, row_blocks, use_interpret

DEFAULT_BLOCK_ROWS = 16


def _forward_kernel(gate_ref, up_ref, y_ref):
  gate = gate_ref[...].astype(jnp.float32)
  y_ref[...] = (gate * jax.nn.sigmoid(gate) * up_ref[...].astype(jnp.float32)).astype(y_ref.dtype)


def _backward_kernel(gate_ref, up_ref, dy_ref, dgate_ref, dup_ref):
  gate, up = gate_ref[...].astype(jnp.float32), up_ref[...].astype(jnp.float32)
  dy = dy_ref[...].astype(jnp.float32)
  sigmoid = jax.nn.sigmoid(gate)
  dgate_ref[...] = (dy * up * sigmoid * (1.0 + gate * (1.0 - sigmoid))).astype(dgate_ref.dtype)
  dup_ref[...] = (dy * gate * sigmoid).astype(dup_ref.dtype)


def _call(kernel, name, outputs, block_rows, interpret, *args):
  rows, features = args[0].shape
  cols = column_block(features)
  tile = pl.BlockSpec((block_rows, cols), lambda i, j: (i, j))
  like = args[0]
  return pl.pallas_call(
      kernel, grid=(rows // block_rows, features // cols), in_specs=[tile] * len(args),
      out_specs=[tile] * outputs, out_shape=[out_struct(like.shape, like.dtype, like)] * outputs,
      compiler_params=compiler_params(interpret, 4, 1), interpret=interpret, name=name,
  )(*args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _swiglu(gate, up, block_rows, interpret):
  return _call(_forward_kernel, "swiglu_forward", 1, block_rows, interpret, gate, up)[0]


def _swiglu_fwd(gate, up, block_rows, interpret):
  return _swiglu(gate, up, block_rows, interpret), (gate, up)


def _swiglu_bwd(block_rows, interpret, residuals, dy):
  gate, up = residuals
  return tuple(_call(_backward_kernel, "swiglu_backward", 2, block_rows, interpret, gate, up, dy))


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def fused_swiglu(gate: jax.Array, up: jax.Array, block_rows: int = DEFAULT_BLOCK_ROWS,
                 interpret: bool | None = None) -> jax.Array:
  """silu(gate) * up over gate, up [..., features] (the same shape and dtype)."""
  interpret = use_interpret(interpret)
  rows, unrows = row_blocks(gate.shape, block_rows)
  return unrows(_swiglu(rows(gate), rows(up), block_rows, interpret))
