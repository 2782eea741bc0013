"""The planner: search (dp, pp, tp, v, microbatch size) with the cost model, and the paper's
tables predicted side by side with the published MFU.

`search` enumerates the plans that divide evenly (tp within a node and dividing heads, KV
heads, MLP width, vocabulary and sequence; pp * v dividing the layers; the global batch
divisible by dp x microbatch size; interleaving needs the microbatches in groups of pp),
drops those that do not fit in memory and sorts the rest by predicted MFU.

`table2` / `table3` run the cost model on the MegaScale paper's experiments (175B, sequence
2048, A100s) with the parallel configuration the paper states: tp = 8, pp = 8 (Table 1),
six virtual stages (section 6.1), dp = GPUs / 64. It does not state the microbatch size;
we use 1 sequence (Megatron-LM's setting for GPT-3 175B) and say so in the output.
"""

from __future__ import annotations

import dataclasses

from megajax.model import ModelConfig
from megajax.parallel import cost_model
from megajax.parallel.cost_model import MEGASCALE, MEGATRON, Hardware, Optimizations, Plan


@dataclasses.dataclass(frozen=True)
class Candidate:
  plan: Plan
  memory: cost_model.Memory
  time: cost_model.StepTime
  fits: bool            # the memory fits the device (cost_model.usable_bytes)


def evaluate(c: ModelConfig, plan: Plan, hw: Hardware, remat: str | None = None) -> Candidate:
  mem = cost_model.memory(c, plan, remat)
  return Candidate(plan, mem, cost_model.step_time(c, plan, hw, remat), mem.total <= cost_model.usable_bytes(hw))


def _divisors(n: int) -> list[int]:
  return [k for k in range(1, n + 1) if n % k == 0]


def tp_splits(c: ModelConfig, tp: int) -> bool:
  """Tensor (+ sequence) parallelism splits heads, KV heads, MLP units, vocabulary and sequence."""
  return all(x % tp == 0 for x in (c.num_heads, c.num_kv_heads, c.mlp_dim, c.vocab_size, c.seq_len))


