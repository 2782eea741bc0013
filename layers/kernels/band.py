"""Which blocks a sliding-window attention kernel visits: the band geometry both Pallas
kernels (portable and Hopper) loop over, and the tests and benchmark count with.

Token i attends to key j when i - window < j <= i (window=None: plain causal). A query
block's band of KV blocks is split Splash-style into partial blocks (the window's left
edge and the diagonal: masked) and full blocks between them (no mask).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from megajax.layers.kernels.support import ceil_div

DEFAULT_BLOCK = 64


def _maximum(a, b):   # ints (the tests' and benchmark's bounds) or traced ints (the kernels')
  return jnp.maximum(a, b) if isinstance(a, jax.Array) or isinstance(b, jax.Array) else max(a, b)


def _minimum(a, b):
  return jnp.minimum(a, b) if isinstance(a, jax.Array) or isinstance(b, jax.Array) else min(a, b)


def _clamp(x, lo, hi):
  return _minimum(_maximum(x, lo), hi)


def kv_block_ranges(q_block, block_q: int, block_k: int, window: int | None, kv_blocks: int):
  """KV blocks query block `q_block` visits: (lo, full_lo, full_hi, hi). Blocks [lo, full_lo)
  and [full_hi, hi) are partial (masked), [full_lo, full_hi) full. Ints or traced ints."""
  first, last = q_block * block_q, q_block * block_q + block_q - 1
  hi = _minimum(kv_blocks, last // block_k + 1)                      # keys <= last row
  lo = 0 if window is None else _maximum(0, first - window + 1) // block_k
  full_lo = lo if window is None else _clamp(ceil_div(last - window + 1, block_k), lo, hi)
  full_hi = _clamp((first + 1) // block_k, full_lo, hi)              # last key <= first row
  return lo, full_lo, full_hi, hi


def q_block_ranges(kv_block, block_q: int, block_k: int, window: int | None, q_blocks: int):
  """Query blocks that see KV block `kv_block`: (lo, full_lo, full_hi, hi), as above."""
  first, last = kv_block * block_k, kv_block * block_k + block_k - 1
  lo = first // block_q                                              # rows >= first key
  hi = q_blocks if window is None else _minimum(q_blocks, (last + window - 1) // block_q + 1)
  full_lo = _clamp(ceil_div(last, block_q), lo, hi)                 # first row >= last key
  full_hi = hi if window is None else _clamp((first + window) // block_q, full_lo, hi)
  return lo, full_lo, full_hi, hi


def visited_blocks(seq_len: int, window: int | None, block_q: int = DEFAULT_BLOCK,
                   block_k: int = DEFAULT_BLOCK) -> int:
  """KV blocks the forward visits over all query blocks (one head): the kernel's loop bounds."""
  padded = padded_length(seq_len, block_q, block_k)
  total = 0
  for q_block in range(padded // block_q):
    lo, _, _, hi = kv_block_ranges(q_block, block_q, block_k, window, padded // block_k)
    total += hi - lo
  return total


def padded_length(seq_len: int, *blocks: int) -> int:
  """The shortest length >= seq_len that every block size divides."""
  step = math.lcm(*blocks)
  return ceil_div(seq_len, step) * step
