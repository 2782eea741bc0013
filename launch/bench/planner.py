r"""`python -m megajax.launch.bench planner`: the planner's cost model against published runs
and against XLA.

Prints:
  micro-benchmarks  the measured numbers the step time is built from (hardware.py, cited there).
  calibration       the constants no micro-benchmark gives (cost_model.Calibration), refitted now
                    by least squares on the calibration set (MegaScale's Table 3) next to the
                    values CALIBRATION holds (the slow-machine slowdown: published), and each
                    calibration row's leave-one-out error (fitted without that row).
  validation        every published run of published.validation_set() (never fitted to), with
                    its source, what is assumed, predicted vs published and the error; goal:
                    within +-3 MFU points or +-6% TFLOP/s. Calibration rows shown marked "cal".
                    Per source, the mean and worst error; MegaScale Table 2's fall from 256 to
                    12,288 GPUs, published and predicted; every known miss with its reason.
  memory fit        memory.XLA_PIPELINE refitted now (memory_fit.fit) on XLA's bytes of the
                    pipeline fit set (memory_measured.py; --measure_memory recompiles them first
                    and rewrites it) next to the held values; the fit set's worst errors.
  memory            the cost model's bytes per device against XLA's memory analysis of the
                    real compiled training step on CPU devices, for configs the memory constants
                    were not fitted on; target: within 10%.
  memory on GPUs    memory.XLA_GPU (memory_gpu_fit) and memory.XLA_GPU_PIPELINE
                    (memory_gpu_pipeline_fit) refitted now on XLA:GPU's bytes of the single-stage
                    and pipeline fit sets, compiled for a described H100 (memory_measured_gpu*.py;
                    --measure_memory_gpu recompiles the fit sets and the held-out cases first and
                    rewrites them, ~35 min), and the held-out cases (the MFU suite's 1.3B and 3B
                    rows among them) predicted against XLA:GPU; target: within 10% of the 80 GB
                    bytes, or, for a case above its estimate by more, of a device it fits
                    (compiled again for one of 1.1 x the estimate).
  executors         megajax's step against the paper's at 256 and 12,288 GPUs (remat dots and
                    full): the best plan's MFU under each, the gap and its largest parts, and how
                    each megajax term is known (HLO-verified, read from the schedule, assumed).
  plan              the planner's best plans for 175B on 12,288 A100s.
"""

from __future__ import annotations


from megajax.parallel.planner import (calibration, explain, hardware, memory, memory_cpu_fit, memory_fit, memory_gpu_fit,
                                      memory_gpu_pipeline_fit, memory_measured, memory_measured_cpu,
                                      memory_measured_gpu, memory_measured_gpu_pipeline, plans, published)
from megajax.parallel.planner.cost_model import CALIBRATION, MEGASCALE


def print_measured() -> None:
  hw = hardware.HARDWARE["a100-80g"]
  print("\n== micro-benchmarks (published, cited in parallel/planner/hardware.py; not fitted)")
  print(f"  GEMM: {hardware.MEASURED_GEMM_FRACTION:.1%} of peak at {hardware.MEASURED_GEMM_SHAPE[0]} x "
        f"{hardware.MEASURED_GEMM_SHAPE[1]} outputs ({hardware.FULL_WAVE_GEMM_FRACTION:.1%} for full waves of "
        f"{hardware.GEMM_TILE[0]} x {hardware.GEMM_TILE[1]} tiles on {hw.sms} SMs)")
  print(f"  FlashAttention-2 forward + backward: {hardware.FLASH_ATTENTION_FRACTION:.0%} of peak")
  print(f"  NCCL bus bandwidth: {hw.nvlink_busbw_gbps:g} GB/s in a node, {hw.nic_busbw_gbps:g} GB/s per GPU "
        f"between nodes; {hardware.COLLECTIVE_LATENCY_S * 1e6:g} us latency")
  print(f"  compute under a hidden collective: {hardware.OVERLAP_SLOWDOWN:.1%} slower (Lee et al. 2025)")
  print(f"  slow machines: {hardware.SLOW_MACHINE_FRACTION:.1%} of them (MegaScale section 5.1): a job holds one with "
        + ", ".join(f"{hardware.slow_machine_chance(gpus, hw):.0%} on {gpus}" for gpus in (8, 256, 1024, 3072, 12288))
        + f" GPUs; such a machine {hardware.SLOW_MACHINE_SLOWDOWN:.0%} slower (section 6.3)")


