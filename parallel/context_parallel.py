"""Context parallelism: attention over a sequence whose positions are split across devices.

Inside a shard_map over the context-parallel axis (CP, of size cp), every device holds s/cp
of a row's positions; each function below is one attention layer's core, q, k and v already
rotated (RoPE by global position), for the shard's queries:

  halo_attention (local, sliding-window layers; contiguous shards: rank r holds positions
      r*n .. r*n+n-1, n = s/cp): a query needs the previous window-1 keys, which for the
      shard's first queries sit on the previous rank. One ppermute brings that rank's last
      window-1 keys and values (and document ids): O(w) bytes whatever s is, and its
      transpose sends their gradients back in the backward. The attention over the shard's
      own keys (the sliding-window Pallas kernel with its block-skip, impl="pallas", or the
      dense XLA reference) does not wait for it (XLA may run the permute under it); only the
      first window-1 queries reach the halo: they are attended again, in the same kernel,
      over the 2(w-1) edge (the halo, then the shard's first w-1 keys), and their rows
      replaced. O(w) work, memory and copy for the edge; no buffer of the shard's K/V.
      window - 1 > n (a halo beyond the previous rank) is refused (ValueError): one hop.

  ring_attention (global, full causal layers; the dual-chunk layout: the row cut into 2*cp
      chunks, rank r holding chunks r and 2*cp-1-r, so every rank has as many visible
      query-key pairs as any other): cp steps, the keys and values (and document ids)
      passed one rank on at each (cp-1 ppermutes of the shard's K/V: (cp-1)/cp of the row's);
      the own block under the causal mask, each visiting rank's by the half of it its
      position makes visible (c x 2c pairs, a lax.cond per rank), the partial attentions
      merged online by their log-sum-exp.

  dual_chunk_halo_attention: halo_attention in the ring's layout (so a model of local and
      global layers keeps one layout): each chunk's halo from its neighbour chunk's rank, two
      O(w) permutes.

`dual_chunk_order(seq_len, cp)` is the layout's permutation of a row's positions.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from megajax.layers import ATTENTION_IMPLS
from megajax.parallel import collectives
from megajax.parallel.mesh import CP


def dual_chunk_order(seq_len: int, cp: int) -> np.ndarray:
  """The positions of a row in the order the ring's layout holds them: rank r's shard is
  positions [r*c, (r+1)*c) then [(2cp-1-r)*c, (2cp-r)*c), c = seq_len / (2*cp); the shards
  one after the other (so a row split evenly over cp devices lands laid out)."""
  if seq_len % (2 * cp):
    raise ValueError(f"a row of {seq_len} positions does not cut into 2 * cp = {2 * cp} equal chunks")
  c = seq_len // (2 * cp)
  chunks = [chunk for r in range(cp) for chunk in (r, 2 * cp - 1 - r)]
  return np.concatenate([np.arange(chunk * c, (chunk + 1) * c) for chunk in chunks])


def uses_dual_chunks(model) -> bool:
  """The layout a model's rows take under cp: the dual-chunk one (dual_chunk_order) when a layer
  is global (its ring needs the balance), contiguous shards when every layer has a window (one
  halo, one kernel call over the shard). `model`: a megajax.model.ModelConfig."""
  return any(model.layer_window(layer) is None for layer in range(model.num_layers))


def row_order(seq_len: int, cp: int, dual_chunks: bool) -> np.ndarray | None:
  """The permutation a row's positions take before an even split over cp (None: as they are)."""
  return dual_chunk_order(seq_len, cp) if cp > 1 and dual_chunks else None


def shard_positions(rows: int, n: int, dual_chunks: bool, axis: str = CP) -> jax.Array:
  """int32 [rows, n]: the row positions this rank's shard of n holds (its slice of row_order):
  the rotary positions of a batch without its own (one document a row)."""
  cp, rank = lax.axis_size(axis), collectives.axis_index(axis)
  order = row_order(n * cp, cp, dual_chunks)
  order = np.arange(n * cp) if order is None else order
  positions = lax.dynamic_slice_in_dim(jnp.asarray(order, jnp.int32), rank * n, n)
  return jnp.broadcast_to(positions, (rows, n))


def attention(q, k, v, window: int | None, segment_ids, impl: str, dual_chunks: bool, ring: bool = True,
              axis: str = CP) -> jax.Array:
  """One layer's attention over this rank's shard: ring_attention for a global layer (window
  None; the dual-chunk layout), a sliding-window one's halo in the model's layout
  (dual_chunk_halo_attention, or halo_attention over contiguous shards), in `impl`. ring=False:
  no ppermute (inside a pipeline stage's branch: _from_rank)."""
  if window is None:
    return ring_attention(q, k, v, axis=axis, segment_ids=segment_ids, ring=ring)
  halo = dual_chunk_halo_attention if dual_chunks else halo_attention
  return halo(q, k, v, window, axis=axis, segment_ids=segment_ids, impl=impl, ring=ring)


