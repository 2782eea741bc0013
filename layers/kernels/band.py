"""Which blocks a sliding-window attention kernel visits: the band geometry both Pallas
kernels (portable and Hopper) loop over, and the tests and benchmark count with.

Token i attends to key j when i - window < j <= i (window=None: plain causal), and, with
packed documents, segment_ids[i] == segment_ids[j]. A query block's band of KV blocks is
split Splash-style into partial blocks (the window's left edge, a document boundary, the
diagonal: masked) and full blocks between them (no mask).

Documents bound the band too. Segment ids never decrease along a row, so a document is a
contiguous run [start, end) and every row of a query block sees no key before the document
start of its first row; every key of a KV block is seen by no row at or after the document
end of its last key (`document_bounds` computes both per token). A block is full only if
every pair in it is in one document: keys from the document start of the query block's last
row on, rows before the document end of the KV block's first key.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from megajax.layers.kernels.support import ceil_div

DEFAULT_BLOCK = 64
# The segment id of padded positions: no real token has it, and ids stay non-decreasing.
PADDING_SEGMENT = int(jnp.iinfo(jnp.int32).max)


def _maximum(a, b):   # ints (the tests' and benchmark's bounds) or traced ints (the kernels')
  return jnp.maximum(a, b) if isinstance(a, jax.Array) or isinstance(b, jax.Array) else max(a, b)


def _minimum(a, b):
  return jnp.minimum(a, b) if isinstance(a, jax.Array) or isinstance(b, jax.Array) else min(a, b)


def _clamp(x, lo, hi):
  return _minimum(_maximum(x, lo), hi)


def in_window(query_ids, key_ids, window: int | None):
  """Which (query, key) pairs are visible by position: key <= query and, with a window,
  key > query - window. Elementwise: the caller broadcasts ([rows, 1] x [1, cols], or two
  tiles of ids)."""
  visible = key_ids <= query_ids
  if window is not None:
    visible &= key_ids > query_ids - window
  return visible


def band_loop(bounds, step, carry=None):
  """Runs step(block, carry, masked) over a band (lo, full_lo, full_hi, hi): its partial,
  full and partial ranges (`kv_block_ranges`, `q_block_ranges`)."""
  lo, full_lo, full_hi, hi = bounds
  carry = jax.lax.fori_loop(lo, full_lo, functools.partial(step, masked=True), carry)
  carry = jax.lax.fori_loop(full_lo, full_hi, functools.partial(step, masked=False), carry)
  return jax.lax.fori_loop(full_hi, hi, functools.partial(step, masked=True), carry)


def kv_block_ranges(q_block, block_q: int, block_k: int, window: int | None, kv_blocks: int,
                    doc_starts=None):
  """KV blocks query block `q_block` visits: (lo, full_lo, full_hi, hi). Blocks [lo, full_lo)
  and [full_hi, hi) are partial (masked), [full_lo, full_hi) full. Ints or traced ints.
  doc_starts: with segment ids, the document starts of the block's (first, last) row."""
  first, last = q_block * block_q, q_block * block_q + block_q - 1
  hi = _minimum(kv_blocks, last // block_k + 1)                      # keys <= last row
  seen_from = 0 if window is None else _maximum(0, first - window + 1)       # some row sees it
  all_see_from = 0 if window is None else last - window + 1                  # every row sees it
  if doc_starts is not None:
    seen_from = _maximum(seen_from, doc_starts[0])
    all_see_from = _maximum(all_see_from, doc_starts[1])
  lo = seen_from // block_k
  full_lo = _clamp(ceil_div(all_see_from, block_k), lo, hi)
  full_hi = _clamp((first + 1) // block_k, full_lo, hi)              # last key <= first row
  return lo, full_lo, full_hi, hi


def q_block_ranges(kv_block, block_q: int, block_k: int, window: int | None, q_blocks: int,
                   doc_ends=None):
  """Query blocks that see KV block `kv_block`: (lo, full_lo, full_hi, hi), as above.
  doc_ends: with segment ids, the document ends of the block's (first, last) key."""
  first, last = kv_block * block_k, kv_block * block_k + block_k - 1
  lo = first // block_q                                              # rows >= first key
  seen_until = q_blocks * block_q if window is None else last + window      # some row, exclusive
  all_see_until = q_blocks * block_q if window is None else first + window  # every row, exclusive
  if doc_ends is not None:
    seen_until = _minimum(seen_until, doc_ends[1])
    all_see_until = _minimum(all_see_until, doc_ends[0])
  hi = _minimum(q_blocks, ceil_div(seen_until, block_q))
  full_lo = _clamp(ceil_div(last, block_q), lo, hi)                 # first row >= last key
  full_hi = _clamp(all_see_until // block_q, full_lo, hi)
  return lo, full_lo, full_hi, hi


def document_bounds(segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
  """segment_ids int32[b, s], non-decreasing along each row -> (start, end) int32[b, s]: the
  index of the first token of each token's document and one past its last."""
  index = jnp.arange(segment_ids.shape[1], dtype=jnp.int32)
  new = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1)
  ends = jnp.concatenate([segment_ids[:, :-1] != segment_ids[:, 1:], jnp.ones_like(segment_ids[:, :1], bool)], 1)
  start = jax.lax.cummax(jnp.where(new, index, 0), axis=1)
  end = jax.lax.cummin(jnp.where(ends, index + 1, segment_ids.shape[1]), axis=1, reverse=True)
  return start, end


def visited_blocks(seq_len: int, window: int | None, block_q: int = DEFAULT_BLOCK,
                   block_k: int = DEFAULT_BLOCK, segment_ids=None) -> int:
  """KV blocks the forward visits over all query blocks (one head): the kernel's loop bounds.
  segment_ids: one packed row's int[seq_len] (the padding is a document of its own)."""
  padded = padded_length(seq_len, block_q, block_k)
  starts = None
  if segment_ids is not None:
    segment_ids = jnp.pad(jnp.asarray(segment_ids, jnp.int32), (0, padded - seq_len),
                          constant_values=PADDING_SEGMENT)
    starts = [int(x) for x in document_bounds(segment_ids[None])[0][0]]
  total = 0
  for q_block in range(padded // block_q):
    doc_starts = None if starts is None else (starts[q_block * block_q], starts[q_block * block_q + block_q - 1])
    lo, _, _, hi = kv_block_ranges(q_block, block_q, block_k, window, padded // block_k, doc_starts)
    total += hi - lo
  return total


def padded_length(seq_len: int, *blocks: int) -> int:
  """The shortest length >= seq_len that every block size divides."""
  step = math.lcm(*blocks)
  return ceil_div(seq_len, step) * step