def print_fit() -> None:
  fitted = calibration.fit_calibration()
  runs = published.calibration_set()
  print("\n== calibration: cost_model.Calibration refitted now on the calibration set (MegaScale Table 3: "
        f"{len(runs)} rows) vs CALIBRATION")
  for name in calibration.FITTED:
    print(f"  {name:20} fitted {getattr(fitted, name):10.4g}   held {getattr(CALIBRATION, name):10.4g}")
  print(f"  {'straggler_slowdown':20} not fitted: {CALIBRATION.straggler_slowdown:.3g} (MegaScale section 6.3's "
        "measured slow hosts, hardware.SLOW_MACHINE_SLOWDOWN)")
  print(f"{'calibration row':48} {'error':>7} {'leave-one-out':>14}")
  for run, error, held_out in calibration.leave_one_out():
    print(f"{run.where:48} {error:>+6.1f} {held_out:>+14.1f}")


def print_validation() -> bool:
  print("\n== validation: published A100 runs the fit never saw (MFU %, or TFLOP/s per GPU by the source's "
        "count); goal: within +-3 points or +-6%")
  rows = [published.predict(run) for run in published.all_runs()]
  for source, citation in published.SOURCES.items():
    print(f"-- {source}: {citation}")
    print(f"   {'run':64} {'metric':>6} {'published':>9} {'predicted':>9} {'error':>7} {'if assumed otherwise':>21}"
          f"  bottleneck; assumed")
    for row in (r for r in rows if r.run.source == source):
      run, mark = row.run, " cal" if row.run.calibration else ("" if row.within_goal else " !")
      low, high = published.error_range(run)
      spread = f"{low:+.1f} .. {high:+.1f}" if run.alternatives else ""
      print(f"   {run.where:64} {run.metric:>6} {run.published:>9.1f} {row.predicted:>9.1f} {row.error:>+6.1f}"
            f"{'' if run.metric == 'mfu' else '%'}{mark:4} {spread:>17} {row.candidate.time.bottleneck}"
            f"{'; ' + run.assumed if run.assumed else ''}")
  validation = [r for r in rows if not r.run.calibration]
  print("per source (validation rows only): mean error, worst")
  for source in published.SOURCES:
    rows = [r for r in validation if r.run.source == source]
    errors, unit = [r.error for r in rows], " points" if rows[0].run.metric == "mfu" else "%"
    print(f"  {source:12} {len(errors):3} rows  mean {sum(errors) / len(errors):+5.1f}{unit}  worst "
          f"{max(errors, key=abs):+5.1f}{unit}")
  print(f"MegaScale Table 2's fall in MFU from 256 to 12,288 GPUs (goal: predicted within "
        f"{published.SLOPE_GOAL_POINTS:g} points of published):")
  for system, (fall, predicted) in published.scale_slope().items():
    met = abs(predicted - fall) <= published.SLOPE_GOAL_POINTS
    print(f"  {system:12} published {fall:+5.1f}  predicted {predicted:+5.1f}  off by {predicted - fall:+4.1f}"
          f"{'' if met else '  (goal NOT MET)'}")
  print("known misses (published.KNOWN_MISSES):")
  for row in (r for r in validation if not r.within_goal):
    print(f"  {row.run.where}: {published.KNOWN_MISSES.get(row.run.where, 'NO REASON GIVEN')}")
  within = sum(r.within_goal for r in validation)
  ok = within == len(validation)
  print(f"target: every validation row within goal: {'met' if ok else 'NOT MET'} ({within} of {len(validation)})")
  return ok


def print_memory_fit(measure: bool) -> None:
  measured, single_stage, held_out = memory_measured.MEASURED, memory_measured_cpu.FIT, memory_measured_cpu.HELD_OUT
  if measure:
    measured = memory_fit.measure()
    memory_fit.write_measured(memory_measured.__file__, measured)
    single_stage = memory_fit.measure(memory_cpu_fit.CPU_FIT_CASES)
    held_out = memory_fit.measure(calibration.MEMORY_CASES)
    memory_cpu_fit.write_measured(memory_measured_cpu.__file__, single_stage, held_out)
    print(f"\n(measured {len(measured)} pipeline, {len(single_stage)} single-stage and {len(held_out)} held-out "
          f"cases; wrote {memory_measured.__file__} and {memory_measured_cpu.__file__})")
  fitted, errors = memory_fit.fit(measured)
  print(f"\n== memory fit: memory.XLA_PIPELINE refitted now on XLA's bytes of {len(errors)} pipeline configs "
        "(memory_fit.PIPELINE_FIT_CASES; none of them a memory-check case)")
  print_fitted(fitted, memory.XLA_PIPELINE, errors)
  fitted, errors = memory_cpu_fit.fit(single_stage)
  print(f"\n== memory fit: memory.XLA_CPU refitted now on XLA:CPU's bytes of {len(errors)} single-stage configs "
        "(memory_cpu_fit.CPU_FIT_CASES, fp32 and bf16; none of them a memory-check case)")
  print_fitted(fitted, memory.XLA_CPU, errors)