@jax.checkpoint     # the backward recomputes a block's scores: one block's live at a time, not every step's
def _partial_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array):
  """q [b, t, h, d] over k, v [b, u, kv_h, d] where mask [b, t, u] allows: (out [b, t, h, d]
  fp32, normalized over these keys; lse [b, t, h] fp32, the log of the softmax's denominator
  over the scaled scores). A query that sees none of these keys: out 0, lse -inf."""
  b, t, h, d = q.shape
  kv_heads = k.shape[2]
  q = q.reshape(b, t, kv_heads, h // kv_heads, d)
  scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32) / math.sqrt(d)
  visible = mask[:, None, None]
  scores = jnp.where(visible, scores, -jnp.inf)
  peak = jnp.max(scores, axis=-1, keepdims=True)
  peak = jnp.where(jnp.isfinite(peak), peak, 0.0)          # a row with no key: nothing to subtract
  weights = jnp.where(visible, jnp.exp(scores - peak), 0.0)
  total = jnp.sum(weights, axis=-1, keepdims=True)
  seen = total > 0
  total = jnp.where(seen, total, 1.0)
  out = jnp.einsum("bkgqs,bskd->bqkgd", (weights / total).astype(v.dtype), v, preferred_element_type=jnp.float32)
  lse = jnp.where(seen, peak + jnp.log(total), -jnp.inf)[..., 0]          # [b, kv_h, g, t]
  return out.reshape(b, t, h, d), jnp.transpose(lse, (0, 3, 1, 2)).reshape(b, t, h)


def _merge(parts: list) -> jax.Array:
  """Partial attentions of the same queries over disjoint keys, (out [b, t, h, d], lse
  [b, t, h]) each -> their attention over all of them (fp32): each part's output weighted by
  its share of the whole softmax denominator."""
  lses = [lse for _, lse in parts]
  peak = functools.reduce(jnp.maximum, lses)
  peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
  shares = [jnp.exp(lse - peak)[..., None] for lse in lses]   # exp(-inf) = 0: a part with no key
  total = functools.reduce(jnp.add, shares)
  out = functools.reduce(jnp.add, [share * part for share, (part, _) in zip(shares, parts)])
  return out / jnp.where(total > 0, total, 1.0)


def _from_rank(axis: str, shift: int, ring: bool):
  """x -> rank r - shift's x, on every rank r. ring=True: one ppermute (a rank with none there
  receives zeros). ring=False, inside a pipeline stage's branch, where a ppermute (one
  rendezvous of every device of the mesh) would wait for the stages that do not run it: an
  all-gather over cp (each cp group its own collective) and this rank's pick of it (a rank with
  none there gets the other end's: the callers mask it by its document ids, as the zeros).
  cp - 1 tails received instead of one: O(w) still."""
  cp = lax.axis_size(axis)
  if ring:
    pairs = [(r, r + shift) for r in range(cp) if 0 <= r + shift < cp]
    return functools.partial(lax.ppermute, axis_name=axis, perm=pairs)

  def picked(x):
    gathered = lax.all_gather(x, axis)                        # [cp, ...]
    return lax.dynamic_index_in_dim(gathered, (lax.axis_index(axis) - shift) % cp, keepdims=False)
  return picked


def _same_document(q_segments, k_segments):
  return q_segments[:, :, None] == k_segments[:, None, :]


def _checked(impl: str, window: int, run: int):
  """The attention `impl` names (megajax.layers.ATTENTION_IMPLS: model.attention_impl's
  registry), after refusing a window that reaches beyond one run of `run` positions."""
  if impl not in ATTENTION_IMPLS:
    raise ValueError(f"impl={impl!r}: use one of {tuple(ATTENTION_IMPLS)}")
  if window - 1 > run:
    raise ValueError(f"a window of {window} reaches {window - 1} positions back, beyond the previous rank's {run}: "
                     "context parallelism sends one rank's halo (make model.window at most the positions a rank "
                     "holds in one run + 1)")
  return ATTENTION_IMPLS[impl]


