"""Sliding-window flash attention backward for Hopper (H100/H200): Mosaic GPU Pallas kernels
for dq and for dk/dv, with the forward's band skipping (opt-in: `pallas_attention(...,
backward="mosaic")` until a GPU measures it faster than the portable Triton backward).

Both read the forward's logsumexp (natural log, as the portable kernels) and
delta_i = sum_d out_id * dout_id (one XLA pass), and recompute the probabilities block by
block in base 2:

  dq kernel    one warpgroup per 64 query rows; streams the KV blocks of its band
               (`kv_block_ranges`): S = Q K^T, P = exp2(S - lse), dP = dO V^T,
               dS = P (dP - delta), dq += dS K, accumulated in place in one wgmma accumulator
  dk/dv kernel one warpgroup per 64 keys of one KV head; streams the query blocks that see
               them (`q_block_ranges`) for each query head of its group: S^T = K Q^T,
               P^T = exp2(S^T - lse), dv += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - delta),
               dk += dS^T Q, dk and dv accumulated in place

The streamed tiles come by TMA into a shared-memory ring (`ring_slots`: two deep, one at
head dim 256 for shared memory): the next block's copy is issued as soon as the block it
replaces is done. Every wgmma operand is a plain [M, K] x
[K, N] tile in shared memory (XLA supplies K^T, V^T, Q^T and dO^T), the form Pallas's GPU
interpreter runs on CPU, which is how the tests check these kernels without a GPU. Packed
documents are not taken here: `pallas_attention` keeps the portable backward for them.
"""

from __future__ import annotations

import math

from jax import lax
from jax.experimental import pallas as pl
import jax.numpy as jnp

from megajax.layers.kernels.attention_hopper import (BLOCK, LOG2_E, interpret_params, mosaic_gpu, supports, swizzled,
                                                     tile_positions)
from megajax.layers.kernels.band import band_loop, in_window, kv_block_ranges, q_block_ranges
from megajax.layers.kernels.support import out_struct


def ring_slots(head_dim: int) -> int:
  """Ring depth: two slots where they fit in shared memory (227 KB), one at head dim 256."""
  return 2 if head_dim <= 128 else 1


def _vector_loader(plgpu, interpret: bool):
  """ref, index, layout -> a [64] fp32 vector in `layout` (the interpreter: plain indexing)."""
  if interpret:
    return lambda ref, index, layout: ref[index]
  return lambda ref, index, layout: plgpu.load(ref, index, layout=layout, optimized=False)


def _matmul(plgpu, a_smem, b_smem, shape):
  """a @ b from shared memory into a fresh fp32 accumulator, read into registers."""
  def run(acc_ref):
    plgpu.wgmma(acc_ref, a_smem, b_smem)
    return acc_ref[...]
  return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def _ring(plgpu, copies, lo, hi, slots):
  """A `slots`-deep TMA ring over blocks [lo, hi): (prefetch(), wait(block) -> slot,
  refill(block): issue block + slots into the slot `block` used, once its readers are done).
  copies(block, slot): the block's copies, each to its own barrier."""
  def slot_of(block):
    return lax.rem(block - lo, slots)

  def prefetch():
    for slot in range(slots):
      @pl.when(lo + slot < hi)
      def _load(slot=slot):
        copies(lo + slot, slot)

  def refill(block):
    plgpu.wgmma_wait(0)                      # the tensor cores are done reading the slot

    @pl.when(block + slots < hi)
    def _load():
      copies(block + slots, slot_of(block))

  return prefetch, slot_of, refill