def print_fitted(fitted: dict[str, float], held: dict[str, float], errors: dict[str, float]) -> None:
  """A memory fit: each weight refitted now beside the value held, and the fit set's errors."""
  for name, value in fitted.items():
    print(f"  {name:15} fitted {value:6.3f}   held {held[name]:6.3f}")
  worst = sorted(errors.items(), key=lambda item: -abs(item[1]))
  within = sum(abs(e) <= calibration.MEMORY_TOLERANCE for e in errors.values())
  print(f"fit set: {within} of {len(errors)} within {calibration.MEMORY_TOLERANCE:.0%}; "
        f"rms {100 * (sum(e * e for e in errors.values()) / len(errors)) ** 0.5:.1f}%; worst:")
  for name, error in worst[:5]:
    print(f"  {name:56} {100 * error:+6.1f}%")


def print_memory_check() -> bool:
  print("\n== memory: cost model vs XLA's memory analysis of the compiled train step, held-out configs (CPU "
        f"devices, jax {memory_measured_cpu.JAX_VERSION}: memory_measured_cpu.HELD_OUT; --measure_memory "
        "compiles them again; fp32 and remat none unless the case says)")
  print(f"{'case':78} {'predicted MB':>13} {'XLA MB':>9} {'error':>8}")
  ok = True
  for case in calibration.MEMORY_CASES:
    predicted = calibration.predicted_bytes(calibration.memory_case_config(case))
    measured = memory_measured_cpu.HELD_OUT[case.name]
    error = predicted / measured - 1
    within = abs(error) <= calibration.MEMORY_TOLERANCE
    ok &= within
    print(f"{case.name:78} {predicted / 1e6:>13.2f} {measured / 1e6:>9.2f} {100 * error:>+7.1f}%"
          f"{'' if within else ' ! ' + calibration.MEMORY_KNOWN_MISSES.get(case.name, '')}")
  print(f"target: within {calibration.MEMORY_TOLERANCE:.0%}: {'met' if ok else 'NOT MET'}")
  return ok


def print_gpu_memory(measure: bool) -> bool:
  """The single stage's and the pipeline's GPU memory fits and their held-out cases."""
  ok = True
  for name, module, data, weights, fit_cases, held_out, known_misses in (
      ("XLA_GPU", memory_gpu_fit, memory_measured_gpu, memory.XLA_GPU, memory_gpu_fit.GPU_FIT_CASES,
       memory_gpu_fit.GPU_HELD_OUT, memory_gpu_fit.GPU_KNOWN_MISSES),
      ("XLA_GPU_PIPELINE", memory_gpu_pipeline_fit, memory_measured_gpu_pipeline, memory.XLA_GPU_PIPELINE,
       memory_gpu_pipeline_fit.GPU_PIPELINE_FIT_CASES, memory_gpu_pipeline_fit.GPU_PIPELINE_HELD_OUT,
       memory_gpu_pipeline_fit.GPU_PIPELINE_KNOWN_MISSES)):
    fit_bytes, held_out_bytes, budgeted = data.FIT, data.HELD_OUT, data.BUDGETED
    if measure:
      print(f"\n(compiling the {name} memory cases for a described H100)")
      fit_bytes, held_out_bytes = memory_gpu_fit.measure(fit_cases), memory_gpu_fit.measure(held_out)
      budgeted = memory_gpu_fit.measure_under_budget(held_out, held_out_bytes)
      module.write_measured(data.__file__, fit_bytes, held_out_bytes, budgeted)
      print(f"(wrote {data.__file__})")
    fitted, errors = module.fit(fit_bytes)
    print(f"\n== memory on GPUs: memory.{name} refitted now on XLA:GPU's bytes of {len(errors)} configs "
          f"({module.__name__.rsplit('.', 1)[1]}, a described H100; jax {data.JAX_VERSION})")
    print_fitted(fitted, weights, errors)
    print(f"{'held out (never fitted on)':62} {'predicted GiB':>13} {'XLA:GPU GiB':>12} {'error':>8}   "
          f"more than 10% under: XLA:GPU compiled for a device of {memory_gpu_fit.BUDGET:.2f} x the estimate")
    for case in held_out:
      predicted, measured = memory_gpu_fit.predicted_bytes(case), held_out_bytes[case.name]
      within = memory_gpu_fit.within(case.name, predicted, measured, budgeted)
      ok &= within
      device = ""
      if case.name in budgeted:
        size, held = budgeted[case.name]
        device = f"   {held / 2**30:.2f} GiB on a {size / 2**30:.2f} GiB device: {'fits' if held <= size else 'does not fit'}"
      miss = "" if within else f" ! {known_misses.get(case.name, 'not a known miss')}"
      print(f"{case.name:62} {predicted / 2**30:>13.2f} {measured / 2**30:>12.2f} {100 * (predicted / measured - 1):>+7.1f}%"
            f"{device}{miss}")
  print(f"target: within {calibration.MEMORY_TOLERANCE:.0%} (of the 80 GB bytes, or of the device an under-predicted "
        f"case fits): {'met' if ok else 'NOT MET'}")
  return ok


