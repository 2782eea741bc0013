"""The parallel linears of tensor + sequence parallelism, with or without collective matmul.

Inside the step's shard_map, activations between blocks are split along the sequence
over `tp` (sequence parallelism) and weights are split along their feature dimension:

  column_parallel_linear:  x [b, s/tp, k] -> all-gather(seq) -> @ w [k, f/tp] -> [b, s, f/tp]
  column_parallel_apply:   x [b, s/tp, k] -> all-gather(seq) -> fn (token-wise: norms, matmuls)
  row_parallel_linear:     x [b, s, k/tp] -> @ w [k/tp, f] -> reduce-scatter(seq) -> [b, s/tp, f]

`mode="none"` issues the collective and then the matmul (the baseline). In
`mode="collective_matmul"` (MegaScale Fig. 3c) the collective is decomposed into
`ppermute` steps around the tp ring and fused with the matmul: each device works on
the sequence chunk it already holds while the next chunk is in flight, in both ring
directions at once (even chunks travel to rank+1, odd chunks to rank-1). The backward
pass is overlapped the same way through a custom VJP: the input gradient of an
all-gather-matmul is a matmul-reduce-scatter and vice versa.

`ring=False` keeps the chunking but not the ring: each sequence chunk is one all-gather
(or reduce-scatter) over the tp group, multiplied while the next chunk's collective is in
flight; autodiff chunks the backward the same way. The pipeline uses it inside its
per-stage branches, where a ppermute cannot go: a collective-permute is one operation over
every device of the program, and a branch runs on one stage's devices only.
"""

from __future__ import annotations

import functools

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
from jax import lax

from megajax.model import PROJECTION_OUTPUT
from megajax.parallel import collectives
from megajax.parallel.mesh import TP, varying_axes

__all__ = ["all_gather_matmul", "chunked_all_gather_apply", "chunked_all_gather_matmul",
           "chunked_matmul_reduce_scatter", "column_parallel_apply", "column_parallel_linear", "matmul_reduce_scatter",
           "row_parallel_linear"]



def _ring_perm(n: int, shift: int):
  return [(i, (i + shift) % n) for i in range(n)]


def _direction(chunk: int, chunks: int) -> int:
  """+1: the chunk travels to rank+1; -1: to rank-1 (a single chunk goes one way)."""
  return 1 if chunks == 1 or chunk % 2 == 0 else -1


def _weight_cotangent(d_w, w):
  """A weight equal across some mesh axes gets its cotangent summed over them, as autodiff
  would do for a weight broadcast into per-device compute."""
  extra = tuple(sorted(varying_axes(d_w) - varying_axes(w)))
  return collectives.psum(d_w, extra)


def _chunk(s_local: int, chunks: int) -> int:
  if chunks < 1 or s_local % chunks:
    raise ValueError(f"chunks={chunks} does not divide the {s_local}-token sequence shard "
                     "(parallel.tp_overlap_chunks must divide seq_len / tp)")
  return s_local // chunks


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul(x, w, out_dtype):
  """x [b, s, k] @ w [k, f], its backward written out rather than left to autodiff: the
  weight gradient as einsum("bsk,bsf->kf", x, dy), the input gradient as dy @ w.T. Autodiff's
  transpose contracts the tokens into a [f, k] product and transposes that, a dot XLA:CPU
  leaves to Eigen at half the speed of its YNNPACK matmuls (52 vs 24 ms for [4096, 512] x
  [4096, 2048] on 2 cores); the same dots for a GPU."""
  return jnp.einsum("bsk,kf->bsf", x, w, preferred_element_type=out_dtype)


def _matmul_fwd(x, w, out_dtype):
  return _matmul(x, w, out_dtype), (x, w)


