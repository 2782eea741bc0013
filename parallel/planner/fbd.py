"""MegaFBD in the planner: a step whose forward runs on one device group and whose backward
runs on another, possibly of another GPU type (a mixed cluster), and whether that beats the
faster GPUs alone.

The step (megajax.parallel.fbd) per microbatch of b sequences: the forward group (F GPUs of one
type, dp_f x tp_f) runs the forward and sends what the backward needs; the backward group (B
GPUs, dp_b x tp_b) runs the backward and adds the gradients, reduce-scattered over dp_b; once
per step the optimizer on the backward group's ZeRO shards and the new weights in the compute
dtype to the forward group. Three stages a microbatch flows through, each on its own resources:

  forward    F: every layer's forward GEMMs, attention and memory-bound kernels at b / dp_f
             sequences a device (operations.layer_times) and the head; its tp collectives
             exposed (the groups' programs are XLA SPMD ones: no collective matmul)
  transfer   the residuals (memory.fbd_residual_bytes) from the forward group's NICs to the
             backward group's, the groups on separate nodes: the slower side's NICs together
  backward   B: the input and weight gradients, attention's backward, the forward again under
             remat full, the tp collectives, the fp32 gradients' dp reduce-scatter under the
             backward's layers (as the 3D step's with pp = 1)

so a step is the weights' send + one microbatch through all three + (m - 1) x the slowest stage
+ the optimizer (a pipeline of depth three; the stages overlap: MegaFBD's point), plus the 3D
model's wait for a slow machine over all F + B GPUs. MFU divides the model FLOPs by the step and
the two groups' summed peaks. Memory per device: the forward group holds the weights in the compute
dtype (1/tp_f) and two microbatches' residuals (one computed, one sending); the backward group
what the 3D step's pp = 1 plan holds on dp_b x tp_b (memory.memory) plus one more microbatch's
residuals arriving. Every time is the 3D cost model's own operation times (cost_model,
operations, hardware): nothing here is fitted.
"""

from __future__ import annotations

import dataclasses
import itertools

from megajax import flops
from megajax.model import ModelConfig
from megajax.parallel.planner import hardware, memory, plans
from megajax.parallel.planner.cost_model import (CALIBRATION, MEGASCALE, OPTIMIZER_BYTES, Calibration, Hardware, Plan,
                                                 pipelined, tp_seconds, apply_switches, mean_layer, param_counts,
                                                 usable_bytes)
from megajax.parallel.planner.operations import head_times

# The FBD groups run XLA SPMD programs: MegaScale's switches but the collective matmul.
FBD_SWITCHES = dataclasses.replace(MEGASCALE, tp_overlap=False)


@dataclasses.dataclass(frozen=True)
class Group:
  hw: Hardware
  dp: int
  tp: int

  @property
  def gpus(self) -> int:
    return self.dp * self.tp


