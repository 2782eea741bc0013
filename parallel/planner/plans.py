"""The search: every (dp, pp, cp, tp, v, microbatch size) plan, by the cost model.

`search` enumerates the plans that divide evenly (tp within a node and dividing heads, KV
heads, MLP width, vocabulary and sequence; megajax's cp cutting the rows into 2 cp chunks
split over tp, a sliding window reaching one chunk back at most, and each device holding
MIN_CONTEXT_SHARD positions of a row or more; pp * v dividing the layers; the global batch
divisible by dp x microbatch size; interleaving needs the microbatches in groups of pp),
drops those that do not fit in memory and sorts the rest by predicted MFU.
"""

from __future__ import annotations

import dataclasses

from megajax.model import ModelConfig
from megajax.parallel.context_parallel import uses_dual_chunks
from megajax.parallel.planner import cost_model, memory
from megajax.parallel.planner.cost_model import CALIBRATION, MEGASCALE, Calibration, Hardware, Optimizations, Plan
from megajax.parallel.planner.memory import Memory


@dataclasses.dataclass(frozen=True)
class Candidate:
  plan: Plan
  memory: Memory
  time: cost_model.StepTime
  fits: bool            # the memory fits the device (cost_model.usable_bytes, the estimate raised by memory.estimate_margin)


def assess(c: ModelConfig, plan: Plan, hw: Hardware, remat: str | None = None,
             calibration: Calibration = CALIBRATION) -> Candidate:
  mem = memory.memory(c, plan, remat)
  return Candidate(plan, mem, cost_model.step_time(c, plan, hw, remat, calibration),
                   mem.total * (1 + memory.estimate_margin(plan)) <= cost_model.usable_bytes(hw))


# cp splits a row no finer than this many positions a device: below it a ring step's attention is
# too short to hide its send, and the search would grow by every divisor of the GPU count.
MIN_CONTEXT_SHARD = 1024


def _divisors(n: int) -> list[int]:
  return [k for k in range(1, n + 1) if n % k == 0]


def cp_splits(c: ModelConfig, tp: int, cp: int) -> bool:
  """megajax's context parallelism (megajax.config's checks): rows cut into 2 cp chunks split
  over tp, a window at most one chunk + 1 (one shard + 1 with no global layer), and rows of
  MIN_CONTEXT_SHARD positions a device."""
  if cp == 1:
    return True
  run = c.seq_len // (2 * cp) if uses_dual_chunks(c) else c.seq_len // cp    # a rank's chunks, else its shard
  local = any(c.layer_window(i) is not None for i in range(c.num_layers))
  return (c.seq_len % (2 * cp * tp) == 0 and c.seq_len // cp >= MIN_CONTEXT_SHARD
          and (not local or c.window <= run + 1))


def tp_splits(c: ModelConfig, tp: int) -> bool:
  """Tensor (+ sequence) parallelism splits heads, KV heads, MLP units, vocabulary and sequence."""
  return all(x % tp == 0 for x in (c.num_heads, c.num_kv_heads, c.mlp_dim, c.vocab_size, c.seq_len))