def enumerate_plans(c: ModelConfig, gpus: int, batch: int, hw: Hardware, opts: Optimizations = MEGASCALE,
                    executor: str = "megajax", max_micro_batch: int = 16):
  """Every plan for `gpus` devices that divides evenly (see the module docstring), with
  microbatches of 1 to `max_micro_batch` sequences."""
  for tp in _divisors(hw.gpus_per_node):
    if gpus % tp or not tp_splits(c, tp):
      continue
    for pp in _divisors(c.num_layers):
      if (gpus // tp) % pp:
        continue
      dp = gpus // (tp * pp)
      for v in _divisors(c.num_layers // pp) if pp > 1 else [1]:
        for b in _divisors(batch // dp) if batch % dp == 0 else []:
          m = batch // (dp * b)
          if b > max_micro_batch or (v > 1 and m % pp):
            continue
          yield Plan(dp, pp, tp, v, b, batch, opts, executor)


def search(c: ModelConfig, gpus: int, batch: int, hw: Hardware, opts: Optimizations = MEGASCALE,
           executor: str = "megajax", remat: str | None = None) -> tuple[list[Candidate], int]:
  """(the plans that fit, best predicted MFU first; how many divided evenly)."""
  candidates = [evaluate(c, plan, hw, remat) for plan in enumerate_plans(c, gpus, batch, hw, opts, executor)]
  fitting = [x for x in candidates if x.fits]
  return sorted(fitting, key=lambda x: -x.time.mfu), len(candidates)


# --- The paper's tables --------------------------------------------------------------------

# Table 2 (175B, strong scaling): (GPUs, batch, Megatron-LM MFU, MegaScale MFU), in percent.
TABLE2 = [(256, 768, 53.0, 65.3), (512, 768, 49.9, 63.5), (768, 768, 46.7, 61.3), (1024, 768, 44.7, 59.0),
          (3072, 6144, 48.7, 59.1), (6144, 6144, 47.8, 57.3), (8192, 6144, 43.3, 54.9),
          (12288, 6144, 41.2, 55.2)]
# Table 3 (175B, 256 GPUs, batch 256): cumulative rows (name, switches on, batch, MFU %).
_STEPS = ("ptb", "swa", "tp_overlap", "pp_overlap", "dp_overlap", "fused_ops", "misc", "lamb")
_NAMES = ("baseline", "+PTB", "+SWA", "+TP overlap", "+PP overlap", "+DP overlap", "+efficient operators",
          "+misc", "+LAMB (batch x3)")
_TABLE3_MFU = (47.7, 52.3, 53.3, 55.5, 58.0, 59.5, 61.2, 62.3, 65.3)
TABLE3 = [(name, dataclasses.replace(MEGATRON, **{k: True for k in _STEPS[:i]}), 768 if i == 8 else 256, mfu)
          for i, (name, mfu) in enumerate(zip(_NAMES, _TABLE3_MFU))]
# The paper's parallel configuration for 175B (Table 1, section 6.1); microbatch size assumed.
PAPER_TP, PAPER_PP, PAPER_V, PAPER_MICRO_BATCH = 8, 8, 6, 1
PAPER_REMAT = "dots"    # Megatron-LM's selective recomputation: attention recomputed, matmuls kept
TABLE2_TOLERANCE, TABLE3_INCREMENT_TOLERANCE = 5.0, 2.0   # MFU points


def paper_plan(gpus: int, batch: int, opts: Optimizations) -> Plan:
  return Plan(gpus // (PAPER_TP * PAPER_PP), PAPER_PP, PAPER_TP, PAPER_V, PAPER_MICRO_BATCH, batch, opts, "paper")


@dataclasses.dataclass(frozen=True)
class Row:
  name: str
  plan: Plan
  predicted: float      # MFU, percent
  published: float
  candidate: Candidate

  @property
  def error(self) -> float:
    return self.predicted - self.published


def _row(name, c, plan, hw, published) -> Row:
  candidate = evaluate(c, plan, hw, PAPER_REMAT)
  return Row(name, plan, 100 * candidate.time.mfu, published, candidate)


def table2(c: ModelConfig, hw: Hardware) -> list[tuple[Row, Row]]:
  """(Megatron-LM row, MegaScale row) per GPU count."""
  return [(_row(f"{gpus}", c, paper_plan(gpus, batch, MEGATRON), hw, megatron),
           _row(f"{gpus}", c, paper_plan(gpus, batch, MEGASCALE), hw, megascale))
          for gpus, batch, megatron, megascale in TABLE2]


def table3(c: ModelConfig, hw: Hardware) -> list[Row]:
  return [_row(name, c, paper_plan(256, batch, opts), hw, mfu) for name, opts, batch, mfu in TABLE3]


def table2_met(rows) -> bool:
  return all(abs(r.error) <= TABLE2_TOLERANCE for pair in rows for r in pair)


def table3_increments(rows: list[Row]) -> list[tuple[float, float]]:
  """(predicted, published) MFU gain of each row over the one before."""
  return [(b.predicted - a.predicted, b.published - a.published) for a, b in zip(rows, rows[1:])]


def table3_met(rows: list[Row]) -> tuple[bool, bool]:
  """(monotone increasing, every increment within TABLE3_INCREMENT_TOLERANCE)."""
  increments = table3_increments(rows)
  return (all(p > 0 for p, _ in increments),
          all(abs(p - q) <= TABLE3_INCREMENT_TOLERANCE for p, q in increments))


# --- Printing ------------------------------------------------------------------------------

def describe(plan: Plan) -> str:
  return (f"dp={plan.dp} pp={plan.pp} tp={plan.tp} v={plan.virtual_stages} b={plan.micro_batch} "
          f"m={plan.microbatches}")


PLAN_HEADER = (f"{'#':>2} {'dp':>5} {'pp':>3} {'tp':>3} {'v':>3} {'b':>3} {'m':>5} {'memory GB':>10} "
               f"{'step s':>8} {'MFU':>6} {'bubble':>7}  bottleneck")


def plan_line(i: int, x: Candidate) -> str:
  p, t = x.plan, x.time
  return (f"{i:>2} {p.dp:>5} {p.pp:>3} {p.tp:>3} {p.virtual_stages:>3} {p.micro_batch:>3} {p.microbatches:>5} "
          f"{x.memory.total / cost_model.GB:>10.1f} {t.total:>8.2f} {100 * t.mfu:>5.1f}% "
          f"{p.bubble_fraction:>7.3f}  {t.bottleneck}")


def breakdown(t: cost_model.StepTime) -> str:
  parts = [("gemm", t.gemm), ("attention", t.attention), ("memory-bound", t.memory_bound), ("tp", t.tp_comm),
           ("pp", t.pp_comm), ("bubble", t.bubble), ("dp", t.dp_comm), ("optimizer", t.optimizer),
           ("overhead", t.overhead), ("stragglers", t.stragglers)]
  return ", ".join(f"{name} {seconds:.2f}" for name, seconds in parts) + f" (recompute {t.recompute:.2f}) s"
