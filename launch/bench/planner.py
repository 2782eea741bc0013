r"""`python -m megajax.launch.bench planner`: the planner's cost model against the MegaScale paper
and against XLA.

Prints:
  calibration  the step-time constants (cost_model.Calibration) refitted by least squares now:
               eight to Table 3 (256 GPUs), then scale_loss to Table 2 with those fixed; next
               to the values CALIBRATION holds.
  table 3      175B on 256 A100s, batch 256: the cumulative ablation rows, predicted MFU
               and increment next to the published ones; targets: every row above the
               one before, every increment within 2 points.
  table 2      175B strong scaling, 256 to 12,288 A100s (batch 768, then 6144), Megatron-LM
               and MegaScale rows; target: every MFU within 5 points.
  memory       the cost model's bytes per device against XLA's memory analysis of the
               real compiled training step on CPU devices, for configs the memory constants
               were not fitted on; target: within 10%.
  plan         the planner's best plans for 175B on 12,288 A100s.
"""

from __future__ import annotations

import dataclasses

from megajax.parallel.planner import calibration, paper
from megajax.parallel.planner import plans
from megajax.parallel.planner.cost_model import CALIBRATION


def print_fit(c, hw) -> None:
  fitted = calibration.fit(c, hw)
  print("\n== calibration: cost_model.Calibration refitted now vs CALIBRATION "
        "(Table 3 fits the first eight, Table 2 scale_loss)")
  for field in dataclasses.fields(fitted):
    print(f"  {field.name:28} fitted {getattr(fitted, field.name):10.4g}   "
          f"held {getattr(CALIBRATION, field.name):10.4g}")


def print_table3(c, hw) -> bool:
  rows = paper.table3(c, hw)
  monotone, increments_ok = paper.table3_met(rows)
  print(f"\n== Table 3: 175B on 256 A100s, batch 256 (x3 with LAMB), tp={paper.PAPER_TP} pp={paper.PAPER_PP} "
        f"v={paper.PAPER_V} (paper), microbatch {paper.PAPER_MICRO_BATCH} (assumed), Megatron-LM's runtime")
  print(f"{'row':24} {'predicted':>10} {'paper':>7} {'error':>7} {'increment':>10} {'paper':>7} {'error':>7}  bottleneck")
  increments = [""] + [f"{ours:>+10.1f} {theirs:>+7.1f} {ours - theirs:>+7.1f}"
                        f"{'' if abs(ours - theirs) <= paper.TABLE3_INCREMENT_TOLERANCE else ' !'}"
                        for ours, theirs in paper.table3_increments(rows)]
  for row, increment in zip(rows, increments):
    print(f"{row.name:24} {row.predicted:>9.1f}% {row.published:>6.1f}% {row.error:>+7.1f} {increment:<35} "
          f"{row.candidate.time.bottleneck}")
  print(f"target: rows increase monotonically: {'met' if monotone else 'NOT MET'}; every increment within "
        f"+-{paper.TABLE3_INCREMENT_TOLERANCE:g} points: {'met' if increments_ok else 'NOT MET'}")
  return monotone and increments_ok


def print_table2(c, hw) -> bool:
  rows = paper.table2(c, hw)
  print(f"\n== Table 2: 175B strong scaling on A100s, tp={paper.PAPER_TP} pp={paper.PAPER_PP} v={paper.PAPER_V} "
        f"(paper), dp = GPUs / 64, microbatch {paper.PAPER_MICRO_BATCH} (assumed)")
  print(f"{'GPUs':>6} {'batch':>6} | {'Megatron-LM':>11} {'paper':>6} {'error':>6} | {'MegaScale':>9} {'paper':>6} "
        f"{'error':>6} | {'step s':>6} {'paper':>6} | MegaScale bottleneck")
  paper_steps = {256: 32.0, 512: 16.5, 768: 11.5, 1024: 8.9, 3072: 23.66, 6144: 12.21, 8192: 9.56, 12288: 6.34}
  for megatron, megascale in rows:
    p = megascale.plan
    marks = ["" if abs(r.error) <= paper.TABLE2_TOLERANCE else " !" for r in (megatron, megascale)]
    print(f"{p.gpus:>6} {p.batch:>6} | {megatron.predicted:>10.1f}% {megatron.published:>5.1f}% "
          f"{megatron.error:>+6.1f}{marks[0]:2}| {megascale.predicted:>8.1f}% {megascale.published:>5.1f}% "
          f"{megascale.error:>+6.1f}{marks[1]:2}| {megascale.candidate.time.total:>6.2f} {paper_steps[p.gpus]:>6.2f} | "
          f"{megascale.candidate.time.bottleneck}")
  worst = max(abs(r.error) for pair in rows for r in pair)
  met = paper.table2_met(rows)
  print(f"target: every MFU within +-{paper.TABLE2_TOLERANCE:g} points: {'met' if met else 'NOT MET'} "
        f"(largest error {worst:.1f})")
  return met


def print_memory_check() -> bool:
  print("\n== memory: cost model vs XLA's memory analysis of the compiled train step (CPU, fp32, remat none)")
  print(f"{'case':38} {'predicted MB':>13} {'XLA MB':>9} {'error':>8}")
  ok = True
  for name, predicted, measured in calibration.memory_check():
    if measured is None:   # the dispatcher asks for 8 host devices before jax starts
      print(f"{name:38} {predicted / 1e6:>13.2f}   (skipped: this process has too few devices)")
      continue
    error = predicted / measured - 1
    ok &= abs(error) <= calibration.MEMORY_TOLERANCE
    print(f"{name:38} {predicted / 1e6:>13.2f} {measured / 1e6:>9.2f} {100 * error:>+7.1f}%")
  print(f"target: within {calibration.MEMORY_TOLERANCE:.0%}: {'met' if ok else 'NOT MET'}")
  return ok


def print_best_plans(c, hw, gpus=12288, batch=6144, top=5) -> None:
  for executor, remat in (("paper", paper.PAPER_REMAT), ("megajax", c.remat)):
    best, total = plans.search(c, gpus, batch, hw, executor=executor, remat=remat)
    print(f"\n== plan: 175B on {gpus} {hw.name}, batch {batch}, MegaScale switches, {executor} runtime, "
          f"remat {remat} ({len(best)} of {total} even plans fit)")
    print(plans.PLAN_HEADER)
    for i, x in enumerate(best[:top], 1):
      print(plans.plan_line(i, x))
    if best:
      print(f"best: {plans.breakdown(best[0].time)}")


def planner() -> bool:
  """Everything above; True when every target is met."""
  c, hw = paper.paper_model(), paper.a100()
  print_fit(c, hw)
  ok = print_table3(c, hw)
  ok &= print_table2(c, hw)
  ok &= print_memory_check()
  print_best_plans(c, hw)
  return ok