@dataclasses.dataclass(frozen=True)
class FbdPlan:
  forward: Group
  backward: Group
  micro_batch: int          # sequences per microbatch (the whole microbatch: split over each group's dp)
  batch: int                # global batch, sequences

  @property
  def microbatches(self) -> int:
    return self.batch // self.micro_batch

  def group_plan(self, group: Group) -> Plan:
    """The 3D cost model's plan for one group's share of a microbatch (pp = 1)."""
    return Plan(group.dp, 1, group.tp, 1, self.micro_batch // group.dp, self.batch, FBD_SWITCHES)

  @property
  def whole(self) -> Plan:
    """One device holding a whole microbatch: what crosses between the groups is counted on it."""
    return Plan(1, 1, 1, 1, self.micro_batch, self.batch, FBD_SWITCHES)


@dataclasses.dataclass(frozen=True)
class FbdTime:
  """Seconds: one microbatch's three stages, and a step's."""
  forward: float
  transfer: float
  backward: float
  weights: float            # the weights to the forward group, once per step, before its first forward
  optimizer: float
  straggler: float
  microbatches: int
  mfu: float

  @property
  def stages(self) -> dict:
    return {"forward": self.forward, "transfer": self.transfer, "backward": self.backward}

  @property
  def total(self) -> float:
    stages = self.stages.values()
    return self.weights + sum(stages) + (self.microbatches - 1) * max(stages) + self.optimizer + self.straggler

  @property
  def bottleneck(self) -> str:
    return max(self.stages, key=self.stages.get)


@dataclasses.dataclass(frozen=True)
class FbdCandidate:
  plan: FbdPlan
  time: FbdTime
  forward_bytes: float      # per forward device
  backward_bytes: float     # per backward device
  fits: bool


def _link_seconds(nbytes: float, plan: FbdPlan) -> float:
  """`nbytes` from the forward group to the backward group (or back), every GPU's NIC busy: at
  the rate of the slower side's NICs together."""
  f, b = plan.forward, plan.backward
  rate = min(f.gpus * f.hw.nic_busbw_gbps, b.gpus * b.hw.nic_busbw_gbps) * hardware.GB
  return hardware.COLLECTIVE_LATENCY_S + nbytes / rate


def fbd_time(c: ModelConfig, plan: FbdPlan, remat: str | None = None, k: Calibration = CALIBRATION) -> FbdTime:
  c = apply_switches(c, FBD_SWITCHES)
  remat = remat or c.remat
  again = 1 if remat == "full" else 0
  layers = c.num_layers

  f_plan, f_hw = plan.group_plan(plan.forward), plan.forward.hw
  f_layer = mean_layer(c, f_plan, f_hw, k)
  f_tp, _, f_tp_head = tp_seconds(c, f_plan, f_hw)
  forward = layers * (f_layer.forward + f_tp) + head_times(c, f_plan.micro_batch, f_plan.tp, f_hw, k)[0] + f_tp_head[0]

  b_plan, b_hw = plan.group_plan(plan.backward), plan.backward.hw
  b_layer = mean_layer(c, b_plan, b_hw, k)
  b_tp_forward, b_tp_backward, b_tp_head = tp_seconds(c, b_plan, b_hw)
  compute = layers * (b_layer.gemm_input_grad + b_layer.gemm_weight_grad + b_layer.attention_backward
                      + b_layer.elementwise_backward + again * b_layer.forward)
  compute += head_times(c, b_plan.micro_batch, b_plan.tp, b_hw, k)[1]
  counts = param_counts(c, b_plan)
  busbw = hardware.link_busbw(b_plan.tp * b_plan.dp, b_hw)
  scatter = hardware.collective_seconds(counts.stage * 4, b_plan.dp, busbw, "reduce_scatter")
  backward = (compute + layers * (b_tp_backward + again * b_tp_forward) + b_tp_head[1]
              + hardware.overlapped_seconds(scatter, pipelined(layers, scatter / layers, compute / layers)))

  transfer = _link_seconds(memory.fbd_residual_bytes(c, plan.whole, remat), plan)
  weights_bytes = param_counts(c, plan.whole).gathered_bytes(c.compute_dtype.itemsize, c.param_dtype.itemsize)
  weights = _link_seconds(weights_bytes * plan.forward.dp, plan)     # each forward dp replica its copy
  optimizer = hardware.streaming_seconds(counts.shard * (OPTIMIZER_BYTES + 8), b_hw, k.hbm_efficiency)

  m = plan.microbatches
  stages = (forward, transfer, backward)
  rest = weights + sum(stages) + (m - 1) * max(stages) + optimizer
  gpus = plan.forward.gpus + plan.backward.gpus
  straggler = rest * k.straggler_slowdown * hardware.slow_machine_chance(gpus, b_hw)
  peak = (plan.forward.gpus * f_hw.peak_tflops + plan.backward.gpus * b_hw.peak_tflops) * 1e12
  mfu = flops.training_flops_per_token(c) * plan.batch * c.seq_len / ((rest + straggler) * peak)
  return FbdTime(forward, transfer, backward, weights, optimizer, straggler, m, mfu)


def fbd_memory(c: ModelConfig, plan: FbdPlan, remat: str | None = None) -> tuple[float, float]:
  """(bytes a forward device holds, bytes a backward device holds)."""
  c = apply_switches(c, FBD_SWITCHES)
  remat = remat or c.remat
  f_plan, b_plan = plan.group_plan(plan.forward), plan.group_plan(plan.backward)
  residuals = memory.fbd_residual_bytes(c, plan.whole, remat)
  weights = param_counts(c, f_plan).gathered_bytes(c.compute_dtype.itemsize, c.param_dtype.itemsize)
  forward = weights + 2 * residuals / plan.forward.gpus
  backward = memory.memory(c, b_plan, remat).total + residuals / plan.backward.gpus
  return forward, backward


def assess(c: ModelConfig, plan: FbdPlan, remat: str | None = None) -> FbdCandidate:
  forward, backward = fbd_memory(c, plan, remat)
  margin = 1 + memory.ESTIMATE_MARGIN      # both groups run megajax's step
  fits = forward * margin <= usable_bytes(plan.forward.hw) and backward * margin <= usable_bytes(plan.backward.hw)
  return FbdCandidate(plan, fbd_time(c, plan, remat), forward, backward, fits)


def _groups(c: ModelConfig, gpus: int, hw: Hardware) -> list[Group]:
  return [Group(hw, gpus // tp, tp) for tp in range(1, hw.gpus_per_node + 1)
          if hw.gpus_per_node % tp == 0 and gpus % tp == 0 and plans.tp_splits(c, tp)]


def search(c: ModelConfig, forward_hw: Hardware, forward_gpus: int, backward_hw: Hardware, backward_gpus: int,
           batch: int, remat: str | None = None, max_micro_batch: int = 256) -> list[FbdCandidate]:
  """The MegaFBD plans that fit, fastest first: each group's tp (within a node, dividing what tp
  splits), the microbatch size (a multiple of both groups' dp dividing the batch)."""
  found = []
  for f, b in itertools.product(_groups(c, forward_gpus, forward_hw), _groups(c, backward_gpus, backward_hw)):
    for micro_batch in range(1, min(batch, max_micro_batch) + 1):
      if batch % micro_batch or micro_batch % f.dp or micro_batch % b.dp:
        continue
      candidate = assess(c, FbdPlan(f, b, micro_batch, batch), remat)
      if candidate.fits:
        found.append(candidate)
  return sorted(found, key=lambda x: x.time.total)


def describe(plan: FbdPlan) -> str:
  f, b = plan.forward, plan.backward
  return (f"forward {f.gpus} {f.hw.name} (dp {f.dp} x tp {f.tp}), backward {b.gpus} {b.hw.name} (dp {b.dp} x tp "
          f"{b.tp}), microbatch {plan.micro_batch} x {plan.microbatches}")


def config_overrides(plan: FbdPlan) -> str:
  f, b = plan.forward, plan.backward
  return (f"--config.parallel.fbd.enabled=True --config.parallel.fbd.forward_dp={f.dp} "
          f"--config.parallel.fbd.forward_tp={f.tp} --config.parallel.dp={b.dp} --config.parallel.pp=1 "
          f"--config.parallel.tp={b.tp} --config.train.batch_size={plan.batch} "
          f"--config.train.microbatches={plan.microbatches}")
