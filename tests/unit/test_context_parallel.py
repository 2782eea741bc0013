"""Context parallelism's attention (megajax.parallel.context_parallel): a sliding-window layer
over contiguous shards with one halo ppermute, a global layer by ring attention over the
dual-chunk layout; both equal to the single-device attention (value and gradients), the halo's
bytes independent of the sequence length."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from megajax.layers.attention import xla_attention
from megajax.layers.kernels import pallas_attention_with_lse
from megajax.observe.hlo import collective_counts
from megajax.parallel.context_parallel import (CP, dual_chunk_halo_attention, dual_chunk_order, halo_attention,
                                               ring_attention)

SHARDED = P(None, CP)     # [b, s, ...]: the positions split over cp


def _mesh(cp: int) -> Mesh:
  return Mesh(np.array(jax.devices()[:cp]), (CP,))


def _inputs(b=2, s=64, heads=4, kv_heads=2, d=8, documents=False):
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (b, s, heads, d))
  k, v = (jax.random.normal(key, (b, s, kv_heads, d)) for key in keys[1:3])
  cotangent = jax.random.normal(keys[3], q.shape)
  segments = jnp.ones((b, s), jnp.int32)
  if documents:       # 4 documents a row, boundaries anywhere (across shards too)
    cuts = np.sort(np.random.default_rng(0).choice(np.arange(1, s), size=(b, 3), replace=False), axis=1)
    segments = jnp.asarray(np.stack([np.searchsorted(c, np.arange(s), side="right") + 1 for c in cuts]), jnp.int32)
  return q, k, v, segments, cotangent


def _assert_same(loss_ours, loss_reference, q, k, v):
  (ours, ours_grads) = jax.jit(jax.value_and_grad(loss_ours, argnums=(0, 1, 2)))(q, k, v)
  (want, want_grads) = jax.jit(jax.value_and_grad(loss_reference, argnums=(0, 1, 2)))(q, k, v)
  np.testing.assert_allclose(ours, want, rtol=1e-5)
  for got, expected in zip(ours_grads, want_grads):
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


# (cp, window, packed documents): 17 at cp=4 and 33 at cp=2 reach the whole previous shard; 1 sends nothing.
HALO_CASES = [(2, 5, False), (2, 33, True), (4, 1, True), (4, 5, True), (4, 17, False)]


@pytest.mark.parametrize("cp,window,documents", HALO_CASES, ids=[f"cp{c}-w{w}{'-packed' * d}" for c, w, d in HALO_CASES])
def test_halo_attention_equals_the_single_device_sliding_window(cp, window, documents):
  q, k, v, segments, cotangent = _inputs(documents=documents)
  sharded = jax.shard_map(lambda q, k, v, s: halo_attention(q, k, v, window, segment_ids=s), mesh=_mesh(cp),
                          in_specs=(SHARDED,) * 4, out_specs=SHARDED)
  _assert_same(lambda q, k, v: jnp.sum(sharded(q, k, v, segments) * cotangent),
               lambda q, k, v: jnp.sum(xla_attention(q, k, v, window, segments) * cotangent), q, k, v)


@pytest.mark.parametrize("cp,documents", [(2, True), (4, False), (4, True)], ids=["cp2-packed", "cp4", "cp4-packed"])
def test_ring_attention_equals_the_single_device_causal_attention(cp, documents):
  q, k, v, segments, cotangent = _inputs(documents=documents)
  order = dual_chunk_order(q.shape[1], cp)
  back = np.argsort(order)
  sharded = jax.shard_map(lambda q, k, v, s: ring_attention(q, k, v, segment_ids=s), mesh=_mesh(cp),
                          in_specs=(SHARDED,) * 4, out_specs=SHARDED)
  _assert_same(lambda q, k, v: jnp.sum(sharded(q[:, order], k[:, order], v[:, order], segments[:, order])[:, back]
                                       * cotangent),
               lambda q, k, v: jnp.sum(xla_attention(q, k, v, None, segments) * cotangent), q, k, v)


# (cp, window, packed): 9 at cp=4 and 17 at cp=2 reach a whole chunk (8 and 16 positions) back.
DUAL_CASES = [(2, 5, True), (2, 17, False), (4, 9, True), (4, 1, False)]


@pytest.mark.parametrize("cp,window,documents", DUAL_CASES, ids=[f"cp{c}-w{w}{'-packed' * d}" for c, w, d in DUAL_CASES])
def test_halo_attention_in_the_dual_chunk_layout_equals_the_single_device_one(cp, window, documents):
  """The ring's layout for local layers too (one layout for an LG model): chunk r's halo from
  rank r-1, chunk 2cp-1-r's from rank r+1 (rank cp-1's from its own first chunk)."""
  q, k, v, segments, cotangent = _inputs(documents=documents)
  order = dual_chunk_order(q.shape[1], cp)
  back = np.argsort(order)
  sharded = jax.shard_map(lambda q, k, v, s: dual_chunk_halo_attention(q, k, v, window, segment_ids=s),
                          mesh=_mesh(cp), in_specs=(SHARDED,) * 4, out_specs=SHARDED)
  _assert_same(lambda q, k, v: jnp.sum(sharded(q[:, order], k[:, order], v[:, order], segments[:, order])[:, back]
                                       * cotangent),
               lambda q, k, v: jnp.sum(xla_attention(q, k, v, window, segments) * cotangent), q, k, v)


def test_dual_chunk_order_gives_rank_r_chunks_r_and_its_mirror():
  np.testing.assert_array_equal(dual_chunk_order(8, 2).reshape(2, 4), [[0, 1, 6, 7], [2, 3, 4, 5]])
  with pytest.raises(ValueError, match="2 \\* cp = 8"):
    dual_chunk_order(12, 4)


def test_a_window_beyond_the_previous_rank_is_refused():
  q, k, v, _, _ = _inputs(s=16)
  sharded = jax.shard_map(lambda q, k, v: halo_attention(q, k, v, 6), mesh=_mesh(4), in_specs=(SHARDED,) * 3,
                          out_specs=SHARDED)
  with pytest.raises(ValueError, match="beyond the previous rank's 4"):
    sharded(q, k, v)


def _permute_bytes(fn, shapes, cp: int) -> int:
  """Collective-permute bytes per device of fn's value and gradients, compiled; no all-gather allowed."""
  mesh = _mesh(cp)
  sharded = jax.shard_map(fn, mesh=mesh, in_specs=(SHARDED,) * 3, out_specs=SHARDED)
  loss = lambda q, k, v: jnp.sum(sharded(q, k, v))
  text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(
      *(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes)).compile().as_text()
  counts = collective_counts(text, mesh, nbytes=True)
  assert not [key for key in counts if key[0] == "all-gather"], counts
  return sum(n for key, n in counts.items() if key[0] == "collective-permute")


