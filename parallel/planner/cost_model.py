"""A cost model of one training step: per-device memory and step time / MFU for a 3D plan.

For a model (megajax.model.ModelConfig), a plan (dp, pp, tp, virtual stages v, microbatch
size b, global batch B, which MegaScale optimizations are on, which runtime executes it)
and a device (HARDWARE), it predicts:

  memory     bytes per device: the training state (fp32 master params and optimizer
             moments, ZeRO-sharded over dp), the compute copies and gradients, and the
             activations the runtime keeps (`memory.memory`, the model's other half, with
             its constants fitted to XLA's buffer assignment; the parameters leaf by leaf,
             `param_counts`, are here);
  time       one step on the slowest pipeline stage: compute (model FLOPs at a GEMM /
             attention efficiency, recomputation, memory-bound operators), the pipeline
             bubble (p-1)/(v m), exposed TP / PP / DP communication and per-step
             overheads (`step_time`), and MFU from megajax.flops (as the trainer counts it).

Two runtimes (`Plan.executor`):
  "megajax"  this repository's step (parallel/step.py): parameters all-gathered over dp,
             the linears' and head's in the compute dtype (bf16), the embedding and the
             LayerNorms' in fp32 (sharding.gathers_in_compute_dtype), gradients
             reduce-scattered over dp in fp32 once per step (`Plan.grad_sync` "step", the
             default; "microbatch": every microbatch's as they come). Its dp overlap as
             built: with pp = 1 the gathers one layer ahead in the first microbatch's
             forward and the reduce-scatters under the backward that makes them; with
             pp > 1 per chunk, the first chunk's exposed and the others' in pieces over
             the tick scan's head and tail. With pp > 1 the lockstep executor: by default each non-last microbatch-chunk's
             forward keeps its vjp residuals (what model.remat saves) in one of
             `residual_slots` slots until its backward, which reads them (no forward rerun;
             the last chunk runs forward and backward together); with
             `Plan.pipeline_recompute` (parallel.pipeline_recompute=True) it stashes only
             each microbatch-chunk's input and recomputes the chunk's forward in its
             backward (a forward more per step, less memory). Its memory model is checked
             against XLA's buffer assignment (calibration.memory_check), both executors.
  "paper"    Megatron-LM, which MegaScale builds on (the paper's Tables 2 and 3): bf16
             weights, fp32 gradients reduced once per step, the distributed optimizer,
             activations of the in-flight microbatches kept per Korthikanti et al. (2022).

MFU counts model FLOPs (megajax.flops: forward + backward, recomputation not counted,
attention over the keys each query's window covers). The paper counts the same way: its
Megatron-LM rows imply 1.077e12 FLOPs per token (full attention, our count 1.0773e12) and
its MegaScale rows 1.066e12 (a sliding window of about a thousand keys: 1.0628e12 at
w = 1024), so SWA lowers the counted FLOPs and raises MFU only through the time it saves.
Fitted numbers are named constants in two groups: the step-time ones below (to the paper's
Table 3, one to Table 2) and the megajax memory ones in memory.py (to XLA's buffer assignment).
No MFU of the paper is an output or an input other than through that fit.
"""

from __future__ import annotations

import dataclasses
import math

from megajax import flops
from megajax.layers import MLP_INPUTS
from megajax.model import ModelConfig
from megajax.parallel.pipeline.tables import dp_pieces

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Hardware:
  name: str
  peak_tflops: float        # bf16 dense tensor-core peak per GPU
  memory_gb: float          # HBM per GPU
  hbm_gbps: float           # HBM bandwidth per GPU, GB/s
  nvlink_gbps: float        # NVLink bandwidth per GPU per direction, GB/s (tp collectives)
  nic_gbps: float           # inter-node bandwidth per GPU per direction, GB/s (dp, pp)
  gpus_per_node: int
  nodes_per_tor: int = 64   # nodes under one set of top-of-rack switches (MegaScale 3.6)


HARDWARE = {
    # A100 SXM: NVLink 3 600 GB/s both ways; 8 x 200 Gb/s NICs per node = 25 GB/s per GPU.
    "a100-80g": Hardware("a100-80g", flops.PEAK_BF16_TFLOPS["a100"], 80.0, 2039.0, 300.0, 25.0, 8),
    # H100 / H200 SXM: NVLink 4 900 GB/s both ways; 8 x 400 Gb/s NICs per node = 50 GB/s per GPU.
    "h100-80g": Hardware("h100-80g", flops.PEAK_BF16_TFLOPS["h100"], 80.0, 3350.0, 450.0, 50.0, 8),
    "h200-141g": Hardware("h200-141g", flops.PEAK_BF16_TFLOPS["h200"], 141.0, 4800.0, 450.0, 50.0, 8),
}

