"""A cost model of one training step: per-device memory and step time / MFU for a 3D plan.

For a model (megajax.model.ModelConfig), a plan (dp, pp, tp, virtual stages v, microbatch
size b, global batch B, which MegaScale optimizations are on, which executor runs it)
and a device (hardware.HARDWARE), it predicts:

  memory     bytes per device (`memory.memory`, the model's other half; the parameters leaf
             by leaf, `param_counts`, are here);
  time       one step on the slowest pipeline stage (`step_time`), operation by operation:
             every GEMM by its shape, attention (FlashAttention-2 or Megatron-LM's unfused
             kernels), the memory-bound kernels by their bytes, each tensor-, pipeline- and
             data-parallel collective by its bytes over its link (operations.py, hardware.py:
             published micro-benchmarks, cited there), the bubble (p-1)/(v m) of a
             microbatch's time per stage, the optimizer's pass over its shard. Every part
             scales with the work: no fixed seconds per step. MFU from megajax.flops.

Two executors (`Plan.executor`):
  "megajax"  this repository's step (parallel/step.py): sequence-parallel tensor parallelism
             with collective matmul, ZeRO gathers of the linears and head in the compute dtype
             (the embedding and norms in fp32), fp32 gradients reduce-scattered once per step
             (`Plan.grad_sync` "step"; "microbatch": every microbatch's), its dp overlap as built
             (one layer ahead with pp = 1, per chunk in the tick scan's head and tail with
             pp > 1), and the lockstep pipeline executor whose backward reads the residuals each
             chunk's forward kept (`Plan.pipeline_recompute`: rerun the chunk's forward instead).
  "paper"    Megatron-LM, on which MegaScale builds (the published runs of
             published.validation_set()): with or without sequence parallelism, the distributed
             optimizer (else a gradient all-reduce after the backward) and the backward's
             tensor-parallel collectives overlapped with the weight-gradient GEMMs
             (`Plan.sequence_parallel`, `distributed_optimizer`, `tp_backward_overlap`), plus
             MegaScale's switches (`Optimizations`, the paper's Table 3).

Two costs grow with scale at a fixed batch beyond the bubble and the dp traffic (issue 34):
the wait for a slow machine (the chance that a job holds one, from MegaScale's 0.5% of machines,
times the 10% such a machine was measured slower: hardware.SLOW_MACHINE_SLOWDOWN, published, not
fitted) and the compute a hidden collective slows (hardware.OVERLAP_SLOWDOWN, published, not
fitted), which matters more as a step's compute shrinks.

Fitted numbers: five fields of `Calibration`, fitted by calibration.fit_calibration on
published.calibration_set() only (MegaScale's Table 3), never on a row they are validated on
(`python -m megajax.launch.bench planner` prints the fit, the leave-one-out errors and every
validation row with its source); and the megajax memory constants in memory.py (to XLA's
buffer assignment).
"""

from __future__ import annotations

import dataclasses
import math

from megajax import flops
from megajax.layers import BLOCK_FAMILIES, MLP_FAMILIES, NORM_FAMILIES
from megajax.model import ModelConfig
from megajax.parallel.context_parallel import uses_dual_chunks
from megajax.parallel.pipeline.tables import dp_pieces

from megajax.parallel.planner import hardware, operations
from megajax.parallel.planner.hardware import GB, HARDWARE, Hardware

__all__ = ["GB", "HARDWARE", "Hardware"]   # re-exported: the planner's callers name them here


# --- Calibration (the only fitted step-time numbers; all in one place) ------------------------

@dataclasses.dataclass(frozen=True)
class Calibration:
  """The step-time constants no micro-benchmark gives: a plain value, passed to `step_time`.

  `CALIBRATION` holds the least-squares fit (calibration.fit_calibration, reprinted by `python -m
  megajax.launch.bench planner` with each constant's leave-one-out errors) to
  published.calibration_set(): MegaScale's Table 3 (175B on 256 A100s, the baseline and eight
  cumulative switches; each switch's row is what shows its constant). No validation row is in
  it. `straggler_slowdown` is here to be varied, not fitted: a published measurement.
  """
  gemm_sustained: float = 0.876      # of the micro-benchmark's GEMM rate (hardware.FULL_WAVE_GEMM_FRACTION), what a
                                     # training run sustains: clocks under sustained power, cuBLAS's tile
                                     # choices for its shapes, the gaps between its kernels
  hbm_efficiency: float = 0.909      # fraction of HBM bandwidth the streaming kernels reach
  tp_overlap_hidden: float = 1.0     # share of tp communication MegaScale's collective matmul hides
                                     # (the fit sits at its bound: all of it)
  p2p_latency_s: float = 0.649e-3    # per blocking pipeline transfer (Megatron's synchronous p2p)
  data_s_per_token: float = 1.78e-6  # exposed data loading per token of a replica's batch, without
                                     # MegaScale's asynchronous, one-per-node data pipeline (misc)
  straggler_slowdown: float = hardware.SLOW_MACHINE_SLOWDOWN  # how much longer a step is when the job
                                     # holds a slow machine (hardware.slow_machine_chance): MegaScale
                                     # section 6.3's measured ~10%, not fitted