def enumerate_plans(c: ModelConfig, gpus: int, batch: int, hw: Hardware, opts: Optimizations = MEGASCALE,
                    executor: str = "megajax", max_micro_batch: int = 16):
  """Every plan for `gpus` devices that divides evenly (see the module docstring), with
  microbatches of 1 to `max_micro_batch` sequences."""
  switched = cost_model.apply_switches(c, opts)
  for tp in _divisors(hw.gpus_per_node):
    if gpus % tp or not tp_splits(c, tp):
      continue
    for cp in _divisors(gpus // tp) if executor == "megajax" else [1]:
      if not cp_splits(switched, tp, cp):
        continue
      for pp in _divisors(c.num_layers):
        if (gpus // (tp * cp)) % pp:
          continue
        dp = gpus // (tp * cp * pp)
        for v in _divisors(c.num_layers // pp) if pp > 1 else [1]:
          for b in _divisors(batch // dp) if batch % dp == 0 else []:
            m = batch // (dp * b)
            if b > max_micro_batch or (v > 1 and m % pp):
              continue
            yield Plan(dp, pp, tp, v, b, batch, opts, executor, cp=cp)


def assess_fitting(c: ModelConfig, plan: Plan, hw: Hardware, remat: str | None = None,
                     calibration: Calibration = CALIBRATION) -> Candidate:
  """`assess`, and for a megajax pipeline whose residuals do not fit, the same plan with
  parallel.pipeline_recompute (the chunk's forward rerun in its backward: less memory, a
  forward more per step) when that fits. The plan as given otherwise."""
  candidate = assess(c, plan, hw, remat, calibration)
  if candidate.fits or plan.executor != "megajax" or plan.pp == 1 or plan.pipeline_recompute:
    return candidate
  rerun = assess(c, dataclasses.replace(plan, pipeline_recompute=True), hw, remat, calibration)
  return rerun if rerun.fits else candidate


def search(c: ModelConfig, gpus: int, batch: int, hw: Hardware, opts: Optimizations = MEGASCALE,
           executor: str = "megajax", remat: str | None = None,
           calibration: Calibration = CALIBRATION) -> tuple[list[Candidate], int]:
  """(the plans that fit, best predicted MFU first; how many divided evenly). megajax's
  pipelines keep their residuals (the default executor) where they fit and rerun each
  chunk's forward (pipeline_recompute) where only that fits (`assess_fitting`)."""
  candidates = [assess_fitting(c, plan, hw, remat, calibration)
                for plan in enumerate_plans(c, gpus, batch, hw, opts, executor)]
  fitting = [x for x in candidates if x.fits]
  return sorted(fitting, key=lambda x: -x.time.mfu), len(candidates)


# --- Printing ---------------------------------------------------------------------------------

def describe(plan: Plan) -> str:
  return (f"dp={plan.dp} pp={plan.pp} " + (f"cp={plan.cp} " if plan.cp > 1 else "")
          + f"tp={plan.tp} v={plan.virtual_stages} b={plan.micro_batch} "
          f"m={plan.microbatches}" + (" pipeline_recompute" if plan.pipeline_recompute else ""))


def config_overrides(plan: Plan) -> str:
  """The plan as megajax-train flags (the global batch and microbatches from it)."""
  flags = [f"--config.parallel.dp={plan.dp}", f"--config.parallel.pp={plan.pp}", f"--config.parallel.tp={plan.tp}",
           f"--config.parallel.virtual_stages={plan.virtual_stages}", f"--config.train.batch_size={plan.batch}",
           f"--config.train.microbatches={plan.microbatches}"]
  if plan.cp > 1:
    flags.append(f"--config.parallel.cp={plan.cp}")
  if plan.pipeline_recompute:
    flags.append("--config.parallel.pipeline_recompute=True")
  return " ".join(flags)


PLAN_HEADER = (f"{'#':>2} {'dp':>5} {'pp':>3} {'cp':>3} {'tp':>3} {'v':>3} {'b':>3} {'m':>5} {'memory GB':>10} "
               f"{'step s':>8} {'MFU':>6} {'bubble':>7}  bottleneck")


def plan_line(i: int, x: Candidate) -> str:
  p, t = x.plan, x.time
  return (f"{i:>2} {p.dp:>5} {p.pp:>3} {p.cp:>3} {p.tp:>3} {p.virtual_stages:>3} {p.micro_batch:>3} {p.microbatches:>5} "
          f"{x.memory.total / cost_model.GB:>10.1f} {t.total:>8.2f} {100 * t.mfu:>5.1f}% "
          f"{p.bubble_fraction:>7.3f}  {t.bottleneck}" + ("; pipeline_recompute" if p.pipeline_recompute else ""))


def breakdown(t: cost_model.StepTime) -> str:
  parts = [("gemm", t.gemm), ("attention", t.attention), ("memory-bound", t.memory_bound), ("tp", t.tp_comm),
           ("cp", t.cp_comm), ("pp", t.pp_comm), ("bubble", t.bubble), ("dp", t.dp_comm), ("optimizer", t.optimizer),
           ("data", t.data), ("stragglers", t.straggler)]
  return ", ".join(f"{name} {seconds:.2f}" for name, seconds in parts) + f" (recompute {t.recompute:.2f}) s"