def _with_edge(attend, q, k, v, window: int, segment_ids, k_halo, v_halo, halo_segments):
  """A contiguous run of positions (q, k, v [b, n, ...]; segment_ids [b, n] or None) attended
  under the window, then its first window-1 queries again over the edge: the window-1 keys
  and values before the run (k_halo, v_halo; halo_segments [b, w-1], 0 where there are none)
  followed by the run's first window-1, a 2(w-1) sequence with the same relative positions,
  whose rows replace theirs. The run's own attention does not wait for the halo."""
  halo = window - 1
  out = attend(q, k, v, window, segment_ids)
  edge = lambda before, after: jnp.concatenate([before, after[:, :halo]], axis=1)
  # The edge's first half of queries are placeholders (their rows are dropped: no gradient).
  edge_out = attend(edge(q[:, :halo], q), edge(k_halo, k), edge(v_halo, v), window,
                    edge(halo_segments, _document_ids(q, segment_ids)))
  return out.at[:, :halo].set(edge_out[:, halo:])


def _document_ids(q, segment_ids):
  """[b, n] int32: the packed documents' ids, or all ones for one document a row."""
  return jnp.ones(q.shape[:2], jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)


def _moved(ids, tail: slice, move, segment_ids):
  """The ids at `tail` as `move` delivers them; one document a row (all ones) needs no sending."""
  return ids[:, tail] if segment_ids is None else move(ids[:, tail])


def halo_attention(q: jax.Array, k: jax.Array, v: jax.Array, window: int, *, axis: str = CP,
                   segment_ids: jax.Array | None = None, impl: str = "xla", ring: bool = True) -> jax.Array:
  """Sliding-window causal attention (i - window < j <= i) of this rank's contiguous shard.
  q [b, n, h, d]; k, v [b, n, kv_h, d]; segment_ids [b, n] (the row's document numbers,
  shards of one row's). Returns [b, n, h, d] in v's dtype. impl: the attention both parts
  run in (model.attention_impl's names: "pallas" keeps the kernel's block-skip, "xla" is the
  dense reference).
  The halo: the previous rank's last window-1 keys, values and document ids (one ppermute);
  rank 0 receives nothing, its edge's first half a document 0, which no query is in (ids
  count from 1). O(w) work, memory and copy; no buffer of the shard's K/V. ring=False: the
  halo by an all-gather of the tails (_from_rank: inside a pipeline stage's branch)."""
  b, n = q.shape[:2]
  attend, halo = _checked(impl, window, n), window - 1
  cp = lax.axis_size(axis)
  if cp == 1 or halo == 0:
    return attend(q, k, v, window, segment_ids)
  forward = _from_rank(axis, 1, ring)
  tail = slice(n - halo, n)
  halo_ids = jnp.where(lax.axis_index(axis) > 0, _moved(_document_ids(q, segment_ids), tail, forward, segment_ids), 0)
  return _with_edge(attend, q, k, v, window, segment_ids, forward(k[:, tail]), forward(v[:, tail]), halo_ids)


