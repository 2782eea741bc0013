"""Sliding-window flash attention forward for Hopper (H100/H200): a Mosaic GPU Pallas kernel.

The same contract as `pallas_attention`'s forward (i - window < j <= i, grouped KV heads,
out plus the natural-log logsumexp the backward kernels read), built from what makes
Hopper fast:

  warp specialization  three warpgroups per program: two compute warpgroups (64 query rows
                       each) and one memory warpgroup that only issues copies
  TMA                  the memory warpgroup streams K and V tiles into `slots` shared-memory
                       buffers ahead of the compute; mbarriers say "loaded" and "consumed"
  wgmma                Q.K^T and P.V run on the tensor cores from shared memory, fp32
                       accumulators, softmax in base 2 (exp2) on the accumulator registers

Block skipping is the portable kernel's: a program streams only the KV blocks its 128 rows
can see (`kv_block_ranges`), each compute warpgroup masks only its partial blocks and
passes over (without computing) the few blocks that only its sibling needs.

Packed documents come in as each token's document start (`band.document_bounds`): they
raise the bands' first block (scalars read from global memory), and, since segment ids never
decrease, "same document" under the causal mask is "key >= the row's document start", so
the element mask needs only that per-row vector (in the accumulator's row layout), no
key-side segment ids.

K reaches the kernel transposed ([b, kv_heads, d, s], one XLA transpose) and P goes through
shared memory, so both wgmma operands are plain [M, K] x [K, N] tiles: the form that
Pallas's GPU interpreter runs on CPU, which is how the tests check this kernel without a
GPU (`interpret=True`). Only 16-bit inputs (wgmma has no fp32 path); `pallas_attention`
sends fp32 to the portable kernel.
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax import lax
from jax.experimental import pallas as pl
import jax.numpy as jnp

from megajax.layers.kernels.band import band_loop, in_window, kv_block_ranges
from megajax.layers.kernels.support import out_struct

HOPPER_DEVICE_KINDS = ("H100", "H200", "H800", "H20", "GH200")
BLOCK = 64                 # rows per compute warpgroup and keys per KV tile (wgmma's M granule)
COMPUTE_WARPGROUPS = 2
ROWS_PER_PROGRAM = BLOCK * COMPUTE_WARPGROUPS
LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)
# Masked scores (already in log2 units): finite, so a row whose first block is all masked
# gives exp2(0) = 1s that the first visible block's rescale (exp2(MASK - m) = 0) wipes out.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class ForwardOptions:
  """The forward's candidate speed-ups, each opt-in until the GPU check (`bench gpu`, the
  attention table's rows) measures it faster than what it replaces. jax 0.10's GPU
  interpreter runs only the last (it has no run_state, register wgmma operands or transposed
  shared-memory views); all four are checked by lowering in CI."""
  accumulate_in_place: bool = False    # P.V added into the carried accumulator (ACC.init): one
                                       # [64, d] fp32 accumulator live, not two (spills at d=256)
  p_in_registers: bool = False         # P as wgmma's register operand: no shared-memory round trip
  transpose_k_in_kernel: bool = False  # K tiles as stored, read transposed by wgmma: no XLA transpose
  schedule_barrier: bool = False       # the two compute warpgroups take turns on the tensor cores
                                       # (one's softmax under the other's matmuls)

  def interpretable(self) -> bool:
    return not (self.accumulate_in_place or self.p_in_registers or self.transpose_k_in_kernel)


def is_hopper(device: jax.Device) -> bool:
  return device.platform == "gpu" and any(kind in device.device_kind for kind in HOPPER_DEVICE_KINDS)


def supports(dtype, head_dim: int) -> bool:
  """Shapes and types this kernel takes (others go to the portable kernel)."""
  return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and head_dim in (64, 128, 256)


def warpgroup_doc_starts(q_block, doc_start_of):
  """The document starts of a warpgroup's (first, last) row; None without documents."""
  if doc_start_of is None:
    return None
  return doc_start_of(q_block * BLOCK), doc_start_of(q_block * BLOCK + BLOCK - 1)


def streamed_kv_blocks(q_tile, window: int | None, kv_blocks: int, doc_start_of=None):
  """KV blocks [first, last) program `q_tile` streams: from warpgroup 0's first visible block
  to warpgroup 1's last. Ints (tests) or traced ints (the kernel). doc_start_of: with
  documents, row -> the document start of that row."""
  first_block = q_tile * COMPUTE_WARPGROUPS
  first = kv_block_ranges(first_block, BLOCK, BLOCK, window, kv_blocks,
                          warpgroup_doc_starts(first_block, doc_start_of))[0]
  last = kv_block_ranges(first_block + COMPUTE_WARPGROUPS - 1, BLOCK, BLOCK, window, kv_blocks)[3]
  return first, last