# --- Calibration (the only fitted numbers; all in one place) ---------------------------------

@dataclasses.dataclass(frozen=True)
class Calibration:
  """The step-time constants: a plain value, passed to `step_time` (no module state to patch).

  `CALIBRATION` holds the least-squares fit (megajax.parallel.planner.calibration.fit,
  reprinted by `python -m megajax.launch.bench planner`) to the paper's Table 3: 175B on 256
  A100s, batch 256, the baseline MFU and the eight cumulative rows (the first 8 fields, 9
  numbers). Table 2 (256 to 12,288 GPUs, Megatron-LM and MegaScale) is then predicted, except
  for `scale_loss`, which only Table 2 can show (fitted to it with the others fixed).
  """
  gemm_efficiency: float = 0.77        # fraction of peak the transformer's large bf16 matmuls reach
  attention_efficiency: float = 0.30   # unfused attention (QK^T, masked softmax, PV as separate kernels)
  flash_attention_efficiency: float = 0.40  # fused attention (FlashAttention-2 / our Pallas kernels)
  nvlink_efficiency: float = 0.45      # bus bandwidth tp all-gathers / reduce-scatters reach, of NVLink's
  tp_overlap_hidden: float = 0.40      # share of tp communication collective matmul hides behind the GEMMs
  p2p_latency_s: float = 0.19e-3       # per blocking pipeline send/recv pair (Megatron's synchronous p2p)
  step_overhead_off_s: float = 0.72    # per step: data loading, host sync, launch gaps (misc off) ...
  step_overhead_on_s: float = 0.52     # ... and with MegaScale's misc optimizations on
  # Fitted to Table 2 with the above fixed (Table 3's 32 nodes sit under one ToR group):
  scale_loss: float = 0.016            # step time lost per doubling of the job's nodes beyond one ToR
                                       # group: stragglers and traffic crossing more switch tiers

  def step_overhead_s(self, misc: bool) -> float:
    return self.step_overhead_on_s if misc else self.step_overhead_off_s


CALIBRATION = Calibration()

# Set from hardware practice, not fitted:
NET_EFFICIENCY = 0.8             # NCCL bus bandwidth over the inter-node NICs (nccl-tests)
HBM_EFFICIENCY = 0.8             # achievable fraction of HBM bandwidth for streaming kernels
ELEMENTWISE_PASSES = {"unfused": 12, "fused": 6}   # HBM passes over a layer's LayerNorm / bias /
                                 # GeLU / dropout / residual tensors, forward + backward
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

  @property
  def gpus(self) -> int:
    return self.dp * self.pp * self.tp

  @property
  def microbatches(self) -> int:
    """Microbatches per dp rank per step (m)."""
    return self.batch // (self.dp * self.micro_batch)

  @property
  def bubble_fraction(self) -> float:
    """Idle over busy time per stage, (p-1)/(v m) (pipeline/schedule.py's simulated value)."""
    return (self.pp - 1) / (self.virtual_stages * self.microbatches)


def apply_switches(c: ModelConfig, opts: Optimizations) -> ModelConfig:
  """The model a plan runs: PTB picks a parallel block (the model's own if it has one: the
  two-norm block is one) or else the serial one, SWA keeps the model's window (else full)."""
  parallel = c.block if c.block != "serial" else "parallel"
  return dataclasses.replace(c, block=parallel if opts.ptb else "serial", window=c.window if opts.swa else None)


def norms_per_layer(c: ModelConfig) -> int:
  return 1 if c.block == "parallel" else 2


def tp_pairs_per_layer(c: ModelConfig) -> int:
  """The tp all-gather / reduce-scatter pairs of a block's forward: one per column / row
  matmul group (the serial block's halves; both parallel blocks fuse theirs)."""
  return 2 if c.block == "serial" else 1


# --- Parameters, leaf by leaf (shapes as megajax.model creates them) -------------------------