CALIBRATION = Calibration()

# Counted, not fitted:
OPTIMIZER_BYTES = 28             # per parameter of the shard: read fp32 param, grad, 2 moments; write 3
MEMORY_RESERVED_GB = 4.0         # CUDA context, NCCL buffers, allocator slack: not for the step


@dataclasses.dataclass(frozen=True)
class Optimizations:
  """MegaScale's switches (paper section 3, Table 3)."""
  ptb: bool = True          # parallel transformer block
  swa: bool = True          # sliding-window attention (the model's window; off: full causal)
  tp_overlap: bool = True   # collective matmul (all-gather / reduce-scatter fused with GEMMs)
  pp_overlap: bool = True   # decoupled pipeline send / receive
  dp_overlap: bool = True   # ZeRO all-gather / reduce-scatter per chunk, prefetched
  fused_ops: bool = True    # FlashAttention-2, fused LayerNorm and GeLU
  misc: bool = True         # data pipeline (async preprocessing, one loader per node), cleanups
  lamb: bool = True         # LAMB (the optimizer; its batch x3 is the plan's batch)


MEGASCALE = Optimizations()
MEGATRON = Optimizations(False, False, False, False, False, False, False, False)


@dataclasses.dataclass(frozen=True)
class Plan:
  dp: int
  pp: int
  tp: int
  virtual_stages: int       # model chunks per stage (interleaved 1F1B); 1: plain 1F1B
  micro_batch: int          # sequences per microbatch per dp rank
  batch: int                # global batch, sequences
  opts: Optimizations = MEGASCALE
  executor: str = "megajax"  # "megajax" (this repository) or "paper" (Megatron-LM / MegaScale)
  grad_sync: str = "step"    # megajax's parallel.grad_sync: "step" or "microbatch"
  # megajax's pipeline (pp > 1) only: parallel.pipeline_recompute (False: a chunk's backward
  # reads the residuals its forward kept; True: it reruns the forward from the stashed input),
  # parallel.schedule and parallel.traversal (they size the executor's buffers).
  pipeline_recompute: bool = False
  schedule: str = "interleaved_1f1b"
  traversal: str = "depth_first"
  # The paper executor's variants (Megatron-LM as each published run used it; megajax always
  # has the first two): sequence parallelism (else tp all-reduces and norms on every rank), the
  # distributed optimizer (else a gradient all-reduce after the backward and the whole update on
  # every dp rank), the backward's tp collectives under the weight-gradient GEMMs.
  sequence_parallel: bool = True
  distributed_optimizer: bool = True
  tp_backward_overlap: bool = True
  allreduce_grad_bytes: int = 4   # without the distributed optimizer: the all-reduced gradients' bytes
                                  # (Megatron-LM's fp32 main_grad; fp16 gradients: 2)
  # megajax's parallel.cp: each row's positions split over cp devices (megajax.parallel.context_parallel).
  cp: int = 1

  @property
  def gpus(self) -> int:
    return self.dp * self.pp * self.cp * self.tp

  @property
  def splits_sequence(self) -> bool:
    """Sequence parallelism: megajax's step always, the paper executor as the run had it."""
    return self.executor == "megajax" or self.sequence_parallel

  @property
  def microbatches(self) -> int:
    """Microbatches per dp rank per step (m)."""
    return self.batch // (self.dp * self.micro_batch)

  @property
  def bubble_fraction(self) -> float:
    """Idle over busy time per stage, (p-1)/(v m) (pipeline/schedule.py's simulated value)."""
    return (self.pp - 1) / (self.virtual_stages * self.microbatches)