def _matmul_bwd(out_dtype, residuals, d_out):
  # In the cotangent's dtype, as autodiff of the plain matmul would (fp32 for the head's logits).
  x, w = residuals
  d_x = jnp.einsum("bsf,kf->bsk", d_out, w.astype(d_out.dtype)).astype(x.dtype)
  d_w = jnp.einsum("bsk,bsf->kf", x.astype(d_out.dtype), d_out).astype(w.dtype)
  return _weight_cotangent(d_x, x), _weight_cotangent(d_w, w)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def _ring_all_gather(x, fn, chunks: int):
  """(fn(all_gather(x, seq)), all_gather(x, seq)) for a token-wise `fn` (each token's output
  from its own input), each transfer hidden behind fn on a chunk already held.

  x: [b, s_local, k] this rank's sequence shard. Step t computes on the chunks that started
  t ranks away while `ppermute` moves them one rank further.
  """
  n = lax.axis_size(TP)
  rank = lax.axis_index(TP)
  b, s_local, k = x.shape
  piece = _chunk(s_local, chunks)
  held = [x[:, c * piece:(c + 1) * piece] for c in range(chunks)]
  out = None
  gathered = jnp.zeros((b, n * s_local, k), x.dtype)
  for step in range(n):
    # Issue the next transfer first: it depends only on what we hold, not on this step's compute.
    moving = ([lax.ppermute(h, TP, _ring_perm(n, _direction(c, chunks))) for c, h in enumerate(held)]
              if step < n - 1 else None)
    for c, h in enumerate(held):
      source = (rank - _direction(c, chunks) * step) % n
      start = source * s_local + c * piece
      y = fn(h)
      if out is None:
        out = jnp.zeros((b, n * s_local, y.shape[-1]), y.dtype)
      out = lax.dynamic_update_slice_in_dim(out, y, start, axis=1)
      gathered = lax.dynamic_update_slice_in_dim(gathered, h, start, axis=1)
    held = moving
  return out, gathered


def _ring_all_gather_matmul(x, w, chunks: int, out_dtype):
  """(all_gather(x, seq) @ w, all_gather(x, seq)), w: [k, f]: the ring with a matmul per chunk."""
  dtype = out_dtype or jnp.result_type(x, w)
  return _ring_all_gather(x, lambda h: _matmul(h, w, out_dtype).astype(dtype), chunks)


