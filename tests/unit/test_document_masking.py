"""Packed documents: attention never crosses a document boundary, in every attention path.

The band geometry's document bounds against brute force; the kernels (forward, dq, dk, dv)
against XLA in the windows' edge cases; a query never sees another document's key in any
implementation; a packed row's loss and gradients are the sums over its documents run one
by one (every impl); the 3D step's abstract inputs carry the packed keys. (The 3D step and
the pipeline on packed batches: tests/integration/test_parallel_reference.py and
test_pipeline_reference.py.)
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from megajax.layers import attention as attention_module
from megajax.layers import cudnn_attention, xla_attention
from megajax.layers.kernels import attention_hopper as hopper
from megajax.layers.kernels import pallas_attention
from megajax.layers.kernels.band import (PADDING_SEGMENT, document_bounds, kv_block_ranges, padded_length,
                                         q_block_ranges, visited_blocks)
from megajax.model import GPT, ModelConfig, init_params
from megajax.parallel import ParallelStep, make_mesh
from megajax.reference_step import make_loss_sums_fn
from tests.support.kernels import TRITON_CALL, assert_close, check, export_for_cuda, inputs


def packed(lengths):
  """(segment_ids, positions) int32[len] of documents of these lengths, packed in one row."""
  segment_ids = np.repeat(np.arange(1, len(lengths) + 1), lengths).astype(np.int32)
  positions = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)
  return segment_ids, positions


# --- The band geometry.

def brute_force_blocks(segment_ids, window, block_q, block_k):
  """Per (query block, KV block): any visible pair, every pair visible."""
  s = len(segment_ids)
  i, j = np.arange(s)[:, None], np.arange(s)[None, :]
  visible = (j <= i) & ((j > i - window) if window is not None else True)
  visible &= segment_ids[:, None] == segment_ids[None, :]
  per_block = visible.reshape(s // block_q, block_q, s // block_k, block_k)
  return per_block.any(axis=(1, 3)), per_block.all(axis=(1, 3))


LAYOUTS = {
    "one_doc": [64],
    "edge_at_block": [16, 32, 16],           # boundaries exactly at block edges
    "one_token_docs": [1, 15, 1, 1, 30, 16],
    "spanning": [5, 50, 9],                   # a document over several blocks
    "many_short": [3] * 21 + [1],
}


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
@pytest.mark.parametrize("window,block_q,block_k", [(None, 16, 16), (4, 16, 16), (20, 8, 16), (40, 16, 8),
                                                    (200, 16, 16)])
def test_block_ranges_with_documents_are_exactly_the_visible_blocks(layout, window, block_q, block_k):
  """With documents the kernels' loop bounds are exact too: every block with a visible pair
  is visited and no other, and the unmasked blocks are exactly those where every pair is."""
  segment_ids, _ = packed(LAYOUTS[layout])
  s = len(segment_ids)
  start, end = (np.asarray(x[0]) for x in document_bounds(jnp.asarray(segment_ids)[None]))
  any_visible, all_visible = brute_force_blocks(segment_ids, window, block_q, block_k)
  for qb in range(s // block_q):
    doc_starts = (int(start[qb * block_q]), int(start[qb * block_q + block_q - 1]))
    lo, full_lo, full_hi, hi = kv_block_ranges(qb, block_q, block_k, window, s // block_k, doc_starts)
    assert set(range(lo, hi)) == set(np.flatnonzero(any_visible[qb]))
    assert set(range(full_lo, full_hi)) == set(np.flatnonzero(all_visible[qb]))
  for kb in range(s // block_k):
    doc_ends = (int(end[kb * block_k]), int(end[kb * block_k + block_k - 1]))
    lo, full_lo, full_hi, hi = q_block_ranges(kb, block_q, block_k, window, s // block_q, doc_ends)
    assert set(range(lo, hi)) == set(np.flatnonzero(any_visible[:, kb]))
    assert set(range(full_lo, full_hi)) == set(np.flatnonzero(all_visible[:, kb]))


def test_document_bounds():
  start, end = document_bounds(jnp.asarray([[1, 1, 1, 2, 3, 3], [4, 4, 4, 4, 4, 4]]))
  np.testing.assert_array_equal(start, [[0, 0, 0, 3, 4, 4], [0] * 6])
  np.testing.assert_array_equal(end, [[3, 3, 3, 4, 6, 6], [6] * 6])


def test_short_documents_skip_the_blocks_of_earlier_documents():
  """Causal attention over 32 documents of 256 tokens visits each document's own band only:
  linear in the sequence, like a window, instead of quadratic."""
  s, block = 8192, 64
  segment_ids, _ = packed([256] * (s // 256))
  whole = visited_blocks(s, None, block, block)
  documents = visited_blocks(s, None, block, block, segment_ids)
  assert documents == (s // 256) * visited_blocks(256, None, block, block)
  assert documents < whole / 20


def test_hopper_programs_stream_their_warpgroups_bands_with_documents():
  """A Hopper program streams from warpgroup 0's first visible block (raised by its first
  row's document start) to warpgroup 1's last: the union of both bands, nothing more."""
  segment_ids, _ = packed([70, 60, 1, 300, 81, 100])
  kv_blocks = len(segment_ids) // hopper.BLOCK
  start = [int(x) for x in document_bounds(jnp.asarray(segment_ids)[None])[0][0]]
  for window in (None, 100):
    for tile in range(kv_blocks // hopper.COMPUTE_WARPGROUPS):
      first, last = hopper.streamed_kv_blocks(tile, window, kv_blocks, start.__getitem__)
      bands = [kv_block_ranges(q_block, hopper.BLOCK, hopper.BLOCK, window, kv_blocks,
                               hopper.warpgroup_doc_starts(q_block, start.__getitem__))
               for q_block in (2 * tile, 2 * tile + 1)]
      assert first == min(b[0] for b in bands) and last == max(b[3] for b in bands)


# --- The kernels against XLA.

@pytest.mark.parametrize("lengths,window", [
    ([20, 12, 32], 5),           # window smaller than every document
    ([16, 16, 1, 15, 16], 40),   # window larger than the documents; edges at block edges; a one-token doc
    ([3, 45, 16], None),         # a document across several blocks, causal
    ([1] * 7 + [43], 9),         # padded to 64 (50 is no block multiple), one-token documents first
], ids=["w<doc", "w>doc_edges", "spanning_causal", "padded_one_token"])
def test_kernels_match_xla_with_documents(lengths, window):
  """Forward and all three gradients, grouped KV heads, block 16, two rows packed differently."""
  segment_ids = np.stack([packed(lengths)[0], packed(lengths[::-1])[0]])
  check(2, sum(lengths), 4, 2, 64, window, jnp.float32, segment_ids=jnp.asarray(segment_ids))


def test_the_triton_kernels_with_documents_lower_for_cuda():
  """Forward, dq and dk/dv with segment ids lower to Triton IR for CUDA on this CPU machine
  (what interpret mode cannot check: Triton's ops for the segment blocks and their bounds)."""
  q = jax.ShapeDtypeStruct((2, 200, 4, 64), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((2, 200, 2, 64), jnp.bfloat16)
  segment_ids = jax.ShapeDtypeStruct((2, 200), jnp.int32)

  def grads(q, k, v, segment_ids):
    attention = lambda q, k, v: pallas_attention(q, k, v, 48, segment_ids, interpret=False, backend="triton")
    return jax.grad(lambda *qkv: jnp.sum(attention(*qkv).astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)
  module = export_for_cuda(grads, q, k, k, segment_ids)
  assert module.count(TRITON_CALL) == 3                # forward, dq, dk/dv


IMPLS = {
    "xla": xla_attention,
    "pallas": functools.partial(pallas_attention, block_q=16, block_k=16),
    "cudnn": functools.partial(cudnn_attention, implementation="xla"),   # cuDNN's mask, on CPU
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("window", [None, 6])
def test_a_query_never_sees_another_documents_keys(impl, window):
  """Changing the keys and values of every other document leaves a document's outputs and
  its q gradients unchanged, bit for bit (the masked terms are exact zeros)."""
  lengths = [16, 1, 20, 13]
  segment_ids = jnp.asarray(packed(lengths)[0])[None]
  q, k, v, _ = inputs(1, sum(lengths), 2, 1, 64, jnp.float32)
  attention = lambda q, k, v: IMPLS[impl](q, k, v, window, segment_ids)
  loss = lambda q, k, v, doc: jnp.sum(jnp.where((segment_ids == doc)[..., None, None], attention(q, k, v), 0))
  for doc in (1, 2, 3):
    others = (segment_ids != doc)[..., None, None]
    k2, v2 = jnp.where(others, 100 * k + 3, k), jnp.where(others, -50 * v, v)
    mine = (segment_ids == doc)[0]
    np.testing.assert_array_equal(attention(q, k, v)[0, mine], attention(q, k2, v2)[0, mine])
    dq, dq2 = (jax.grad(loss)(q, kk, vv, doc) for kk, vv in ((k, v), (k2, v2)))
    np.testing.assert_array_equal(dq, dq2)
    assert_close(IMPLS[impl](q, k, v, window, segment_ids), xla_attention(q, k, v, window, segment_ids), 1e-5)


def test_without_segment_ids_nothing_changes():
  q, k, v, _ = inputs(1, 40, 2, 2, 64, jnp.float32)
  one_doc = jnp.ones((1, 40), jnp.int32)
  for attention in IMPLS.values():
    assert_close(attention(q, k, v, 7, one_doc), attention(q, k, v, 7), 1e-6)
  assert padded_length(40, 16, 16) == 48 and PADDING_SEGMENT > 40


# --- The model.

@pytest.mark.parametrize("impl,block", [("xla", "parallel"), ("xla", "serial"), ("pallas", "parallel"),
                                        ("cudnn", "serial")])
def test_packed_row_equals_its_documents_one_by_one(tiny_config, impl, block, monkeypatch):
  """Loss sums and every gradient of one packed row == the sums over its documents, each run
  alone as a row of its own length (rotary positions restarting at 0)."""
  if impl == "cudnn":   # cuDNN's mask path in jax.nn.dot_product_attention's XLA implementation
    monkeypatch.setitem(attention_module.ATTENTION_IMPLS, "cudnn",
                        functools.partial(cudnn_attention, implementation="xla"))
  tiny_config.model.window, tiny_config.model.window_pattern = 4, "LG"
  tiny_config.model.attention_impl, tiny_config.model.block = impl, block
  model = GPT(ModelConfig.from_config(tiny_config.model))
  params = init_params(model, jax.random.key(0))
  loss_sums = jax.jit(jax.value_and_grad(make_loss_sums_fn(model, z_loss=1e-3), has_aux=True))
  lengths = [5, 1, 7, 3]
  rng = np.random.default_rng(0)
  tokens, targets = (rng.integers(0, 64, (1, sum(lengths))).astype(np.int32) for _ in range(2))
  mask = (rng.random((1, sum(lengths))) > 0.2).astype(np.float32)
  segment_ids, positions = packed(lengths)
  (_, stats), grads = loss_sums(params, {"inputs": tokens, "targets": targets, "loss_mask": mask,
                                         "segment_ids": segment_ids[None], "positions": positions[None]})
  # The documents one by one: one row each, in one batch, cut to the longest document (the
  # row's tail after its document is causally invisible to it, and has loss mask 0).
  rows = [np.flatnonzero(segment_ids == doc) for doc in range(1, len(lengths) + 1)]
  one_by_one = lambda x: np.stack([np.pad(x[0, r], (0, max(lengths) - len(r))) for r in rows])
  (_, want_stats), want_grads = loss_sums(params, {"inputs": one_by_one(tokens), "targets": one_by_one(targets),
                                                   "loss_mask": one_by_one(mask)})
  for name in stats:
    np.testing.assert_allclose(stats[name], want_stats[name], rtol=1e-5)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_abstract_inputs_carry_the_packed_keys_when_the_data_is_packed(tiny_config):
  # The step reads the config once, when built (its sections are frozen): one step per config.
  step = lambda: ParallelStep.build(tiny_config, GPT(ModelConfig.from_config(tiny_config.model)),
                                    make_mesh(tiny_config.parallel, jax.devices()[:1]))
  assert set(step().abstract_inputs()[1]) == {"inputs", "targets", "loss_mask"}
  tiny_config.data.source, tiny_config.data.document_masking = "tokens", True
  _, batch = step().abstract_inputs()
  for key in ("positions", "segment_ids"):
    assert batch[key].shape == batch["inputs"].shape and batch[key].dtype == jnp.int32
    assert batch[key].sharding == batch["inputs"].sharding
  tiny_config.data.document_masking = False
  assert "segment_ids" not in step().abstract_inputs()[1]