def mosaic_gpu():
  from jax.experimental.pallas import mosaic_gpu as plgpu  # Mosaic GPU loads only when used.
  return plgpu


def interpret_params(interpret: bool, detect_races: bool = False):
  """plgpu.kernel's `interpret`: False (compiled), or the GPU interpreter's parameters."""
  if not interpret:
    return False
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  return InterpretGPUParams(detect_races=detect_races)


def swizzled(plgpu):
  """The shared-memory transforms of every 16-bit wgmma operand tile (64-wide, 128-byte swizzle)."""
  return (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def tile_positions(row_start, col_start, in_layout, layout):
  """(row ids, col ids) [BLOCK, BLOCK] of a tile at (row_start, col_start). Each iota gets its
  layout where it is made: jax 0.10's Mosaic GPU cannot infer an iota's layout from its uses
  (0.11's warpgroup lowering can)."""
  iota = lambda dim: in_layout(lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), dim), layout)
  return row_start + iota(0), col_start + iota(1)


def hopper_attention_forward(q: jax.Array, k: jax.Array, v: jax.Array, window: int | None,
                             doc_start: jax.Array | None = None, slots: int = 2, interpret: bool = False,
                             detect_races: bool = False, options: ForwardOptions = ForwardOptions()):
  """q: [b, s, h, d], k, v: [b, s, kv_h, d], s a multiple of 128 -> (out [b, s, h, d],
  lse [b, h, s] fp32, natural log, softmax scale 1/sqrt(d) included). doc_start: packed
  documents, int32[b, s] (`band.document_bounds`), or None. detect_races: the interpreter's
  race detector (tests). options: `ForwardOptions` (the defaults: none)."""
  plgpu = mosaic_gpu()
  if interpret and not options.interpretable():
    raise ValueError(f"{options}: only schedule_barrier runs in the GPU interpreter; "
                     "check them by lowering (jax.export for cuda) or on a GPU")
  b, s, heads, d = q.shape
  kv_heads = k.shape[2]
  group = heads // kv_heads
  if s % ROWS_PER_PROGRAM:
    raise ValueError(f"sequence {s} is not a multiple of {ROWS_PER_PROGRAM}: pad it (pallas_attention does)")
  if not supports(q.dtype, d):
    raise ValueError(f"the Hopper kernel takes bf16/fp16 and head dim 64/128/256, got {q.dtype}, {d}")
  dtype = q.dtype
  kv_blocks = s // BLOCK
  score_scale = LOG2_E / math.sqrt(d)
  # Without a GPU the layout hints have no meaning: the interpreter computes plain arrays.
  in_layout = (lambda x, layout: x) if interpret else plgpu.layout_cast
  wgmma_layout = plgpu.Layout.WGMMA
  row_layout = plgpu.Layout.WGMMA.reduce(1)

  documents = doc_start is not None

  def doc_start_reader(doc_start_ref):
    """row -> its document start, a scalar read from global memory (None without documents)."""
    if doc_start_ref is None:
      return None
    return lambda row: doc_start_ref[lax.axis_index("batch"), row]

  def program_kv_range(doc_start_ref):
    return streamed_kv_blocks(lax.axis_index("q_tile"), window, kv_blocks, doc_start_reader(doc_start_ref))

  def compute(q_ref, doc_start_ref, out_ref, lse_ref, q_smem, p_smem, lse_smem, k_smem, v_smem, q_barrier,
              k_loaded, v_loaded, k_consumed, v_consumed, schedule):
    batch, head = lax.axis_index("batch"), lax.axis_index("heads")
    warpgroup = lax.axis_index("wg")
    q_block = lax.axis_index("q_tile") * COMPUTE_WARPGROUPS + warpgroup
    row_start = q_block * BLOCK
    rows = (batch, pl.ds(row_start, BLOCK), head)
    plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem, q_barrier)
    plgpu.barrier_wait(q_barrier)
    program_lo, program_hi = program_kv_range(doc_start_ref)
    lo, full_lo, full_hi, hi = kv_block_ranges(q_block, BLOCK, BLOCK, window, kv_blocks,
                                               warpgroup_doc_starts(q_block, doc_start_reader(doc_start_ref)))
    if documents:            # this warpgroup's rows' document starts, one per accumulator row
      rows_doc_start = (batch, pl.ds(row_start, BLOCK))
      row_doc_starts = (doc_start_ref[rows_doc_start] if interpret else
                        plgpu.load(doc_start_ref, rows_doc_start, layout=row_layout, optimized=False))

    def slot_of(kv_block):
      return lax.rem(kv_block - program_lo, slots)

    def take_turn():
      """The schedule barrier's rendezvous: the warpgroups alternate, one's softmax while the
      other's matmuls run (each block: one after issuing Q.K^T, one before P.V)."""
      if options.schedule_barrier:
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(schedule)

    def skip(kv_block, carry):
      """A block only the sibling warpgroup sees: take part in the barriers, compute nothing."""
      slot = slot_of(kv_block)
      plgpu.barrier_wait(k_loaded.at[slot])
      plgpu.barrier_arrive(k_consumed.at[slot])
      plgpu.barrier_wait(v_loaded.at[slot])
      plgpu.barrier_arrive(v_consumed.at[slot])
      take_turn()
      take_turn()
      return carry

    def k_operand(slot):
      if options.transpose_k_in_kernel:
        return plgpu.transpose_ref(k_smem.at[slot], (1, 0))          # [64, d] read as [d, 64]
      return k_smem.at[slot]

    def attend(kv_block, carry, masked):
      m, l, acc = carry
      slot = slot_of(kv_block)
      plgpu.barrier_wait(k_loaded.at[slot])

      def scores(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, k_operand(slot))               # [64, d] x [d, 64]
        take_turn()
        return acc_ref[...]
      s_block = pl.run_scoped(scores, plgpu.ACC((BLOCK, BLOCK), jnp.float32)) * score_scale
      plgpu.barrier_arrive(k_consumed.at[slot])
      if masked:
        row_ids, col_ids = tile_positions(row_start, kv_block * BLOCK, in_layout, wgmma_layout)
        visible = in_window(row_ids, col_ids, window)
        if documents:        # same document, given col <= row and non-decreasing segment ids
          visible &= col_ids >= lax.broadcast_in_dim(row_doc_starts, (BLOCK, BLOCK), [0])
        s_block = jnp.where(visible, s_block, MASK_VALUE)
      m_new = jnp.maximum(m, s_block.max(axis=1))
      alpha = jnp.exp2(m - m_new)
      p = jnp.exp2(s_block - lax.broadcast_in_dim(m_new, s_block.shape, [0]))
      l = l * alpha + p.sum(axis=1)
      p16 = p.astype(dtype)
      if not options.p_in_registers:
        p_smem[...] = p16
        plgpu.commit_smem()                                          # P visible to the tensor cores
      if options.schedule_barrier:
        plgpu.barrier_arrive(schedule)                               # softmax done
      plgpu.barrier_wait(v_loaded.at[slot])
      if options.schedule_barrier:
        plgpu.barrier_wait(schedule)                                 # the sibling's matmuls issued
      p_operand = p16 if options.p_in_registers else p_smem
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

      def weighted_values(acc_ref):
        plgpu.wgmma(acc_ref, p_operand, v_smem.at[slot])            # [64, 64] x [64, d]
        return acc_ref[...]
      if options.accumulate_in_place:                                # into acc's own registers
        acc = pl.run_state(lambda acc_ref: plgpu.wgmma(acc_ref, p_operand, v_smem.at[slot]))(plgpu.ACC.init(acc))
      else:
        acc = acc + pl.run_scoped(weighted_values, plgpu.ACC((BLOCK, d), jnp.float32))
      plgpu.barrier_arrive(v_consumed.at[slot])
      return m_new, l, acc

    carry = (in_layout(jnp.full((BLOCK,), MASK_VALUE, jnp.float32), row_layout),
             in_layout(jnp.full((BLOCK,), 0.0, jnp.float32), row_layout),
             in_layout(jnp.full((BLOCK, d), 0.0, jnp.float32), wgmma_layout))
    if options.schedule_barrier:
      pl.when(warpgroup == 1)(take_turn)                             # warpgroup 0 goes first
    carry = lax.fori_loop(program_lo, lo, skip, carry)
    carry = band_loop((lo, full_lo, full_hi, hi), attend, carry)
    m, l, acc = lax.fori_loop(hi, program_hi, skip, carry)
    if options.schedule_barrier:
      pl.when(warpgroup == 0)(take_turn)                             # the sibling's last turn

    q_smem[...] = (acc / lax.broadcast_in_dim(l, acc.shape, [0])).astype(dtype)
    lse_smem[...] = (m + jnp.log2(l)) * LN_2
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, out_ref.at[rows])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, head, pl.ds(row_start, BLOCK)])
    plgpu.wait_smem_to_gmem(0)

  def memory(k_in_ref, v_ref, doc_start_ref, k_smem, v_smem, k_loaded, v_loaded, k_consumed, v_consumed):
    batch = lax.axis_index("batch")
    kv_head = lax.div(lax.axis_index("heads"), jnp.array(group, jnp.int32))
    program_lo, program_hi = program_kv_range(doc_start_ref)

    def load(kv_block, slot):
      keys = pl.ds(kv_block * BLOCK, BLOCK)
      k_tile = k_in_ref.at[batch, keys, kv_head] if options.transpose_k_in_kernel else k_in_ref.at[batch, kv_head, :, keys]
      plgpu.copy_gmem_to_smem(k_tile, k_smem.at[slot], k_loaded.at[slot])
      plgpu.copy_gmem_to_smem(v_ref.at[batch, keys, kv_head], v_smem.at[slot], v_loaded.at[slot])

    for slot in range(slots):                                        # fill the ring
      @pl.when(program_lo + slot < program_hi)
      def _prefetch(slot=slot):
        load(program_lo + slot, slot)

    @pl.loop(program_lo + slots, program_hi)
    def _stream(kv_block):
      slot = lax.rem(kv_block - program_lo, slots)
      plgpu.barrier_wait(k_consumed.at[slot])                        # both warpgroups are done with it
      plgpu.barrier_wait(v_consumed.at[slot])
      load(kv_block, slot)

    # Wait for the last loads' consumers before the buffers are released.
    @pl.loop(jnp.maximum(program_lo, program_hi - slots), program_hi)
    def _drain(kv_block):
      slot = lax.rem(kv_block - program_lo, slots)
      plgpu.barrier_wait(k_consumed.at[slot])
      plgpu.barrier_wait(v_consumed.at[slot])

  def kernel(q_ref, k_t_ref, v_ref, doc_start_ref, out_ref, lse_ref, buffers, loaded, consumed):
    q_smem, p_smem, lse_smem, k_smem, v_smem = buffers
    q_barriers, k_loaded, v_loaded = loaded
    k_consumed, v_consumed, schedule = consumed
    warpgroup = lax.axis_index("wg")

    @pl.when(warpgroup < COMPUTE_WARPGROUPS)
    def _compute():
      plgpu.set_max_registers(232, action="increase")
      compute(q_ref, doc_start_ref, out_ref, lse_ref, q_smem.at[warpgroup], p_smem.at[warpgroup],
              lse_smem.at[warpgroup], k_smem, v_smem, q_barriers.at[warpgroup], k_loaded, v_loaded, k_consumed,
              v_consumed, schedule)

    @pl.when(warpgroup == COMPUTE_WARPGROUPS)
    def _memory():
      plgpu.set_max_registers(40, action="decrease")
      memory(k_t_ref, v_ref, doc_start_ref, k_smem, v_smem, k_loaded, v_loaded, k_consumed, v_consumed)

  def entry(*refs):
    if documents:
      q_ref, k_t_ref, v_ref, doc_start_ref, out_ref, lse_ref = refs
    else:
      (q_ref, k_t_ref, v_ref, out_ref, lse_ref), doc_start_ref = refs, None
    tiles = swizzled(plgpu)
    buffers = (
        plgpu.SMEM((COMPUTE_WARPGROUPS, BLOCK, d), dtype, transforms=tiles),      # Q, then out
        plgpu.SMEM((COMPUTE_WARPGROUPS, BLOCK, BLOCK), dtype, transforms=tiles),  # P
        plgpu.SMEM((COMPUTE_WARPGROUPS, BLOCK), jnp.float32),                         # lse
        plgpu.SMEM((slots, BLOCK, d) if options.transpose_k_in_kernel else (slots, d, BLOCK), dtype,
                   transforms=tiles),                                             # K (or K^T) ring
        plgpu.SMEM((slots, BLOCK, d), dtype, transforms=tiles),                   # V ring
    )
    loaded = (plgpu.Barrier(num_barriers=COMPUTE_WARPGROUPS), plgpu.Barrier(num_barriers=slots),
              plgpu.Barrier(num_barriers=slots))
    consumed = (*(plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=slots),) * 2,
                plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS))              # + the schedule barrier
    pl.run_scoped(lambda *scoped: kernel(q_ref, k_t_ref, v_ref, doc_start_ref, out_ref, lse_ref, *scoped),
                  buffers, loaded, consumed, collective_axes="wg")

  k_in = k if options.transpose_k_in_kernel else jnp.transpose(k, (0, 2, 3, 1))   # [b, s, kv_h, d] or [b, kv_h, d, s]
  return plgpu.kernel(
      entry,
      out_type=(out_struct(q.shape, dtype, q), out_struct((b, heads, s), jnp.float32, q)),
      grid=(heads, s // ROWS_PER_PROGRAM, b),
      grid_names=("heads", "q_tile", "batch"),
      num_threads=COMPUTE_WARPGROUPS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interpret_params(interpret, detect_races),
  )(q, k_in, v, *(() if doc_start is None else (doc_start.astype(jnp.int32),)))