def param_leaves(c: ModelConfig):
  """[(name, shape, tp_dim, in_block)]: every parameter of one layer (in_block) and the rest."""
  h, d, q, kv, f = c.hidden_dim, c.head_dim, c.num_heads, c.num_kv_heads, c.mlp_dim
  norms = ("norm",) if c.block == "parallel" else ("attention_norm", "mlp_norm")
  norm_leaves = ("scale", "bias") if c.norm == "layernorm" else ("scale",)   # RMSNorm: no bias
  mlp_inputs = MLP_INPUTS[c.mlp]                                             # wi; wi_gate, wi_up
  layer = [(f"{n}.{w}", (h,), None, True) for n in norms for w in norm_leaves]
  layer += [("query.kernel", (h, q, d), 1, True), ("key.kernel", (h, kv, d), 1, True),
            ("value.kernel", (h, kv, d), 1, True), ("out.kernel", (q, d, h), 0, True), ("wo.kernel", (f, h), 0, True)]
  layer += [(f"{name}.kernel", (h, f), 1, True) for name in mlp_inputs]
  if c.use_bias:
    layer += [("query.bias", (q, d), 0, True), ("key.bias", (kv, d), 0, True), ("value.bias", (kv, d), 0, True),
              ("out.bias", (h,), None, True), ("wo.bias", (h,), None, True)]
    layer += [(f"{name}.bias", (f,), 0, True) for name in mlp_inputs]
  rest = [("embedding", (c.vocab_size, h), 0, False)] + [(f"final_norm.{w}", (h,), None, False) for w in norm_leaves]
  if not c.tie_embeddings:
    rest.append(("head", (h, c.vocab_size), 1, False))
  return layer + rest


