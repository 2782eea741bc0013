"""Sliding-window flash attention as Pallas kernels: forward, and backward (dq, dk, dv).

Token i attends to key j when i - window < j <= i (window=None: plain causal) and, with
packed documents (`segment_ids` [b, s], non-decreasing along a row), segment_ids[i] ==
segment_ids[j]: the same mask as `xla_attention`, which these kernels are tested against.
Layout [b, s, heads, d] like the model's; grouped KV heads (heads % kv_heads == 0) are
read in place.

  forward   grid (q blocks, b, heads): online softmax over the KV blocks the q block can
            see, fp32 statistics and accumulator; writes out and the logsumexp.
  dq        grid (q blocks, b, heads): the same KV blocks, recomputing the probabilities
            from the saved logsumexp.
  dk, dv    grid (kv blocks, b, kv_heads): the q blocks (of every head sharing the KV
            head) that can see the KV block.

Block skipping: each program loops only over the blocks that intersect its window band
(`band`), so the work is O(s * w), not O(s^2). The band is
split Splash-style into partial blocks (the window's left edge and the diagonal, masked)
and full blocks between them, which skip the mask. Sequences that are not a block
multiple are zero-padded: padded keys lie right of every real query's diagonal, and padded
queries get zero cotangents, so neither changes a real value.

Documents: the wrapper computes each token's document [start, end) (`band.document_bounds`,
a cumulative max / min). A program reads its own block of segment ids and of those bounds
(blocked like q, or like k in dk/dv) and the other side's whole row of segment ids: the
first and last row's document starts raise the q block's first KV block and shrink its
full range, the first and last key's document ends lower the KV block's last q block and
shrink its full range (`band.kv_block_ranges`, `band.q_block_ranges`); partial blocks also
compare segment ids. So short documents cost O(s * document length), like a window. Padded
positions are one more document (`band.PADDING_SEGMENT`), which no real token sees.

Back ends (`backend`): "triton", these kernels lowered through Triton (requested explicitly
with Triton compiler params); "mosaic", the Hopper forward (`attention_hopper`: TMA,
wgmma, warp specialization) with these backward kernels. None picks "mosaic" on H100/H200
for bf16/fp16, "triton" otherwise. `backward="mosaic"` opts into the Hopper backward
(`attention_hopper_backward`), not the default until a GPU measures it faster. On CPU all
run in interpret mode (the tests).
"""

from __future__ import annotations

import functools
import math

import jax
from jax import lax
from jax.experimental import pallas as pl
import jax.numpy as jnp

from megajax.layers.kernels import attention_hopper as hopper
from megajax.layers.kernels.band import (DEFAULT_BLOCK, PADDING_SEGMENT, band_loop, document_bounds, in_window,
                                         kv_block_ranges, padded_length, q_block_ranges)
from megajax.layers.kernels.attention_hopper import ForwardOptions, hopper_attention_forward
from megajax.layers.kernels.attention_hopper_backward import hopper_attention_backward
from megajax.layers.kernels.support import compiler_params, out_struct, use_interpret

# A large finite negative for masked scores: exp() of it vanishes without inf - inf = nan.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _visible(rows, cols, window, row_segments=None, col_segments=None):
  mask = in_window(rows[:, None], cols[None, :], window)
  if row_segments is not None:
    mask &= row_segments[:, None] == col_segments[None, :]
  return mask


def _dot(a, b, transpose_b=False):
  dims = (((1,), (1,)), ((), ())) if transpose_b else (((1,), (0,)), ((), ()))
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


# --- Forward.