def print_executor_gap(c, hw) -> None:
  """The best plan under each executor at MegaScale's smallest and largest Table 2 sizes, the
  gap in MFU points and the parts that make it; how each megajax term is known."""
  print(f"\n== executors: megajax's step against the paper's (Megatron-LM with MegaScale's switches), as the cost "
        f"model has them; 175B on {hw.name}, the best plan of each")
  print(f"{'GPUs':>6} {'batch':>6} {'remat':>6} {'megajax':>8} {'paper':>7} {'gap':>6}  where megajax's best step spends "
        "more (its parts minus the paper's best)")
  for gpus, batch in ((256, 768), (12288, 6144)):
    for remat in ("dots", "full"):
      ours, theirs = (plans.search(c, gpus, batch, hw, MEGASCALE, executor, remat)[0][0]
                      for executor in ("megajax", "paper"))
      deltas = {k: v - theirs.time.parts()[k] for k, v in ours.time.parts().items()}
      largest = sorted(deltas, key=lambda k: -abs(deltas[k]))[:3]
      print(f"{gpus:>6} {batch:>6} {remat:>6} {100 * ours.time.mfu:>7.1f}% {100 * theirs.time.mfu:>6.1f}% "
            f"{100 * (ours.time.mfu - theirs.time.mfu):>+6.1f}  " + ", ".join(f"{k} {deltas[k]:+.2f} s" for k in largest)
            + f" (step {ours.time.total - theirs.time.total:+.2f} s)")
  print("how the megajax executor's terms are known:")
  for term, known in explain.MEGAJAX_TERMS:
    print(f"  {term}: {known}")
  print("both executors alike: the compute under every hidden collective "
        f"{hardware.OVERLAP_SLOWDOWN:.1%} slower (published, assumed for XLA:GPU's schedule too) and the wait for "
        "a slow machine (a property of the cluster: MegaScale's 0.5% of machines, 10% slower, sections 5.1 and 6.3)")


def print_best_plans(c, hw, gpus=12288, batch=6144, top=5) -> None:
  for executor, remat in (("paper", "dots"), ("megajax", c.remat)):
    best, total = plans.search(c, gpus, batch, hw, executor=executor, remat=remat)
    print(f"\n== plan: 175B on {gpus} {hw.name}, batch {batch}, MegaScale switches, {executor} executor, "
          f"remat {remat} ({len(best)} of {total} even plans fit)")
    print(plans.PLAN_HEADER)
    for i, x in enumerate(best[:top], 1):
      print(plans.plan_line(i, x))
    if best:
      print(f"best: {plans.breakdown(best[0].time)}")


def planner(measure_memory: bool = False, measure_memory_gpu: bool = False) -> bool:
  """Everything above; True when every target is met."""
  print_measured()
  print_fit()
  ok = print_validation()
  print_memory_fit(measure_memory)
  ok &= print_memory_check()
  ok &= print_gpu_memory(measure_memory_gpu)
  print_executor_gap(published.megascale_model(), hardware.HARDWARE["a100-80g"])
  print_best_plans(published.megascale_model(), hardware.HARDWARE["a100-80g"])
  return ok