def dual_chunk_halo_attention(q: jax.Array, k: jax.Array, v: jax.Array, window: int, *, axis: str = CP,
                              segment_ids: jax.Array | None = None, impl: str = "xla", ring: bool = True) -> jax.Array:
  """halo_attention for a shard in the ring's dual-chunk layout (dual_chunk_order: rank r holds
  chunks A = r and B = 2cp-1-r, c positions each), so a model of local and global layers keeps
  one layout. A's window-1 predecessors end rank r-1's A (one ppermute forward; rank 0: none);
  B's end rank r+1's B (one ppermute backward), but for rank cp-1, whose B (chunk cp) follows its
  own A (chunk cp-1). Two O(w) permutes (ring=False: all-gathers of the tails, _from_rank);
  the window at most c + 1."""
  two_c = q.shape[1]
  c = two_c // 2
  attend, halo = _checked(impl, window, c), window - 1
  cp = lax.axis_size(axis)
  if cp == 1 or halo == 0:         # one rank: chunks 0 and 1, the row in order
    return attend(q, k, v, window, segment_ids)
  rank = lax.axis_index(axis)
  forward, backward = _from_rank(axis, 1, ring), _from_rank(axis, -1, ring)
  a_tail, b_tail = slice(c - halo, c), slice(two_c - halo, two_c)
  last = rank == cp - 1
  b_halo = lambda x: jnp.where(last, x[:, a_tail], backward(x[:, b_tail]))
  ids = _document_ids(q, segment_ids)
  a_ids = jnp.where(rank > 0, _moved(ids, a_tail, forward, segment_ids), 0)
  b_ids = jnp.where(last, ids[:, a_tail], _moved(ids, b_tail, backward, segment_ids))
  a, b = slice(0, c), slice(c, two_c)
  a_segments, b_segments = (None, None) if segment_ids is None else (segment_ids[:, a], segment_ids[:, b])
  out_a = _with_edge(attend, q[:, a], k[:, a], v[:, a], window, a_segments, forward(k[:, a_tail]),
                     forward(v[:, a_tail]), a_ids)
  out_b = _with_edge(attend, q[:, b], k[:, b], v[:, b], window, b_segments, b_halo(k), b_halo(v), b_ids)
  return jnp.concatenate([out_a, out_b], axis=1)


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, axis: str = CP,
                   segment_ids: jax.Array | None = None, ring: bool = True) -> jax.Array:
  """Full causal attention of this rank's dual-chunk shard (dual_chunk_order). q [b, 2c, h, d];
  k, v [b, 2c, kv_h, d]; segment_ids [b, 2c]. Returns [b, 2c, h, d] in v's dtype.

  Rank r holds chunks A = r and B = 2cp-1-r. Its own keys (the first step) are attended under
  the causal mask, the masked quarter (A's queries over B's keys) not computed. A visiting rank j's chunks A' = j and B' = 2cp-1-j are all before B, all
  after A when j > r, all before A when j < r; and B' is after A always. So from j < r every
  query sees A' (and nothing of B'), from j > r only B's queries see anything, all of A' and
  B': c x 2c visible pairs either way, computed without the masked half (lax.cond per rank).
  ring=False (inside a pipeline stage's branch, where a ppermute cannot run: _from_rank): the
  shards' K/V all-gathered over cp once, the same bytes, every step's block read from it."""
  cp = lax.axis_size(axis)
  b, two_c = q.shape[:2]
  c = two_c // 2
  rank = lax.axis_index(axis)
  # The own step: A's queries see A's keys causally and none of B's (B comes after); B's see
  # all of A's and B's causally. Three c x c blocks, not the whole (2c)^2 square.
  causal = jnp.tril(jnp.ones((c, c), bool))               # within a chunk positions ascend
  documents = lambda q_from, k_to: (True if segment_ids is None
                                    else _same_document(segment_ids[:, q_from:q_from + c], segment_ids[:, :k_to]))
  out_a, lse_a = _partial_attention(q[:, :c], k[:, :c], v[:, :c], jnp.broadcast_to(causal & documents(0, c), (b, c, c)))
  b_mask = jnp.concatenate([jnp.ones((c, c), bool), causal], axis=1)
  out_b, lse_b = _partial_attention(q[:, c:], k, v, jnp.broadcast_to(b_mask & documents(c, two_c), (b, c, two_c)))
  parts = [(jnp.concatenate([out_a, out_b], axis=1), jnp.concatenate([lse_a, lse_b], axis=1))]

  def visible(q_from: int, k_to: int, k_segments):
    """Queries q_from.. over keys ..k_to, every pair visible by position: the documents' mask."""
    if segment_ids is None:
      return jnp.ones((b, two_c - q_from, k_to), bool)
    return _same_document(segment_ids[:, q_from:], k_segments[:, :k_to])

  def earlier(k, v, k_segments):        # j < r: every query over A' (the first half)
    return _partial_attention(q, k[:, :c], v[:, :c], visible(0, c, k_segments))

  def later(k, v, k_segments):          # j > r: B's queries over A' and B'; A's see none of it
    out, lse = _partial_attention(q[:, c:], k, v, visible(c, two_c, k_segments))
    return (jnp.concatenate([jnp.zeros_like(out), out], axis=1),
            jnp.concatenate([jnp.full_like(lse, -jnp.inf), lse], axis=1))

  def visitors():
    """(k, v, document ids) of rank r - step, for step = 1 .. cp-1."""
    held = (k, v, segment_ids)
    each = lambda fn, xs: tuple(None if x is None else fn(x) for x in xs)
    if ring:                      # passed one rank on at each step
      onward = [(r, (r + 1) % cp) for r in range(cp)]
      for _ in range(1, cp):
        held = each(lambda x: lax.ppermute(x, axis, onward), held)
        yield held
    else:                         # one all-gather, each step's block read from it
      every = each(lambda x: lax.all_gather(x, axis), held)
      for step in range(1, cp):
        yield each(lambda x: lax.dynamic_index_in_dim(x, (rank - step) % cp, keepdims=False), every)

  for step, (k_visiting, v_visiting, k_segments) in enumerate(visitors(), start=1):
    source = (rank - step) % cp                 # whose keys are here now
    parts.append(lax.cond(source < rank, earlier, later, k_visiting, v_visiting, k_segments))
  return _merge(parts).astype(v.dtype)