def _forward_kernel(*refs, scale, window, block_q, block_k, kv_blocks, segmented):
  if segmented:
    q_ref, k_ref, v_ref, q_segment_ref, kv_segment_ref, doc_start_ref, out_ref, lse_ref = refs
  else:
    (q_ref, k_ref, v_ref, out_ref, lse_ref), q_segment_ref = refs, None
  q_block = pl.program_id(0)
  q = q_ref[...]                                                     # [block_q, d]
  rows = q_block * block_q + lax.broadcasted_iota(jnp.int32, (block_q,), 0)
  row_segments, doc_starts = None, None
  if segmented:                  # starts never decrease: the first and last row's are min, max
    row_segments, doc_start = q_segment_ref[...], doc_start_ref[...]
    doc_starts = (jnp.min(doc_start), jnp.max(doc_start))

  def step(kv_block, carry, masked):
    m, l, acc = carry
    start = pl.multiple_of(kv_block * block_k, block_k)
    k = k_ref[pl.ds(start, block_k), :]
    v = v_ref[pl.ds(start, block_k), :]
    s = _dot(q, k, transpose_b=True) * scale                         # [block_q, block_k] fp32
    if masked:
      cols = start + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
      col_segments = kv_segment_ref[pl.ds(start, block_k)] if segmented else None
      s = jnp.where(_visible(rows, cols, window, row_segments, col_segments), s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.exp(s - m_new[:, None])
    alpha = jnp.exp(m - m_new)
    return m_new, alpha * l + jnp.sum(p, axis=1), alpha[:, None] * acc + _dot(p.astype(v.dtype), v)

  d = q.shape[-1]
  carry = (jnp.full((block_q,), -jnp.inf, jnp.float32), jnp.zeros((block_q,), jnp.float32),
           jnp.zeros((block_q, d), jnp.float32))
  m, l, acc = band_loop(kv_block_ranges(q_block, block_q, block_k, window, kv_blocks, doc_starts), step, carry)
  out_ref[...] = (acc / l[:, None]).astype(out_ref.dtype)
  lse_ref[...] = m + jnp.log(l)


def _segment_specs(block: int, s: int):
  """BlockSpecs of three [b, s] int32 inputs: this program's block, the whole row, this block
  (its own segment ids, the other side's, its own document bounds)."""
  this_block = pl.BlockSpec((None, block), lambda i, n, h: (n, i))
  return [this_block, pl.BlockSpec((None, s), lambda i, n, h: (n, 0)), this_block]


def _forward(q, k, v, documents, window, block_q, block_k, interpret, backend, options=ForwardOptions()):
  """documents: None, or (segment_ids, doc_start, doc_end) int32 [b, s] each. options: the
  Hopper forward's (`attention_hopper.ForwardOptions`)."""
  if backend == "mosaic":
    doc_start = None if documents is None else documents[1]
    return hopper_attention_forward(q, k, v, window, doc_start, interpret=interpret, options=options)
  b, s, heads, d = q.shape
  kv_heads = k.shape[2]
  group = heads // kv_heads
  segmented = documents is not None
  kernel = functools.partial(_forward_kernel, scale=1.0 / math.sqrt(d), window=window, block_q=block_q,
                             block_k=block_k, kv_blocks=s // block_k, segmented=segmented)
  segment_inputs, segment_specs = (), []
  if segmented:          # the rows' segment ids and document starts, every key's segment id
    segment_ids, doc_start, _ = documents
    segment_inputs = (segment_ids, segment_ids, doc_start)
    segment_specs = _segment_specs(block_q, s)
  return pl.pallas_call(
      kernel,
      grid=(s // block_q, b, heads),
      in_specs=[pl.BlockSpec((None, block_q, None, d), lambda i, n, h: (n, i, h, 0)),
                pl.BlockSpec((None, s, None, d), lambda i, n, h: (n, 0, h // group, 0)),
                pl.BlockSpec((None, s, None, d), lambda i, n, h: (n, 0, h // group, 0)),
                *segment_specs],
      out_specs=[pl.BlockSpec((None, block_q, None, d), lambda i, n, h: (n, i, h, 0)),
                 pl.BlockSpec((None, None, block_q), lambda i, n, h: (n, h, i))],
      out_shape=[out_struct(q.shape, q.dtype, q), out_struct((b, heads, s), jnp.float32, q)],
      compiler_params=compiler_params(interpret, 4, 2),
      interpret=interpret,
      name="sliding_window_attention_forward",
  )(q, k, v, *segment_inputs)


# --- Backward.

def _dq_kernel(*refs, scale, window, block_q, block_k, kv_blocks, segmented):
  if segmented:
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, q_segment_ref, kv_segment_ref, doc_start_ref, dq_ref = refs
  else:
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref = refs
  q_block = pl.program_id(0)
  q, do = q_ref[...], do_ref[...]
  lse, delta = lse_ref[...], delta_ref[...]
  rows = q_block * block_q + lax.broadcasted_iota(jnp.int32, (block_q,), 0)
  row_segments, doc_starts = None, None
  if segmented:
    row_segments, doc_start = q_segment_ref[...], doc_start_ref[...]
    doc_starts = (jnp.min(doc_start), jnp.max(doc_start))

  def step(kv_block, dq, masked):
    start = pl.multiple_of(kv_block * block_k, block_k)
    k = k_ref[pl.ds(start, block_k), :]
    v = v_ref[pl.ds(start, block_k), :]
    p = jnp.exp(_dot(q, k, transpose_b=True) * scale - lse[:, None])
    if masked:
      cols = start + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
      col_segments = kv_segment_ref[pl.ds(start, block_k)] if segmented else None
      p = jnp.where(_visible(rows, cols, window, row_segments, col_segments), p, 0.0)
    ds = p * (_dot(do, v, transpose_b=True) - delta[:, None])
    return dq + _dot(ds.astype(k.dtype), k)

  dq = jnp.zeros(q.shape, jnp.float32)
  dq = band_loop(kv_block_ranges(q_block, block_q, block_k, window, kv_blocks, doc_starts), step, dq)
  dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkdv_kernel(*refs, scale, window, block_q, block_k, q_blocks, group, segmented):
  if segmented:
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, kv_segment_ref, q_segment_ref, doc_end_ref,
     dk_ref, dv_ref) = refs
  else:
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref = refs
  kv_block = pl.program_id(0)
  k, v = k_ref[...], v_ref[...]                                      # [block_k, d]
  cols = kv_block * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
  col_segments, doc_ends = None, None
  if segmented:                  # ends never decrease: the first and last key's are min, max
    col_segments, doc_end = kv_segment_ref[...], doc_end_ref[...]
    doc_ends = (jnp.min(doc_end), jnp.max(doc_end))
  bounds = q_block_ranges(kv_block, block_q, block_k, window, q_blocks, doc_ends)
  dk = jnp.zeros(k.shape, jnp.float32)
  dv = jnp.zeros(v.shape, jnp.float32)
  for head in range(group):                                          # the q heads sharing this KV head
    def step(q_block, carry, masked, head=head):
      dk, dv = carry
      start = pl.multiple_of(q_block * block_q, block_q)
      q = q_ref[pl.ds(start, block_q), head, :]
      do = do_ref[pl.ds(start, block_q), head, :]
      lse = lse_ref[head, pl.ds(start, block_q)]
      delta = delta_ref[head, pl.ds(start, block_q)]
      p = jnp.exp(_dot(q, k, transpose_b=True) * scale - lse[:, None])   # [block_q, block_k]
      if masked:
        rows = start + lax.broadcasted_iota(jnp.int32, (block_q,), 0)
        row_segments = q_segment_ref[pl.ds(start, block_q)] if segmented else None
        p = jnp.where(_visible(rows, cols, window, row_segments, col_segments), p, 0.0)
      dv = dv + _dot(p.T.astype(do.dtype), do)
      ds = p * (_dot(do, v, transpose_b=True) - delta[:, None])
      return dk + _dot(ds.T.astype(q.dtype), q), dv
    dk, dv = band_loop(bounds, step, (dk, dv))
  dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _backward(q, k, v, out, lse, d_out, documents, window, block_q, block_k, interpret, d_lse=None):
  """d_lse [b, heads, s]: a cotangent of the log-sum-exp too (pallas_attention_with_lse): since
  d lse_i / d s_ij = p_ij, it enters as delta_i - d_lse_i (the kernels unchanged)."""
  b, s, heads, d = q.shape
  segmented = documents is not None
  dq_segments, dkdv_segments = (), ()
  if segmented:
    segment_ids, doc_start, doc_end = documents
    dq_segments, dkdv_segments = (segment_ids, segment_ids, doc_start), (segment_ids, segment_ids, doc_end)
  kv_heads = k.shape[2]
  group = heads // kv_heads
  scale = 1.0 / math.sqrt(d)
  # delta_i = sum_d out_id * d_out_id: one fused elementwise pass, left to XLA.
  delta = jnp.einsum("bshd,bshd->bhs", out.astype(jnp.float32), d_out.astype(jnp.float32))
  if d_lse is not None:
    delta = delta - d_lse
  params = compiler_params(interpret, 4, 2)
  row_block = lambda i, n, h: (n, i, h, 0)
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, scale=scale, window=window, block_q=block_q, block_k=block_k,
                        kv_blocks=s // block_k, segmented=segmented),
      grid=(s // block_q, b, heads),
      in_specs=[pl.BlockSpec((None, block_q, None, d), row_block),
                pl.BlockSpec((None, s, None, d), lambda i, n, h: (n, 0, h // group, 0)),
                pl.BlockSpec((None, s, None, d), lambda i, n, h: (n, 0, h // group, 0)),
                pl.BlockSpec((None, block_q, None, d), row_block),
                pl.BlockSpec((None, None, block_q), lambda i, n, h: (n, h, i)),
                pl.BlockSpec((None, None, block_q), lambda i, n, h: (n, h, i)),
                *(_segment_specs(block_q, s) if segmented else [])],
      out_specs=pl.BlockSpec((None, block_q, None, d), row_block),
      out_shape=out_struct(q.shape, q.dtype, q),
      compiler_params=params, interpret=interpret, name="sliding_window_attention_dq",
  )(q, k, v, d_out, lse, delta, *dq_segments)
  kv_block = lambda j, n, g: (n, j, g, 0)
  dk, dv = pl.pallas_call(
      functools.partial(_dkdv_kernel, scale=scale, window=window, block_q=block_q, block_k=block_k,
                        q_blocks=s // block_q, group=group, segmented=segmented),
      grid=(s // block_k, b, kv_heads),
      in_specs=[pl.BlockSpec((None, s, group, d), lambda j, n, g: (n, 0, g, 0)),
                pl.BlockSpec((None, block_k, None, d), kv_block),
                pl.BlockSpec((None, block_k, None, d), kv_block),
                pl.BlockSpec((None, s, group, d), lambda j, n, g: (n, 0, g, 0)),
                pl.BlockSpec((None, group, s), lambda j, n, g: (n, g, 0)),
                pl.BlockSpec((None, group, s), lambda j, n, g: (n, g, 0)),
                *(_segment_specs(block_k, s) if segmented else [])],
      out_specs=[pl.BlockSpec((None, block_k, None, d), kv_block),
                 pl.BlockSpec((None, block_k, None, d), kv_block)],
      out_shape=[out_struct(k.shape, k.dtype, k), out_struct(v.shape, v.dtype, v)],
      compiler_params=params, interpret=interpret, name="sliding_window_attention_dkdv",
  )(q, k, v, d_out, lse, delta, *dkdv_segments)
  return dq, dk, dv


# --- The op.

@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9, 10))
def _attention(q, k, v, documents, window, block_q, block_k, interpret, backend, backward, options):
  return _forward(q, k, v, documents, window, block_q, block_k, interpret, backend, options)[0]


def _attention_fwd(q, k, v, documents, window, block_q, block_k, interpret, backend, backward, options):
  out, lse = _forward(q, k, v, documents, window, block_q, block_k, interpret, backend, options)
  return out, (q, k, v, documents, out, lse)


def _attention_bwd(window, block_q, block_k, interpret, backend, backward, options, residuals, d_out):
  q, k, v, documents, out, lse = residuals
  if backward == "mosaic":
    dq, dk, dv = hopper_attention_backward(q, k, v, out, lse, d_out, window, interpret=interpret)
  else:
    dq, dk, dv = _backward(q, k, v, out, lse, d_out, documents, window, block_q, block_k, interpret)
  return dq, dk, dv, None                       # None: the integer documents have no cotangent


_attention.defvjp(_attention_fwd, _attention_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _attention_with_lse(q, k, v, documents, window, block_q, block_k, interpret, backend):
  return tuple(_forward(q, k, v, documents, window, block_q, block_k, interpret, backend))


def _attention_with_lse_fwd(q, k, v, documents, window, block_q, block_k, interpret, backend):
  out, lse = _forward(q, k, v, documents, window, block_q, block_k, interpret, backend)
  return (out, lse), (q, k, v, documents, out, lse)


def _attention_with_lse_bwd(window, block_q, block_k, interpret, backend, residuals, cotangents):
  q, k, v, documents, out, lse = residuals
  d_out, d_lse = cotangents
  return (*_backward(q, k, v, out, lse, d_out, documents, window, block_q, block_k, interpret, d_lse=d_lse), None)


_attention_with_lse.defvjp(_attention_with_lse_fwd, _attention_with_lse_bwd)


BACKENDS = ("triton", "mosaic")


def default_backend(dtype, head_dim: int) -> str:
  """"mosaic" (the Hopper forward) where it runs and applies, else the portable "triton"."""
  return "mosaic" if hopper.is_hopper(jax.devices()[0]) and hopper.supports(dtype, head_dim) else "triton"


def pallas_attention(q: jax.Array, k: jax.Array, v: jax.Array, window: int | None,
                     segment_ids: jax.Array | None = None, block_q: int = DEFAULT_BLOCK,
                     block_k: int = DEFAULT_BLOCK, interpret: bool | None = None,
                     backend: str | None = None, backward: str = "triton",
                     hopper_forward: ForwardOptions = ForwardOptions()) -> jax.Array:
  """Sliding-window causal attention. q: [b, s, h, d]; k, v: [b, s, kv_h, d] -> [b, s, h, d].

  segment_ids: int32[b, s], non-decreasing along each row (packed documents): a query sees
  only keys of its own segment. None: one document per row.
  interpret=None runs the kernels in interpret mode on CPU and lowers them on GPU.
  backend: "triton" | "mosaic" | None (by device kind and dtype, `default_backend`).
  backward: "triton" (the portable kernels; the default until a GPU measures the other
  faster) | "mosaic" (the Hopper backward, `attention_hopper_backward`: bf16/fp16, head dim
  64/128/256; packed documents keep the portable backward).
  hopper_forward: the Hopper forward's opt-in speed-ups (`attention_hopper.ForwardOptions`).
  """
  b, s, heads, d = q.shape
  if heads % k.shape[2]:
    raise ValueError(f"{heads} query heads do not share {k.shape[2]} KV heads evenly")
  backend = default_backend(q.dtype, d) if backend is None else backend
  if backend not in BACKENDS:
    raise ValueError(f"backend={backend!r}: use one of {BACKENDS} or None")
  if backend == "mosaic" and not hopper.supports(q.dtype, d):
    raise ValueError(f"backend='mosaic' takes bf16/fp16 and head dim 64/128/256, got {q.dtype}, {d}: "
                     "use backend='triton'")
  if backward not in BACKENDS:
    raise ValueError(f"backward={backward!r}: use one of {BACKENDS}")
  if backward == "mosaic" and not hopper.supports(q.dtype, d):
    raise ValueError(f"backward='mosaic' takes bf16/fp16 and head dim 64/128/256, got {q.dtype}, {d}: "
                     "use backward='triton'")
  if segment_ids is not None:
    backward = "triton"                      # the Hopper backward takes no documents
  q, k, v, documents, block_q, block_k = _padded(q, k, v, segment_ids, block_q, block_k, backend, backward)
  out = _attention(q, k, v, documents, window, block_q, block_k, use_interpret(interpret), backend, backward,
                   hopper_forward)
  return out[:, :s]


def _padded(q, k, v, segment_ids, block_q: int, block_k: int, backend: str, backward: str):
  """(q, k, v, documents, block_q, block_k) with the sequence padded to whole blocks (whole
  Hopper programs where those run) and the documents' bounds; the padded positions are one
  document no real token is in."""
  s = q.shape[1]
  block_q, block_k = min(block_q, padded_length(s, 8, 8)), min(block_k, padded_length(s, 8, 8))
  padded = padded_length(s, block_q, block_k)
  if backend == "mosaic":                    # whole 128-row programs, and whole backward blocks
    padded = padded_length(s, block_q, block_k, hopper.ROWS_PER_PROGRAM)
  elif backward == "mosaic":                 # whole 64-row blocks
    padded = padded_length(s, block_q, block_k, hopper.BLOCK)
  if padded != s:
    pad = [(0, 0), (0, padded - s), (0, 0), (0, 0)]
    q, k, v = (jnp.pad(x, pad) for x in (q, k, v))
  documents = None
  if segment_ids is not None:
    segment_ids = jnp.pad(segment_ids.astype(jnp.int32), [(0, 0), (0, padded - s)],
                          constant_values=PADDING_SEGMENT)
    documents = (segment_ids, *document_bounds(segment_ids))
  return q, k, v, documents, block_q, block_k


def pallas_attention_with_lse(q: jax.Array, k: jax.Array, v: jax.Array, window: int | None,
                              segment_ids: jax.Array | None = None, block_q: int = DEFAULT_BLOCK,
                              block_k: int = DEFAULT_BLOCK, interpret: bool | None = None,
                              backend: str | None = None) -> tuple[jax.Array, jax.Array]:
  """pallas_attention, also returning each query's log-sum-exp of its visible scaled scores
  (fp32 [b, h, s]), differentiable in both: a partial attention that another over other keys
  merges with (megajax.parallel.context_parallel). The portable backward (d_lse enters its delta)."""
  s, d = q.shape[1], q.shape[-1]
  backend = default_backend(q.dtype, d) if backend is None else backend
  q, k, v, documents, block_q, block_k = _padded(q, k, v, segment_ids, block_q, block_k, backend, "triton")
  out, lse = _attention_with_lse(q, k, v, documents, window, block_q, block_k, use_interpret(interpret), backend)
  return out[:, :s], lse[:, :, :s]