def hopper_attention_dq(q, k, v, lse, delta, d_out, window: int | None, slots: int | None = None,
                        interpret: bool = False, detect_races: bool = False):
  """dq [b, s, h, d] of sliding-window attention. q, d_out [b, s, h, d]; k, v [b, s, kv_h, d];
  lse, delta fp32 [b, h, s] (natural-log logsumexp of the forward; rowsum(out * d_out))."""
  plgpu = mosaic_gpu()
  b, s, heads, d = q.shape
  slots = slots or ring_slots(d)
  group = heads // k.shape[2]
  dtype = q.dtype
  kv_blocks = s // BLOCK
  score_scale = LOG2_E / math.sqrt(d)
  in_layout = (lambda x, layout: x) if interpret else plgpu.layout_cast
  wgmma_layout, row_layout = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1)
  load_vector = _vector_loader(plgpu, interpret)

  def body(q_ref, do_ref, k_t_ref, v_t_ref, k_ref, lse_ref, delta_ref, dq_ref, q_smem, do_smem, ds_smem,
           k_t_smem, v_t_smem, k_smem, rows_loaded, k_t_loaded, v_t_loaded, k_loaded):
    head, q_block, batch = lax.axis_index("heads"), lax.axis_index("q_block"), lax.axis_index("batch")
    kv_head = lax.div(head, jnp.array(group, jnp.int32))
    row_start = q_block * BLOCK
    rows = (batch, pl.ds(row_start, BLOCK), head)
    plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem, rows_loaded.at[0])
    plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem, rows_loaded.at[1])
    vectors = (batch, head, pl.ds(row_start, BLOCK))
    lse2 = load_vector(lse_ref, vectors, row_layout) * LOG2_E
    delta_rows = load_vector(delta_ref, vectors, row_layout)
    bounds = kv_block_ranges(q_block, BLOCK, BLOCK, window, kv_blocks)

    def copies(kv_block, slot):
      keys = pl.ds(kv_block * BLOCK, BLOCK)
      plgpu.copy_gmem_to_smem(k_t_ref.at[batch, kv_head, :, keys], k_t_smem.at[slot], k_t_loaded.at[slot])
      plgpu.copy_gmem_to_smem(v_t_ref.at[batch, kv_head, :, keys], v_t_smem.at[slot], v_t_loaded.at[slot])
      plgpu.copy_gmem_to_smem(k_ref.at[batch, keys, kv_head], k_smem.at[slot], k_loaded.at[slot])

    prefetch, slot_of, refill = _ring(plgpu, copies, bounds[0], bounds[3], slots)
    prefetch()
    plgpu.barrier_wait(rows_loaded.at[0])
    plgpu.barrier_wait(rows_loaded.at[1])

    def accumulate(dq_acc):
      def step(kv_block, carry, masked):
        slot = slot_of(kv_block)
        plgpu.barrier_wait(k_t_loaded.at[slot])
        scores = _matmul(plgpu, q_smem, k_t_smem.at[slot], (BLOCK, BLOCK)) * score_scale
        p = jnp.exp2(scores - lax.broadcast_in_dim(lse2, (BLOCK, BLOCK), [0]))
        if masked:
          row_ids, col_ids = tile_positions(row_start, kv_block * BLOCK, in_layout, wgmma_layout)
          p = jnp.where(in_window(row_ids, col_ids, window), p, 0.0)
        plgpu.barrier_wait(v_t_loaded.at[slot])
        d_probs = _matmul(plgpu, do_smem, v_t_smem.at[slot], (BLOCK, BLOCK))
        ds_smem[...] = (p * (d_probs - lax.broadcast_in_dim(delta_rows, (BLOCK, BLOCK), [0]))).astype(dtype)
        plgpu.commit_smem()                                           # dS visible to the tensor cores
        plgpu.barrier_wait(k_loaded.at[slot])
        plgpu.wgmma(dq_acc, ds_smem, k_smem.at[slot])                 # dq += dS K, in place
        refill(kv_block)                                              # also: dS is free again
        return carry

      band_loop(bounds, step)
      return dq_acc[...]

    dq = pl.run_scoped(accumulate, plgpu.ACC((BLOCK, d), jnp.float32))
    q_smem[...] = (dq * (1.0 / math.sqrt(d))).astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[rows])
    plgpu.wait_smem_to_gmem(0)

  tiles = swizzled(plgpu)
  scratch = (plgpu.SMEM((BLOCK, d), dtype, transforms=tiles),            # Q, then dq
             plgpu.SMEM((BLOCK, d), dtype, transforms=tiles),            # dO
             plgpu.SMEM((BLOCK, BLOCK), dtype, transforms=tiles),        # dS
             plgpu.SMEM((slots, d, BLOCK), dtype, transforms=tiles),     # K^T ring
             plgpu.SMEM((slots, d, BLOCK), dtype, transforms=tiles),     # V^T ring
             plgpu.SMEM((slots, BLOCK, d), dtype, transforms=tiles),     # K ring
             plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=slots),
             plgpu.Barrier(num_barriers=slots), plgpu.Barrier(num_barriers=slots))
  k_t, v_t = jnp.transpose(k, (0, 2, 3, 1)), jnp.transpose(v, (0, 2, 3, 1))     # [b, kv_h, d, s]
  return plgpu.kernel(
      body, out_type=out_struct(q.shape, dtype, q), scratch_types=scratch,
      grid=(heads, s // BLOCK, b), grid_names=("heads", "q_block", "batch"),
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret_params(interpret, detect_races),
  )(q, d_out, k_t, v_t, k, lse, delta)


def hopper_attention_dkdv(q, k, v, lse, delta, d_out, window: int | None, slots: int | None = None,
                          interpret: bool = False, detect_races: bool = False):
  """(dk, dv) [b, s, kv_h, d], shapes as hopper_attention_dq."""
  plgpu = mosaic_gpu()
  b, s, heads, d = q.shape
  slots = slots or ring_slots(d)
  kv_heads = k.shape[2]
  group = heads // kv_heads
  dtype = q.dtype
  q_blocks = s // BLOCK
  score_scale = LOG2_E / math.sqrt(d)
  in_layout = (lambda x, layout: x) if interpret else plgpu.layout_cast
  wgmma_layout, col_layout = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(0)
  load_vector = _vector_loader(plgpu, interpret)

  def body(q_t_ref, q_ref, do_t_ref, do_ref, k_ref, v_ref, lse_ref, delta_ref, dk_ref, dv_ref, k_smem, v_smem,
           p_smem, ds_smem, q_t_smem, q_smem, do_t_smem, do_smem, keys_loaded, q_t_loaded, q_loaded, do_t_loaded,
           do_loaded):
    kv_head, kv_block, batch = lax.axis_index("kv_heads"), lax.axis_index("kv_block"), lax.axis_index("batch")
    key_start = kv_block * BLOCK
    keys = (batch, pl.ds(key_start, BLOCK), kv_head)
    plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem, keys_loaded.at[0])
    plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem, keys_loaded.at[1])
    bounds = q_block_ranges(kv_block, BLOCK, BLOCK, window, q_blocks)
    plgpu.barrier_wait(keys_loaded.at[0])
    plgpu.barrier_wait(keys_loaded.at[1])

    def accumulate(dk_acc, dv_acc):
      for member in range(group):                       # the query heads sharing this KV head
        head = kv_head * group + member

        def copies(q_block, slot, head=head):
          rows = pl.ds(q_block * BLOCK, BLOCK)
          plgpu.copy_gmem_to_smem(q_t_ref.at[batch, head, :, rows], q_t_smem.at[slot], q_t_loaded.at[slot])
          plgpu.copy_gmem_to_smem(q_ref.at[batch, rows, head], q_smem.at[slot], q_loaded.at[slot])
          plgpu.copy_gmem_to_smem(do_t_ref.at[batch, head, :, rows], do_t_smem.at[slot], do_t_loaded.at[slot])
          plgpu.copy_gmem_to_smem(do_ref.at[batch, rows, head], do_smem.at[slot], do_loaded.at[slot])

        prefetch, slot_of, refill = _ring(plgpu, copies, bounds[0], bounds[3], slots)
        prefetch()

        def step(q_block, carry, masked, head=head):
          slot = slot_of(q_block)
          row_start = q_block * BLOCK
          vectors = (batch, head, pl.ds(row_start, BLOCK))
          lse2 = load_vector(lse_ref, vectors, col_layout) * LOG2_E
          delta_cols = load_vector(delta_ref, vectors, col_layout)
          plgpu.barrier_wait(q_t_loaded.at[slot])
          scores_t = _matmul(plgpu, k_smem, q_t_smem.at[slot], (BLOCK, BLOCK)) * score_scale   # [keys, rows]
          p_t = jnp.exp2(scores_t - lax.broadcast_in_dim(lse2, (BLOCK, BLOCK), [1]))
          if masked:
            key_ids, row_ids = tile_positions(key_start, row_start, in_layout, wgmma_layout)   # P^T's axes
            p_t = jnp.where(in_window(row_ids, key_ids, window), p_t, 0.0)
          p_smem[...] = p_t.astype(dtype)
          plgpu.commit_smem()
          plgpu.barrier_wait(do_loaded.at[slot])
          plgpu.wgmma(dv_acc, p_smem, do_smem.at[slot])              # dv += P^T dO, in place
          plgpu.barrier_wait(do_t_loaded.at[slot])
          d_probs_t = _matmul(plgpu, v_smem, do_t_smem.at[slot], (BLOCK, BLOCK))
          ds_smem[...] = (p_t * (d_probs_t - lax.broadcast_in_dim(delta_cols, (BLOCK, BLOCK), [1]))).astype(dtype)
          plgpu.commit_smem()
          plgpu.barrier_wait(q_loaded.at[slot])
          plgpu.wgmma(dk_acc, ds_smem, q_smem.at[slot])              # dk += dS^T Q, in place
          refill(q_block)                                             # also: P^T and dS^T are free again
          return carry

        band_loop(bounds, step)
      return dk_acc[...], dv_acc[...]

    dk, dv = pl.run_scoped(accumulate, plgpu.ACC((BLOCK, d), jnp.float32), plgpu.ACC((BLOCK, d), jnp.float32))
    k_smem[...] = (dk * (1.0 / math.sqrt(d))).astype(dtype)
    v_smem[...] = dv.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[keys])
    plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[keys])
    plgpu.wait_smem_to_gmem(0)

  tiles = swizzled(plgpu)
  scratch = (plgpu.SMEM((BLOCK, d), dtype, transforms=tiles),            # K, then dk
             plgpu.SMEM((BLOCK, d), dtype, transforms=tiles),            # V, then dv
             plgpu.SMEM((BLOCK, BLOCK), dtype, transforms=tiles),        # P^T
             plgpu.SMEM((BLOCK, BLOCK), dtype, transforms=tiles),        # dS^T
             plgpu.SMEM((slots, d, BLOCK), dtype, transforms=tiles),     # Q^T ring
             plgpu.SMEM((slots, BLOCK, d), dtype, transforms=tiles),     # Q ring
             plgpu.SMEM((slots, d, BLOCK), dtype, transforms=tiles),     # dO^T ring
             plgpu.SMEM((slots, BLOCK, d), dtype, transforms=tiles),     # dO ring
             plgpu.Barrier(num_barriers=2), *(plgpu.Barrier(num_barriers=slots),) * 4)
  q_t, do_t = jnp.transpose(q, (0, 2, 3, 1)), jnp.transpose(d_out, (0, 2, 3, 1))   # [b, h, d, s]
  return plgpu.kernel(
      body, out_type=(out_struct(k.shape, dtype, k), out_struct(v.shape, dtype, v)), scratch_types=scratch,
      grid=(kv_heads, s // BLOCK, b), grid_names=("kv_heads", "kv_block", "batch"),
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret_params(interpret, detect_races),
  )(q_t, q, do_t, d_out, k, v, lse, delta)


def hopper_attention_backward(q, k, v, out, lse, d_out, window: int | None, interpret: bool = False,
                              detect_races: bool = False):
  """(dq, dk, dv): s a multiple of 64, 16-bit inputs, head dim 64/128/256 (`supports`)."""
  if q.shape[1] % BLOCK:
    raise ValueError(f"sequence {q.shape[1]} is not a multiple of {BLOCK}: pad it (pallas_attention does)")
  if not supports(q.dtype, q.shape[-1]):
    raise ValueError(f"the Hopper kernels take bf16/fp16 and head dim 64/128/256, got {q.dtype}, {q.shape[-1]}")
  delta = jnp.einsum("bshd,bshd->bhs", out.astype(jnp.float32), d_out.astype(jnp.float32))
  dq = hopper_attention_dq(q, k, v, lse, delta, d_out, window, interpret=interpret, detect_races=detect_races)
  dk, dv = hopper_attention_dkdv(q, k, v, lse, delta, d_out, window, interpret=interpret,
                                 detect_races=detect_races)
  return dq, dk, dv
