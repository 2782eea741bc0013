"""The MegaScale paper's experiments, predicted by the cost model next to the published MFU.

`table2` / `table3` run the cost model on the paper's experiments (175B, sequence 2048,
A100s) with the parallel configuration the paper states: tp = 8, pp = 8 (Table 1), six
virtual stages (section 6.1), dp = GPUs / 64. It does not state the microbatch size; we use 1
sequence (Megatron-LM's setting for GPT-3 175B) and say so in the output.
"""

from __future__ import annotations

import dataclasses
import os

from megajax.config import CONFIGS_DIR, load_config
from megajax.model import ModelConfig
from megajax.parallel.planner import cost_model
from megajax.parallel.planner.cost_model import CALIBRATION, MEGASCALE, MEGATRON, Calibration, Hardware, Optimizations, Plan
from megajax.parallel.planner.plans import Candidate, evaluate

# configs/ beside the installed package folders (an editable install, as the README sets up).


def paper_model() -> ModelConfig:
  """The paper's 175B (configs/gpt_175b.py, with MegaScale's sliding window)."""
  return ModelConfig.from_config(load_config(os.path.join(CONFIGS_DIR, "gpt_175b.py")).model)


def a100() -> Hardware:
  return cost_model.HARDWARE["a100-80g"]


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


def _row(name, c, plan, hw, published, calibration: Calibration) -> Row:
  candidate = evaluate(c, plan, hw, PAPER_REMAT, calibration)
  return Row(name, plan, 100 * candidate.time.mfu, published, candidate)


def table2(c: ModelConfig, hw: Hardware, calibration: Calibration = CALIBRATION) -> list[tuple[Row, Row]]:
  """(Megatron-LM row, MegaScale row) per GPU count."""
  return [(_row(f"{gpus}", c, paper_plan(gpus, batch, MEGATRON), hw, megatron, calibration),
           _row(f"{gpus}", c, paper_plan(gpus, batch, MEGASCALE), hw, megascale, calibration))
          for gpus, batch, megatron, megascale in TABLE2]


def table3(c: ModelConfig, hw: Hardware, calibration: Calibration = CALIBRATION) -> list[Row]:
  return [_row(name, c, paper_plan(256, batch, opts), hw, mfu, calibration) for name, opts, batch, mfu in TABLE3]


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