def test_a_local_layers_halo_bytes_do_not_grow_with_the_sequence():
  """O(w), from the compiled program: at s = 2,048 and 8,192 (cp = 4) the same permute bytes,
  the halo's keys and values forward and their gradients back."""
  b, kv_heads, d, window, cp = 1, 1, 8, 65, 4
  sizes = {}
  for s in (2048, 8192):
    shapes = ((b, s, 2, d), (b, s, kv_heads, d), (b, s, kv_heads, d))
    sizes[s] = _permute_bytes(lambda q, k, v: halo_attention(q, k, v, window), shapes, cp)
  halo = (window - 1) * b * kv_heads * d * 4           # one of k, v: fp32
  assert sizes[2048] == sizes[8192] == 2 * 2 * halo, sizes
  dual = {s: _permute_bytes(lambda q, k, v: dual_chunk_halo_attention(q, k, v, window),
                            ((b, s, 2, d), (b, s, kv_heads, d), (b, s, kv_heads, d)), cp) for s in (2048, 8192)}
  assert dual[2048] == dual[8192] == 2 * 2 * 2 * halo, dual     # two halos (forward and backward neighbours)


def test_ring_bytes_are_the_other_ranks_keys_and_values():
  """A global layer's ring moves (cp-1)/cp of the row's K/V per device forward (and as much of
  their gradients back)."""
  b, s, kv_heads, d, cp = 1, 256, 1, 8, 4
  shapes = ((b, s, 2, d), (b, s, kv_heads, d), (b, s, kv_heads, d))
  row_kv = 2 * b * s * kv_heads * d * 4
  assert _permute_bytes(lambda q, k, v: ring_attention(q, k, v), shapes, cp) == 2 * (cp - 1) * row_kv // cp


@pytest.mark.parametrize("documents", [False, True], ids=["one_document", "packed"])
def test_the_pallas_kernels_log_sum_exp_and_its_gradient(documents):
  """pallas_attention_with_lse (interpret mode): the output and each query's log-sum-exp of its
  visible scaled scores equal the dense reference's, and so do the gradients with a cotangent
  on both (d_lse enters the backward's delta)."""
  q, k, v, segments, cotangent = _inputs(s=32, documents=documents)
  window, lse_cotangent = 6, jax.random.normal(jax.random.key(7), (q.shape[0], q.shape[2], q.shape[1]))

  def reference(q, k, v):
    b, s, h, d = q.shape
    kv = k.shape[2]
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q.reshape(b, s, kv, h // kv, d), k) / np.sqrt(d)
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    mask = ((j <= i) & (j > i - window))[None] & (segments[:, :, None] == segments[:, None, :])
    lse = jax.nn.logsumexp(jnp.where(mask[:, None, None], scores, -jnp.inf), axis=-1).reshape(b, h, s)
    return xla_attention(q, k, v, window, segments), lse

  ours = lambda q, k, v: pallas_attention_with_lse(q, k, v, window, segments, block_q=8, block_k=8)
  loss = lambda fn: lambda q, k, v: (lambda out, lse: jnp.sum(out * cotangent) + jnp.sum(lse * lse_cotangent))(
      *fn(q, k, v))
  for got, want in zip(ours(q, k, v), reference(q, k, v)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  _assert_same(loss(ours), loss(reference), q, k, v)


@pytest.mark.parametrize("cp,window", [(2, 9), (4, 17)])
def test_halo_attention_over_the_pallas_kernel_equals_the_reference(cp, window):
  """impl="pallas": the own keys and the edge (the halo, then the shard's first window-1 keys)
  by the sliding-window kernel (its block-skip kept; interpret mode here, so shard_map without
  its varying-axes check, which jax 0.10 cannot give the interpreted kernel): the
  single-device attention's values and gradients."""
  q, k, v, segments, cotangent = _inputs(documents=True)
  sharded = jax.shard_map(lambda q, k, v, s: halo_attention(q, k, v, window, segment_ids=s, impl="pallas"),
                          mesh=_mesh(cp), in_specs=(SHARDED,) * 4, out_specs=SHARDED, check_vma=False)
  _assert_same(lambda q, k, v: jnp.sum(sharded(q, k, v, segments) * cotangent),
               lambda q, k, v: jnp.sum(xla_attention(q, k, v, window, segments) * cotangent), q, k, v)