def _local(shape, tp_dim, tp):
  return tuple(n // tp if i == tp_dim else n for i, n in enumerate(shape))


def _zero_shard(shape, dp):
  """Elements of one ZeRO shard: the largest dimension divisible by dp is split (sharding.py)."""
  size = math.prod(shape)
  return size // dp if dp > 1 and any(n % dp == 0 for n in shape) else size


def gathers_in_compute_dtype(name: str, in_block: bool) -> bool:
  """megajax.parallel.sharding.gathers_in_compute_dtype on param_leaves' names: the block's
  linears (kernels and biases) and the untied head; not the norms or the embedding."""
  return name == "head" or (in_block and not name.split(".")[0].endswith("norm"))


@dataclasses.dataclass(frozen=True)
class ParamCounts:
  stage: int         # parameters this device computes with (its tp shard of its stage)
  shard: int         # of those, the ZeRO shard it owns (master, gradient, moments)
  model: int         # the whole model
  compute_gathered: int = 0   # of `stage`, those megajax gathers in the compute dtype
  block: int = 0              # of `stage`, the blocks' (its layers')


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
  attention: float      # attention compute (QK^T, softmax, PV), recomputation included
  memory_bound: float   # LayerNorm / bias / GeLU / dropout / residual kernels
  tp_comm: float        # exposed tp all-gathers / reduce-scatters
  pp_comm: float        # exposed pipeline sends / receives
  bubble: float         # pipeline fill and drain
  dp_comm: float        # exposed ZeRO reduce-scatter / all-gather over dp
  optimizer: float      # the optimizer update on the dp shard
  overhead: float       # per-step fixed costs (data loading, host sync)
  stragglers: float     # the scale loss of a job beyond one ToR group (Calibration.scale_loss)
  recompute: float      # of gemm + attention, the part spent recomputing forwards
  mfu: float            # model FLOPs / (total x GPUs x peak)

  @property
  def total(self) -> float:
    return (self.gemm + self.attention + self.memory_bound + self.tp_comm + self.pp_comm + self.bubble
            + self.dp_comm + self.optimizer + self.overhead + self.stragglers)

  def parts(self) -> dict:
    """The step's parts by kind (seconds); compute is the model's matmul and attention work."""
    return {"compute": self.gemm + self.attention - self.recompute, "recompute": self.recompute,
            "memory-bound": self.memory_bound + self.optimizer, "tp-comm": self.tp_comm, "pp-comm": self.pp_comm,
            "bubble": self.bubble, "dp-comm": self.dp_comm, "overhead": self.overhead,
            "stragglers": self.stragglers}

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


def _pipelined(pieces: int, piece_seconds: float, window: float) -> float:
  """Exposed seconds of `pieces` equal collectives issued one compute `window` ahead of use,
  back to back on one link: the first hides under nothing, each later one under its window."""
  return piece_seconds + (pieces - 1) * max(0.0, piece_seconds - window) if pieces else 0.0


def _ring_seconds(nbytes: float, group: int, gbps: float) -> float:
  """One ring all-gather or reduce-scatter of `nbytes` (the full tensor) over `group` devices."""
  return (group - 1) / group * nbytes / (gbps * GB) if group > 1 else 0.0


def scale_loss(plan: Plan, hw: Hardware, calibration: Calibration = CALIBRATION) -> float:
  nodes = max(1, plan.gpus // hw.gpus_per_node)
  return calibration.scale_loss * math.log2(nodes / hw.nodes_per_tor) if nodes > hw.nodes_per_tor else 0.0


def step_time(c: ModelConfig, plan: Plan, hw: Hardware, remat: str | None = None,
              calibration: Calibration = CALIBRATION) -> StepTime:
  """The predicted step of `plan` on `hw` for the model `c` (the switches applied here), with
  the step-time constants of `calibration`."""
  k = calibration
  c = apply_switches(c, plan.opts)
  remat = remat or c.remat
  o, p, v, m, n = plan.opts, plan.pp, plan.virtual_stages, plan.microbatches, plan.tp
  tokens = plan.micro_batch * c.seq_len
  layers = c.num_layers // p
  h, q = c.hidden_dim, c.num_heads * c.head_dim
  cb = c.compute_dtype.itemsize
  peak = hw.peak_tflops * 1e12
  megajax = plan.executor == "megajax"

  # Compute per microbatch on the last stage (its layers and the head), forward FLOPs.
  gemm_fwd = 2 * tokens * (layers * flops.projection_macs_per_token(c) + h * c.vocab_size) / n
  keys = sum(flops.attention_keys_per_query(c.seq_len, c.layer_window(i)) for i in range(c.num_layers)) / c.num_layers
  attention_fwd = 2 * tokens * layers * 2 * keys * q / n
  # Forwards run again: megajax's pipeline backward with pipeline_recompute reruns its chunk
  # (by default it reads the residuals its forward kept); remat per policy
  # (full: everything; dots, like Megatron's selective recompute, and fused attention: attention).
  again = (1 if megajax and p > 1 and plan.pipeline_recompute else 0) + (1 if remat == "full" else 0)
  attention_again = again + (1 if remat == "dots" or o.fused_ops and again == 0 else 0)
  attention_efficiency = k.flash_attention_efficiency if o.fused_ops else k.attention_efficiency
  t_gemm = gemm_fwd * (3 + again) / (peak * k.gemm_efficiency)
  t_attention = attention_fwd * (3 + attention_again) / (peak * attention_efficiency)
  recompute = (gemm_fwd * again / (peak * k.gemm_efficiency)
               + attention_fwd * attention_again / (peak * attention_efficiency))
  # The norms on the sequence shard (the two-norm block's on the gathered sequence: every
  # rank all of it), the MLP's activation over each input projection's output.
  norm_tokens = 1 if c.block == "parallel_two_norms" else 1 / n
  mlp_width = len(MLP_INPUTS[c.mlp]) * c.mlp_dim / n
  elementwise = tokens * layers * (norms_per_layer(c) * h * norm_tokens + mlp_width) * cb
  t_memory = elementwise * ELEMENTWISE_PASSES["fused" if o.fused_ops else "unfused"] / (hw.hbm_gbps * GB * HBM_EFFICIENCY)

  # Tensor parallelism: per layer and direction one all-gather + one reduce-scatter per block
  # half (serial: 2 + 2, parallel: 1 + 1); Megatron's sequence parallelism all-gathers the
  # input once more per column-parallel GEMM for its weight gradient. Plus the head's pair.
  collectives = layers * 4 * tp_pairs_per_layer(c) + 2
  if not megajax:
    collectives += layers * tp_pairs_per_layer(c)
  t_tp = collectives * _ring_seconds(tokens * h * cb, n, hw.nvlink_gbps * k.nvlink_efficiency)
  if o.tp_overlap:
    t_tp *= 1 - k.tp_overlap_hidden

  # Pipeline: per microbatch a stage sends v activations and v gradients (and receives as
  # many, the other direction of the link), sequence-sharded over tp. Blocking pairs
  # (Megatron) wait for each transfer; decoupled ones (MegaScale) hide behind the next op.
  t_pp = 0.0
  if p > 1:
    transfers = 2 * v
    t_pp = transfers * (tokens * h / n * cb / (hw.nic_gbps * GB * NET_EFFICIENCY) + k.p2p_latency_s)
    if o.pp_overlap:
      t_pp = max(0.0, t_pp - (t_gemm + t_attention) / (2 * v))   # what one chunk's op cannot hide

  per_microbatch = t_gemm + t_attention + t_memory + t_tp + t_pp
  bubble = plan.bubble_fraction * m * per_microbatch if p > 1 else 0.0

  # Data parallelism (ZeRO-2): reduce-scatter of the gradients and all-gather of the
  # parameters, over the NICs unless the whole dp group sits in one node. megajax
  # reduce-scatters fp32 gradients once per step (grad_sync="step") or every microbatch's
  # ("microbatch") and gathers the linears and head in the compute dtype, the embedding and
  # LayerNorms in the parameter dtype; Megatron reduces fp32 gradients once per step and
  # gathers bf16 weights.
  counts = param_counts(c, plan)
  link = hw.nvlink_gbps * k.nvlink_efficiency if plan.dp * n <= hw.gpus_per_node else hw.nic_gbps * NET_EFFICIENCY
  pb = c.param_dtype.itemsize
  if megajax:   # "step" scatters the fp32 sums whatever the parameter dtype
    scatter_bytes = counts.stage * (pb * m if plan.grad_sync == "microbatch" else 4)
  else:
    scatter_bytes = counts.stage * pb
  if megajax:
    gather_bytes = counts.compute_gathered * cb + (counts.stage - counts.compute_gathered) * pb
  else:
    gather_bytes = counts.stage * cb
  t_gather, t_scatter = (_ring_seconds(nbytes, plan.dp, link) for nbytes in (gather_bytes, scatter_bytes))
  compute = m * (t_gemm + t_attention + t_memory)
  t_dp = t_gather + t_scatter
  if o.dp_overlap and not megajax:   # per chunk, prefetched: the first gather and last scatter stay exposed
    t_dp = t_dp / (2 * v) + max(0.0, t_dp * (1 - 1 / (2 * v)) - compute)
  elif o.dp_overlap:   # megajax: its dp overlap as built
    forward = (gemm_fwd / (peak * k.gemm_efficiency) + attention_fwd / (peak * attention_efficiency)
               + t_memory / 3)                                    # one microbatch, the stage's layers
    backward = t_gemm + t_attention + t_memory - forward           # recomputation included
    syncs = m if plan.grad_sync == "microbatch" else 1
    if p == 1:
      # Each layer's gather issued one layer ahead in the first microbatch's forward
      # (sharding.layer_ahead_gathers); each layer's reduce-scatter under the backward of the
      # layers before it (the last microbatch's, or each microbatch's with "microbatch").
      t_dp = (_pipelined(layers, t_gather / layers, forward / layers)
              + syncs * _pipelined(layers, t_scatter / (syncs * layers), backward / layers))
    else:
      # executor.py: the first chunk's rows and the shared leaves before / after the tick
      # scan, exposed; the other chunks' rows in pieces, one per head tick (a chunk's forward
      # each) and, with "step", one per tail tick (a chunk's backward); "microbatch"
      # reduce-scatters inside the backward slots, exposed.
      rest = counts.block * (1 - 1 / v)
      rows = (v - 1) * (layers // v)
      size, starts = dp_pieces(rows, p)
      piece = lambda seconds: seconds * rest / counts.stage * size / max(rows, 1)
      t_dp = (t_gather * (1 - rest / counts.stage) + len(starts) * max(0.0, piece(t_gather) - forward / v))
      if plan.grad_sync == "step":
        t_dp += t_scatter * (1 - rest / counts.stage) + len(starts) * max(0.0, piece(t_scatter) - backward / v)
      else:
        t_dp += t_scatter

  # Optimizer: a streaming pass over the dp shard (read param, grad, 2 moments; write 3),
  # LAMB a second pass for its norms; Megatron also writes the bf16 copy.
  per_param = 28 + (8 if o.lamb else 0) + (0 if megajax else 2)
  t_optimizer = counts.shard * per_param / (hw.hbm_gbps * GB * HBM_EFFICIENCY)
  overhead = k.step_overhead_s(o.misc)

  total = compute + m * (t_tp + t_pp) + bubble + t_dp + t_optimizer + overhead
  # A job beyond one ToR group waits longer at every synchronization (more stragglers,
  # ECMP conflicts on the upper tiers).
  stragglers = total * scale_loss(plan, hw, k)
  total += stragglers
  model_flops = flops.training_flops_per_token(c) * plan.batch * c.seq_len
  mfu = model_flops / (total * plan.gpus * peak)
  return StepTime(m * t_gemm, m * t_attention, m * t_memory, m * t_tp, m * t_pp, bubble, t_dp, t_optimizer,
                  overhead, stragglers, m * recompute, mfu)
