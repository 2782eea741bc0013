"""What the Pallas kernels (megajax.layers.kernels) share: back-end choice and output types."""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax
import jax.numpy as jnp

# The platform the kernels are traced for, when it is not this process's default backend: a
# step exported for "cuda" on a CPU machine (jax.export) lowers them instead of interpreting.
_LOWERING_PLATFORM = contextvars.ContextVar("lowering_platform", default=None)


@contextlib.contextmanager
def lowering_for(platform: str | None):
  """Kernels traced inside are for `platform` ("cpu", "gpu" / "cuda"; None: the default backend)."""
  token = _LOWERING_PLATFORM.set(platform)
  try:
    yield
  finally:
    _LOWERING_PLATFORM.reset(token)


def use_interpret(interpret: bool | None) -> bool:
  """None: interpret mode when traced for CPU (the tests), compiled kernels for accelerators."""
  if interpret is not None:
    return interpret
  return (_LOWERING_PLATFORM.get() or jax.default_backend()) == "cpu"


def compiler_params(interpret: bool, num_warps: int, num_stages: int):
  """Triton compiler params, requested explicitly (Mosaic GPU is Pallas's default GPU
  lowering in newer jax); none in interpret mode."""
  if interpret:
    return None
  from jax.experimental.pallas import triton as pallas_triton
  return pallas_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def out_struct(shape, dtype, like) -> jax.ShapeDtypeStruct:
  """An output type varying over the same mesh axes as `like` (needed inside shard_map).
  jax 0.10 calls that `manual_axis_type`, other lines `vma`."""
  aval = jax.typeof(like)
  if hasattr(aval, "manual_axis_type"):
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=aval.manual_axis_type)
  return jax.ShapeDtypeStruct(shape, dtype, vma=getattr(aval, "vma", frozenset()))


MAX_BLOCK_COLS = 512


def column_block(features: int) -> int:
  """The columns of an elementwise kernel's tile: the largest of 512, 256, 128 dividing the
  features, else all of them."""
  for cols in (MAX_BLOCK_COLS, 256, 128):
    if features % cols == 0:
      return cols
  return features


def ceil_div(a, b):
  return -(-a // b)


def row_blocks(shape, block_rows: int):
  """For a row-wise kernel over x [..., features]: (to_rows, from_rows). to_rows flattens to
  [rows, features] and zero-pads the rows to a multiple of block_rows (zero rows stay finite
  and get zero cotangents); from_rows cuts the padding and restores `shape`."""
  features = shape[-1]
  count = math.prod(shape) // features
  padding = ceil_div(count, block_rows) * block_rows - count

  def to_rows(a):
    a = a.reshape(count, features)
    return jnp.pad(a, [(0, padding), (0, 0)]) if padding else a

  return to_rows, lambda a: a[:count].reshape(shape)
