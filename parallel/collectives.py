"""The collectives of the 3D step: jax.lax's, over the mesh axes that have more than one device.

A collective over an axis of one device moves nothing, but XLA:CPU still runs it (a
rendezvous and a copy per call: the dp=8 step held 10 all-gathers, 10 reduce-scatters and 3
all-reduces over tp=1) and it stays in the program. So the step keeps a size-1 axis out of
everything: out of the specs (megajax.parallel.mesh.batch_spec; a parameter's Layout splits
only over axes of more than one device), out of the values' varying-axes types (to_varying
and axis_index here give nothing per-device along it), and so out of every collective:
with nothing varying over the axis, summing over it is the identity, and shard_map's type
checks agree. Use these inside the step's shard_map, never lax's over a mesh axis.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def live_axes(axes) -> tuple[str, ...]:
  """The axes of `axes` (one name or several) that have more than one device."""
  axes = (axes,) if isinstance(axes, str) else tuple(axes)
  return tuple(a for a in axes if lax.axis_size(a) > 1)


def psum(x, axes):
  live = live_axes(axes)
  return lax.psum(x, live) if live else x


def pmax(x, axes):
  live = live_axes(axes)
  return lax.pmax(x, live) if live else x


def all_gather(x, axis: str, *, dim: int = 0):
  """lax.all_gather(x, axis, axis=dim, tiled=True); one device: x."""
  return lax.all_gather(x, axis, axis=dim, tiled=True) if live_axes(axis) else x


def psum_scatter(x, axis: str, *, scatter_dimension: int = 0):
  """lax.psum_scatter(x, axis, scatter_dimension=..., tiled=True); one device: x."""
  if live_axes(axis):
    return lax.psum_scatter(x, axis, scatter_dimension=scatter_dimension, tiled=True)
  return x


def axis_index(axis: str):
  """This device's index along `axis`; one device: a constant 0 (nothing varies along it)."""
  return lax.axis_index(axis) if live_axes(axis) else jnp.int32(0)