def per_device_rows(c: ModelConfig, plan: Plan) -> ModelConfig:
  """The model as one device of the plan's cp group runs it: rows of seq_len / cp positions
  (what its matmuls, norms, tp and pp messages and activations scale with; a global layer's
  attention is cp of these rows' causal attention: mean_layer)."""
  return c if plan.cp == 1 else dataclasses.replace(c, seq_len=c.seq_len // plan.cp)


def apply_switches(c: ModelConfig, opts: Optimizations) -> ModelConfig:
  """The model a plan runs: PTB picks a parallel block (the model's own if it has one: the
  two-norm block is one) or else the serial one, SWA keeps the model's window (else full)."""
  parallel = c.block if BLOCK_FAMILIES[c.block].parallel else "parallel"
  return dataclasses.replace(c, block=parallel if opts.ptb else "serial", window=c.window if opts.swa else None)


# --- Parameters, leaf by leaf (shapes as megajax.model creates them) -------------------------

def param_leaves(c: ModelConfig):
  """[(name, shape, tp_dim, in_block)]: every parameter of one layer (in_block) and the rest."""
  h, d, q, kv, f = c.hidden_dim, c.head_dim, c.num_heads, c.num_kv_heads, c.mlp_dim
  norms = BLOCK_FAMILIES[c.block].norms
  norm_leaves = NORM_FAMILIES[c.norm].leaves
  mlp_inputs = MLP_FAMILIES[c.mlp].inputs                                    # wi; wi_gate, wi_up
  layer = [(f"{n}.{w}", (h,), None, True) for n in norms for w in norm_leaves]
  layer += [("query.kernel", (h, q, d), 1, True), ("key.kernel", (h, kv, d), 1, True),
            ("value.kernel", (h, kv, d), 1, True), ("out.kernel", (q, d, h), 0, True), ("wo.kernel", (f, h), 0, True)]
  layer += [(f"{name}.kernel", (h, f), 1, True) for name in mlp_inputs]
  if c.use_bias or c.qkv_bias:
    layer += [("query.bias", (q, d), 0, True), ("key.bias", (kv, d), 0, True), ("value.bias", (kv, d), 0, True)]
  if c.use_bias:
    layer += [("out.bias", (h,), None, True), ("wo.bias", (h,), None, True)]
    layer += [(f"{name}.bias", (f,), 0, True) for name in mlp_inputs]
  rest = [("embedding", (c.vocab_size, h), 0, False)] + [(f"final_norm.{w}", (h,), None, False) for w in norm_leaves]
  if not c.tie_embeddings:
    rest.append(("head", (h, c.vocab_size), 1, False))
  return layer + rest


def _local(shape, tp_dim, tp):
  return tuple(n // tp if i == tp_dim else n for i, n in enumerate(shape))


def _zero_shard(shape, dp):
  """Elements of one ZeRO shard: a dimension divisible by dp is split (sharding.py)."""
  size = math.prod(shape)
  return size // dp if dp > 1 and any(n % dp == 0 for n in shape) else size


def gathers_in_compute_dtype(name: str, in_block: bool) -> bool:
  """megajax.parallel.zero.gathers_in_compute_dtype on param_leaves' names: the block's
  linears (kernels and biases) and the untied head; not the norms or the embedding."""
  return name == "head" or (in_block and not name.split(".")[0].endswith("norm"))


@dataclasses.dataclass(frozen=True)
class ParamCounts:
  stage: int         # parameters this device computes with (its tp shard of its stage)
  shard: int         # of those, the ZeRO shard it owns (master, gradient, moments)
  model: int         # the whole model
  compute_gathered: int = 0   # of `stage`, those megajax gathers in the compute dtype
  block: int = 0              # of `stage`, the blocks' (its layers')

  def gathered_bytes(self, compute_itemsize: int, param_itemsize: int) -> int:
    """The bytes of megajax's ZeRO gather of the stage: the linears and head in the compute
    dtype, the rest in the parameters'."""
    return self.compute_gathered * compute_itemsize + (self.stage - self.compute_gathered) * param_itemsize


def param_counts(c: ModelConfig, plan: Plan) -> ParamCounts:
  layers = c.num_layers // plan.pp
  stage = shard = model = compute_gathered = block = 0
  for name, shape, tp_dim, in_block in param_leaves(c):
    local = _local(shape, tp_dim, plan.tp)
    # megajax keeps the embedding and head on every stage; Megatron on the first / last one
    # (the busiest stage holds its layers plus one of them).
    copies = layers if in_block else (1 if plan.executor == "megajax" or name != "head" or plan.pp == 1
                                      or c.tie_embeddings else 0)
    stage += copies * math.prod(local)
    compute_gathered += copies * math.prod(local) if gathers_in_compute_dtype(name, in_block) else 0
    block += copies * math.prod(local) if in_block else 0
    shard += copies * _zero_shard(local, plan.dp)
    model += (c.num_layers if in_block else 1) * math.prod(shape)
  return ParamCounts(stage, shard, model, compute_gathered, block)


def usable_bytes(hw: Hardware) -> float:
  return (hw.memory_gb - MEMORY_RESERVED_GB) * GB


# --- Step time -----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class StepTime:
  """Seconds per step on the slowest stage; the parts add up to `total`."""
  gemm: float           # matmul compute, recomputation included
  attention: float      # attention core (QK^T, softmax, dropout, PV), recomputation included
  memory_bound: float   # LayerNorm / bias / activation / dropout / residual kernels
  tp_comm: float        # exposed tp collectives
  pp_comm: float        # exposed pipeline sends / receives
  bubble: float         # pipeline fill and drain
  dp_comm: float        # exposed gradient reduction and parameter gathers over dp
  optimizer: float      # the optimizer update on the dp shard
  data: float           # exposed data loading (no asynchronous data pipeline)
  recompute: float      # of gemm + attention + memory_bound, the part spent recomputing forwards
  mfu: float            # model FLOPs / (total x GPUs x peak)
  recompute_matmul: float # of `recompute`, the GEMMs' and attention's
  straggler: float = 0.0  # the expected wait for a slow machine (the rest x slowdown x its chance)
  cp_comm: float = 0.0    # exposed context-parallel sends (halos, ring steps)

  @property
  def total(self) -> float:
    return (self.gemm + self.attention + self.memory_bound + self.tp_comm + self.cp_comm + self.pp_comm
            + self.bubble + self.dp_comm + self.optimizer + self.data + self.straggler)

  def parts(self) -> dict:
    """The step's parts by kind (seconds); compute is the model's matmul and attention work."""
    return {"compute": self.gemm + self.attention - self.recompute_matmul, "recompute": self.recompute,
            "memory-bound": self.memory_bound - (self.recompute - self.recompute_matmul) + self.optimizer,
            "tp-comm": self.tp_comm, "cp-comm": self.cp_comm, "pp-comm": self.pp_comm, "bubble": self.bubble, "dp-comm": self.dp_comm,
            "data": self.data, "stragglers": self.straggler}

  @property
  def bottleneck(self) -> str:
    """The largest part of the step; when that is compute, also the largest loss beside it."""
    parts = self.parts()
    top = max(parts, key=parts.get)
    if top != "compute":
      return top
    losses = {k: v for k, v in parts.items() if k != "compute"}
    loss = max(losses, key=losses.get)
    return f"compute (then {loss} {losses[loss] / self.total:.0%})"


def pipelined(pieces: int, piece_seconds: float, window: float) -> float:
  """Exposed seconds of `pieces` equal collectives issued one compute `window` ahead of use,
  back to back on one link: the first hides under nothing, each later one under its window."""
  return piece_seconds + (pieces - 1) * max(0.0, piece_seconds - window) if pieces else 0.0


def layer_times_by_window(c: ModelConfig, plan: Plan, hw: Hardware, k: Calibration) -> dict:
  """{window: operations.LayerTimes} of each kind of layer the model has, `c` one device's rows
  (per_device_rows). With cp > 1 a global layer's (None) attention is its ring's cp steps, each
  the work of a causal attention over the device's rows (c x 2c visible pairs)."""
  times = {w: operations.layer_times(c, plan.micro_batch, plan.tp, plan.opts.fused_ops, plan.splits_sequence, hw, k, w)
           for w in {c.layer_window(i) for i in range(c.num_layers)}}
  if plan.cp > 1 and None in times:
    times[None] = dataclasses.replace(times[None], attention_forward=plan.cp * times[None].attention_forward,
                                      attention_backward=plan.cp * times[None].attention_backward)
  return times


def mean_layer(c: ModelConfig, plan: Plan, hw: Hardware, k: Calibration, times: dict | None = None
               ) -> operations.LayerTimes:
  """The layer times averaged over the model's window pattern (local and global layers), `c`
  one device's rows; `times`: layer_times_by_window's, where the caller has them."""
  windows = [c.layer_window(i) for i in range(c.num_layers)]
  times = times or layer_times_by_window(c, plan, hw, k)
  fields = [f.name for f in dataclasses.fields(operations.LayerTimes)]
  return operations.LayerTimes(*(sum(getattr(times[w], f) for w in windows) / len(windows) for f in fields))


def tp_seconds(c: ModelConfig, plan: Plan, hw: Hardware):
  """(forward, backward) seconds of one layer's tp collectives per microbatch, and the head's
  (forward, backward): sequence parallelism all-gathers each column-parallel input and
  reduce-scatters each row-parallel output (Megatron-LM gathers the input once more in the
  backward for the weight gradient); without it, one all-reduce per row-parallel output and
  one per column-parallel input's gradient."""
  n = plan.tp
  message = plan.micro_batch * c.seq_len * c.hidden_dim * c.compute_dtype.itemsize
  busbw = hardware.link_busbw(n, hw)
  one = lambda kind: hardware.collective_seconds(message, n, busbw, kind)
  pairs = operations.tp_pairs_per_layer(c)
  if plan.splits_sequence:
    forward = pairs * (one("all_gather") + one("reduce_scatter"))
    backward = forward + (0 if plan.executor == "megajax" else pairs * one("all_gather"))
    head = (one("all_gather"), one("reduce_scatter"))
  else:
    forward = backward = pairs * one("all_reduce")
    head = (0.0, one("all_reduce"))
  return forward, backward, head


def cp_seconds(c: ModelConfig, plan: Plan, hw: Hardware, times: dict) -> tuple[float, float]:
  """(forward, backward) exposed seconds of one microbatch's context-parallel sends on a stage,
  `c` one device's rows, `times` layer_times_by_window's. A local layer sends a halo of w-1
  keys and values per chunk it holds (two in the dual-chunk layout, one over contiguous
  shards: context_parallel.uses_dual_chunks), under the attention over its own keys; a global
  one cp-1 ring steps of the rows' K/V, each under a step's attention; the backward sends as
  much back. Over NVLink when the tp x cp group sits in one node, else the NICs."""
  if plan.cp == 1:
    return 0.0, 0.0
  halos = 2 if uses_dual_chunks(c) else 1
  kv_bytes = plan.micro_batch * c.num_kv_heads * c.head_dim / plan.tp * c.compute_dtype.itemsize * 2   # K and V
  bandwidth = hardware.link_busbw(plan.tp * plan.cp, hw) * GB
  send = lambda positions: hardware.COLLECTIVE_LATENCY_S + positions * kv_bytes / bandwidth
  totals = [0.0, 0.0]
  for layer in range(c.num_layers // plan.pp):
    window = c.layer_window(layer)
    attention = (times[window].attention_forward, times[window].attention_backward)
    for phase in (0, 1):
      if window is None:       # each step's send under the step before's attention
        step = attention[phase] / plan.cp
        totals[phase] += (plan.cp - 1) * max(0.0, send(c.seq_len) - step)
      else:
        totals[phase] += max(0.0, halos * send(window - 1) - attention[phase])
  return totals[0], totals[1]


def step_time(c: ModelConfig, plan: Plan, hw: Hardware, remat: str | None = None,
              calibration: Calibration = CALIBRATION) -> StepTime:
  """The predicted step of `plan` on `hw` for the model `c` (the switches applied here), with
  the step-time constants of `calibration`. With cp > 1 one device runs rows of seq_len / cp
  (per_device_rows) and the model FLOPs are the whole rows'."""
  k = calibration
  whole = apply_switches(c, plan.opts)
  c = per_device_rows(whole, plan)
  remat = remat or c.remat
  o, p, v, m, n = plan.opts, plan.pp, plan.virtual_stages, plan.microbatches, plan.tp
  megajax = plan.executor == "megajax"
  layers = c.num_layers // p
  cb = c.compute_dtype.itemsize

  # Compute per microbatch on the last stage: its layers and the head. Forwards run again:
  # megajax's pipeline with pipeline_recompute reruns its chunk, remat full every layer, remat
  # dots (Megatron-LM's selective recomputation) the unfused attention core; FlashAttention's
  # backward reruns its own forward inside (operations.attention_times counts it there).
  by_window = layer_times_by_window(c, plan, hw, k)
  layer = mean_layer(c, plan, hw, k, by_window)
  head = operations.head_times(c, plan.micro_batch, n, hw, k)
  again = (1 if megajax and p > 1 and plan.pipeline_recompute else 0) + (1 if remat == "full" else 0)
  attention_again = again + (1 if remat == "dots" and not o.fused_ops and again == 0 else 0)
  t_gemm = layers * (layer.gemm_forward * (1 + again) + layer.gemm_input_grad + layer.gemm_weight_grad) + sum(head)
  t_attention = layers * (layer.attention_forward * (1 + attention_again) + layer.attention_backward)
  t_memory = layers * (layer.elementwise_forward * (1 + again) + layer.elementwise_backward)
  recompute_matmul = layers * (layer.gemm_forward * again + layer.attention_forward * attention_again)
  recompute = recompute_matmul + layers * layer.elementwise_forward * again

  # Tensor parallelism: the forward's collectives (again where the forward reruns), the
  # backward's (Megatron-LM hides them under the weight-gradient GEMMs where it can), MegaScale's
  # collective matmul hides a share of what is left (megajax's too: its collective_matmul).
  tp_forward, tp_backward, tp_head = tp_seconds(c, plan, hw)
  forward_comm = layers * tp_forward * (1 + again) + tp_head[0]
  backward_comm = layers * tp_backward + tp_head[1]
  if not megajax and plan.tp_backward_overlap:
    backward_comm = hardware.overlapped_seconds(backward_comm, max(0.0, backward_comm - layers * layer.gemm_weight_grad))
  t_tp = forward_comm + backward_comm
  if o.tp_overlap:
    t_tp = hardware.overlapped_seconds(t_tp, t_tp * (1 - k.tp_overlap_hidden))
  cp_forward, cp_backward = cp_seconds(c, plan, hw, by_window)
  t_cp = cp_forward * (1 + again) + cp_backward

  # Pipeline: per microbatch a stage sends v activations and v gradients (receiving as many the
  # other way), sequence-sharded over tp (Megatron-LM's scatter / gather), over its NIC; blocking
  # transfers (Megatron-LM) wait each, decoupled ones (MegaScale) hide behind the next chunk.
  t_pp = 0.0
  if p > 1:
    message = plan.micro_batch * c.seq_len * c.hidden_dim / n * cb
    t_pp = 2 * v * (hardware.COLLECTIVE_LATENCY_S + message / (hw.nic_busbw_gbps * GB) + k.p2p_latency_s)
    if o.pp_overlap:
      # what one chunk's op cannot hide
      t_pp = hardware.overlapped_seconds(t_pp, max(0.0, t_pp - (t_gemm + t_attention) / (2 * v)))

  per_microbatch = t_gemm + t_attention + t_memory + t_tp + t_cp + t_pp
  bubble = plan.bubble_fraction * m * per_microbatch
  compute = m * (t_gemm + t_attention + t_memory)
  counts = param_counts(c, plan)
  t_dp = _dp_seconds(c, plan, hw, counts, compute, layer)
  if plan.cp > 1:   # the gradient shards summed over cp, once, after the backward: exposed
    t_dp += hardware.collective_seconds(counts.shard * 4, plan.cp, hardware.link_busbw(plan.tp * plan.cp, hw),
                                        "all_reduce")

  # Optimizer: a streaming pass over the shard it updates (read param, grad, 2 moments; write
  # 3), LAMB a second pass for its norms; Megatron-LM also writes the bf16 copy. Without the
  # distributed optimizer every dp rank updates all of its stage.
  per_param = OPTIMIZER_BYTES + (8 if o.lamb else 0) + (0 if megajax else 2)
  updated = counts.shard if megajax or plan.distributed_optimizer else counts.stage
  t_optimizer = hardware.streaming_seconds(updated * per_param, hw, k.hbm_efficiency)
  data = 0.0 if megajax or o.misc else k.data_s_per_token * plan.batch * c.seq_len / plan.dp

  # Stragglers: the step waits for its slowest machine; with the chance that the job holds a slow
  # one, the whole step is that much longer (hardware.SLOW_MACHINE_FRACTION).
  rest = compute + m * (t_tp + t_cp + t_pp) + bubble + t_dp + t_optimizer + data
  straggler = rest * k.straggler_slowdown * hardware.slow_machine_chance(plan.gpus, hw)
  model_flops = flops.training_flops_per_token(whole) * plan.batch * whole.seq_len
  mfu = model_flops / ((rest + straggler) * plan.gpus * hw.peak_tflops * 1e12)
  return StepTime(m * t_gemm, m * t_attention, m * t_memory, m * t_tp, m * t_pp, bubble, t_dp, t_optimizer, data,
                  m * recompute, mfu, m * recompute_matmul, straggler, m * t_cp)


def _dp_seconds(c: ModelConfig, plan: Plan, hw: Hardware, counts: ParamCounts, compute: float,
                layer: operations.LayerTimes) -> float:
  """Exposed seconds of the step's data-parallel collectives, over NVLink when the dp group
  (tp-major rank order: tp x dp consecutive GPUs) sits in one node, else the NICs.

  megajax reduce-scatters fp32 gradients once per step (grad_sync="step") or every
  microbatch's ("microbatch") and gathers the linears and head in the compute dtype, the
  embedding and norms in the parameter dtype. Megatron-LM with the distributed optimizer
  reduce-scatters fp32 gradients and gathers bf16 weights (MegaScale's dp overlap: per chunk,
  prefetched, the first gather and the last scatter exposed); without it, all-reduces the
  gradients after the backward, exposed."""
  if plan.dp == 1:
    return 0.0
  o, p, v, m = plan.opts, plan.pp, plan.virtual_stages, plan.microbatches
  busbw = hardware.link_busbw(plan.tp * plan.dp, hw)
  ring = lambda nbytes, kind="all_gather": hardware.collective_seconds(nbytes, plan.dp, busbw, kind)
  cb, pb = c.compute_dtype.itemsize, c.param_dtype.itemsize
  if plan.executor != "megajax":
    if not plan.distributed_optimizer:
      return ring(counts.stage * plan.allreduce_grad_bytes, "all_reduce")
    t_dp = ring(counts.stage * cb) + ring(counts.stage * 4, "reduce_scatter")
    if not o.dp_overlap:
      return t_dp
    return hardware.overlapped_seconds(t_dp, t_dp / (2 * v) + max(0.0, t_dp * (1 - 1 / (2 * v)) - compute))
  scatter_bytes = counts.stage * (pb * m if plan.grad_sync == "microbatch" else 4)   # "step": the fp32 sums
  gather_bytes = counts.gathered_bytes(cb, pb)
  t_gather, t_scatter = ring(gather_bytes), ring(scatter_bytes, "reduce_scatter")
  if not o.dp_overlap:
    return t_gather + t_scatter
  layers = c.num_layers // p
  forward = layers * layer.forward                               # one microbatch, the stage's layers
  backward = compute / m - forward                               # recomputation included
  syncs = m if plan.grad_sync == "microbatch" else 1
  if p == 1:
    # Each layer's gather issued one layer ahead in the first microbatch's forward
    # (zero.layer_ahead_gathers); each layer's reduce-scatter under the backward of the
    # layers before it (the last microbatch's, or each microbatch's with "microbatch").
    exposed = (pipelined(layers, t_gather / layers, forward / layers)
               + syncs * pipelined(layers, t_scatter / (syncs * layers), backward / layers))
    return hardware.overlapped_seconds(t_gather + t_scatter, exposed)
  # executor.py: the first chunk's rows and the shared leaves before / after the tick scan,
  # exposed; the other chunks' rows in pieces, one per head tick (a chunk's forward each) and,
  # with "step", one per tail tick (a chunk's backward); "microbatch" reduce-scatters inside
  # the backward slots, exposed.
  rest = counts.block * (1 - 1 / v)
  rows = (v - 1) * (layers // v)
  size, starts = dp_pieces(rows, p)
  piece = lambda seconds: seconds * rest / counts.stage * size / max(rows, 1)
  t_dp = t_gather * (1 - rest / counts.stage) + len(starts) * max(0.0, piece(t_gather) - forward / v)
  if plan.grad_sync == "step":
    t_dp += t_scatter * (1 - rest / counts.stage) + len(starts) * max(0.0, piece(t_scatter) - backward / v)
  else:
    t_dp += t_scatter
  return hardware.overlapped_seconds(t_gather + t_scatter, t_dp)