def _ring_matmul_reduce_scatter(x, w, chunks: int, out_dtype):
  """reduce_scatter(x @ w, seq) with each partial sum's transfer hidden behind the next matmul.

  x: [b, s, k] (full sequence, this rank's slice of k); w: [k, f]. A running sum for
  destination rank d starts one ring-length away and collects one partial product per hop.
  """
  n = lax.axis_size(TP)
  rank = lax.axis_index(TP)
  s_local = x.shape[1] // n
  piece = _chunk(s_local, chunks)
  results = []
  for c in range(chunks):
    direction = _direction(c, chunks)
    total = None
    for step in range(n):
      destination = (rank + direction * (n - 1 - step)) % n
      rows = lax.dynamic_slice_in_dim(x, destination * s_local + c * piece, piece, axis=1)
      partial = _matmul(rows, w, out_dtype)
      total = partial if total is None else partial + lax.ppermute(total, TP, _ring_perm(n, direction))
    results.append(total)
  return jnp.concatenate(results, axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def all_gather_matmul(x, w, chunks: int, out_dtype=None):
  """all_gather(x, seq over tp) @ w, as a bidirectional collective matmul."""
  return _ring_all_gather_matmul(x, w, chunks, out_dtype)[0]


def _all_gather_matmul_fwd(x, w, chunks, out_dtype):
  out, gathered = _ring_all_gather_matmul(x, w, chunks, out_dtype)
  return out, (gathered, w)


def _all_gather_matmul_bwd(chunks, out_dtype, residuals, d_out):
  # In the cotangent's dtype, as autodiff of the plain matmul would (fp32 for the head's logits).
  gathered, w = residuals
  d_x = _ring_matmul_reduce_scatter(d_out, w.T.astype(d_out.dtype), chunks, None).astype(gathered.dtype)
  d_w = jnp.einsum("bsk,bsf->kf", gathered.astype(d_out.dtype), d_out).astype(w.dtype)
  return d_x, _weight_cotangent(d_w, w)


all_gather_matmul.defvjp(_all_gather_matmul_fwd, _all_gather_matmul_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def matmul_reduce_scatter(x, w, chunks: int, out_dtype=None):
  """reduce_scatter(x @ w, seq over tp), as a bidirectional collective matmul."""
  return _ring_matmul_reduce_scatter(x, w, chunks, out_dtype)


def _matmul_reduce_scatter_fwd(x, w, chunks, out_dtype):
  return _ring_matmul_reduce_scatter(x, w, chunks, out_dtype), (x, w)


def _matmul_reduce_scatter_bwd(chunks, out_dtype, residuals, d_out):
  x, w = residuals
  d_x, d_out_gathered = _ring_all_gather_matmul(d_out, w.T.astype(d_out.dtype), chunks, None)
  d_w = jnp.einsum("bsk,bsf->kf", x.astype(d_out.dtype), d_out_gathered).astype(w.dtype)
  return d_x.astype(x.dtype), _weight_cotangent(d_w, w)


matmul_reduce_scatter.defvjp(_matmul_reduce_scatter_fwd, _matmul_reduce_scatter_bwd)


def chunked_all_gather_matmul(x, w, chunks: int, out_dtype=None):
  """all_gather(x, seq over tp) @ w, one all-gather per sequence chunk (no ring)."""
  return chunked_all_gather_apply(x, lambda h: _matmul(h, w, out_dtype), chunks)


def chunked_all_gather_apply(x, fn, chunks: int):
  """fn(all_gather(x, seq over tp)) for a token-wise fn, one all-gather per sequence chunk (no
  ring), fn on each gathered chunk while the next one's gather is in flight."""
  b, s_local, k = x.shape
  size, n = _chunk(s_local, chunks), lax.axis_size(TP)
  outs = []
  for c in range(chunks):
    piece = lax.all_gather(x[:, c * size:(c + 1) * size], TP, axis=1)        # [b, n, size, k]
    outs.append(fn(piece.reshape(b, n * size, k)).reshape(b, n, size, -1))
  return jnp.stack(outs, axis=2).reshape(b, n * s_local, -1)               # rows (rank, chunk, i)


def chunked_matmul_reduce_scatter(x, w, chunks: int):
  """reduce_scatter(x @ w, seq over tp), one reduce-scatter per chunk of the sequence shard."""
  b, s, k = x.shape
  n = lax.axis_size(TP)
  size = _chunk(s // n, chunks)
  rows = x.reshape(b, n, chunks, size, k)
  outs = []
  for c in range(chunks):   # chunk c of every rank's shard: its sum lands on that rank
    part = _matmul(rows[:, :, c].reshape(b, n * size, k), w, None)
    outs.append(lax.psum_scatter(part, TP, scatter_dimension=1, tiled=True))   # [b, size, f]
  return jnp.concatenate(outs, axis=1)


@jax.named_scope("tp all-gather")
def column_parallel_linear(x, w, mode: str, chunks: int, out_dtype=None, ring: bool = True):
  """x [b, s/tp, k] (sequence shard) @ w [k, f/tp] -> [b, s, f/tp]; one all-gather on tp. The
  output is named PROJECTION_OUTPUT: what model.remat="dots" saves."""
  if mode == "collective_matmul" and lax.axis_size(TP) > 1:
    if ring:
      return checkpoint_name(all_gather_matmul(x, w, chunks, out_dtype), PROJECTION_OUTPUT)
    return checkpoint_name(chunked_all_gather_matmul(x, w, chunks, out_dtype), PROJECTION_OUTPUT)
  return checkpoint_name(_matmul(collectives.all_gather(x, TP, dim=1), w, out_dtype), PROJECTION_OUTPUT)


@jax.named_scope("tp all-gather")
def column_parallel_apply(x, fn, mode: str, chunks: int, ring: bool = True):
  """fn(all_gather(x)) for a token-wise fn of x [b, s/tp, k] (sequence shard): one all-gather
  on tp, overlapped with fn the way column_parallel_linear overlaps it with its matmul (the
  ring differentiated by autodiff: its backward sends the cotangents back around the ring,
  each hop behind a chunk's vjp). For what needs the gathered input before its matmuls: the
  two norms of the parallel_two_norms block."""
  if mode == "collective_matmul" and lax.axis_size(TP) > 1:
    if ring:
      return _ring_all_gather(x, fn, chunks)[0]
    return chunked_all_gather_apply(x, fn, chunks)
  return fn(collectives.all_gather(x, TP, dim=1))


@jax.named_scope("tp reduce-scatter")
def row_parallel_linear(x, w, mode: str, chunks: int, ring: bool = True):
  """x [b, s, k/tp] @ w [k/tp, f] -> [b, s/tp, f] summed over tp; one reduce-scatter on tp. The
  output is named PROJECTION_OUTPUT: what model.remat="dots" saves."""
  if mode == "collective_matmul" and lax.axis_size(TP) > 1:
    out = matmul_reduce_scatter(x, w, chunks, None) if ring else chunked_matmul_reduce_scatter(x, w, chunks)
  else:
    out = collectives.psum_scatter(_matmul(x, w, None), TP, scatter_dimension=1)
  return checkpoint_name(out, PROJECTION_OUTPUT)
