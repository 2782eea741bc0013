r"""`python -m megajax.launch.bench step_costs [--repeats=20] [--quick]`: what the pipeline executor and the
dp gradient sync cost at run time, on CPU (8 host devices), side by side.

  flops       executed matmul FLOPs per step, summed over the devices, of the compiled
              gradient program (params, batch -> summed gradients) of a dp1-pp2-tp1 v=2
              interleaved 1F1B pipeline (m=4), its backward reading the forward's residuals
              (parallel.pipeline_recompute=False) or rerunning the forward (True), over the
              single-device step's, for remat none / dots / full. Counted from the compiled
              HLO (megajax.observe.hlo.executed_dot_flops: every loop body times its trip
              count, each pipeline slot's branch by how often the tables select it), not by
              XLA's cost_analysis (printed next to it), which counts a loop body once and a
              conditional as its costliest branch. Goal: residuals <= 1.02x for none and dots.
  dp sync     dp2-pp2-tp2 v=2 m=4, bf16 compute: the reduce-scatters, all-gathers and
              all-reduces over dp one step executes and their bytes per device, by dtype, for
              parallel.grad_sync="step" and "microbatch", next to the leaves they carry
              (in buckets, parallel.dp_bucket_mb), and where the pipeline moves them: the first
              chunk's rows and the shared leaves before / after the tick scan, the other
              chunks' in pieces in its head / tail ticks (executor.dp_edge_pieces). Goal:
              every gradient byte reduce-scattered once per step ("step"), the parameter
              gathers in bf16.
  step time   the compiled train step (train_step: gradients and optimizer), median seconds,
              residuals vs recompute on the pp2 v=2 pipeline, remat none and dots.
--quick: remat none and grad_sync="step" only, no step time (the smoke test's size).
  memory      XLA's temp bytes per device of the gradient program (memory_analysis), residuals
              vs recompute, next to the planner's estimate for the same config
              (megajax.parallel.planner.fits.estimate on CPU).
"""

from __future__ import annotations

import collections
import math
import re

import jax

from megajax.config import default_config, validate
from megajax.flops import training_flops_per_token
from megajax.launch.bench.timing import median_seconds
from megajax.launch.bench.train import CompiledStep
from megajax.model import ModelConfig
from megajax.observe.hlo import collective_counts, executed_dot_flops, pipeline_branch_weights, xla_cost
from megajax.parallel.pipeline.executor import dp_edge_pieces
from megajax.parallel.planner import fits
from megajax.trainer import build_parallel_step

MICROBATCHES, ROWS_PER_MICROBATCH = 4, 2
WAYS = {False: "residuals", True: "recompute"}     # parallel.pipeline_recompute


def _config(dp: int = 1, pp: int = 1, tp: int = 1, remat: str = "none", recompute: bool = False,
            compute_dtype: str = "float32", grad_sync: str = "step"):
  """4 layers (windowed, global), hidden 128, 128 tokens: seconds to compile. pp > 1: v=2
  interleaved 1F1B; the same microbatches and rows per device for every mesh."""
  c = default_config()
  c.model.num_layers, c.model.hidden_dim, c.model.num_heads, c.model.seq_len = 4, 128, 8, 128
  c.model.window, c.model.window_pattern, c.model.compute_dtype, c.model.remat = 64, "LG", compute_dtype, remat
  c.train.microbatches, c.train.batch_size = MICROBATCHES, dp * MICROBATCHES * ROWS_PER_MICROBATCH
  c.parallel.dp, c.parallel.pp, c.parallel.tp, c.parallel.tp_overlap = dp, pp, tp, "none"
  if pp > 1:
    c.parallel.virtual_stages, c.parallel.schedule = 2, "interleaved_1f1b"
  c.parallel.pipeline_recompute, c.parallel.grad_sync = recompute, grad_sync
  validate(c)
  return c


def _gradients(config, lowered_text: bool = False):
  """(the 3D step, its compiled (params, batch) -> summed gradients program[, the program as
  lowered: StableHLO, before XLA's passes])."""
  p = config.parallel
  parallel_step = build_parallel_step(config, jax.devices()[:p.dp * p.pp * p.tp])
  state, batch = parallel_step.abstract_inputs()
  lowered = parallel_step.summed_gradients().lower(state.params, batch)
  return (parallel_step, lowered.compile()) + ((lowered.as_text(),) if lowered_text else ())


def _executed_flops(parallel_step, compiled) -> float:
  """Executed matmul FLOPs of one run, summed over the devices (the per-device count is the
  mean over the stages: the branch weights average them)."""
  weights = pipeline_branch_weights(parallel_step.pipeline)
  return executed_dot_flops(compiled.as_text(), weights) * parallel_step.mesh.size


def _xla_flops(parallel_step, compiled) -> float:
  return xla_cost(compiled)["flops"] * parallel_step.mesh.size


def flops(remats: tuple) -> dict:
  """Prints the FLOPs table; returns the remat="none" pipelines' (step, compiled) for the memory figures."""
  model = _config().model
  tokens = _config().train.batch_size * model.seq_len
  print(f"\n== flops: executed matmul FLOPs per step, summed over devices, of the gradient program "
        f"(4 layers LG, hidden 128, seq 128, {MICROBATCHES} x {ROWS_PER_MICROBATCH} rows, fp32); "
        f"pipeline dp1-pp2-tp1 v=2 interleaved_1f1b vs one device")
  print(f"model FLOPs (megajax.flops, no recompute): "
        f"{training_flops_per_token(ModelConfig.from_config(model)) * tokens / 1e9:.4f} GFLOP")
  print(f"{'remat':6} {'1 device':>12} {'residuals':>12} {'recompute':>12} {'residuals/1':>12} "
        f"{'recompute/1':>12} {'XLA cost_analysis 1 / res / rec (GFLOP)':>41}")
  kept = {}
  for remat in remats:
    single = _gradients(_config(remat=remat))
    pipelines = {recompute: _gradients(_config(pp=2, remat=remat, recompute=recompute)) for recompute in WAYS}
    if remat == "none":
      kept = pipelines
    ours = [_executed_flops(*single)] + [_executed_flops(*pipelines[r]) for r in WAYS]
    xla = [_xla_flops(*single)] + [_xla_flops(*pipelines[r]) for r in WAYS]
    print(f"{remat:6} " + " ".join(f"{f / 1e9:>7.4f} GFLOP" for f in ours)
          + f" {ours[1] / ours[0]:>11.4f}x {ours[2] / ours[0]:>11.4f}x "
          + " / ".join(f"{f / 1e9:.4f}" for f in xla).rjust(41))
  return kept


def _dp_row(counts: dict, nbytes: dict, op: str, dtype: str) -> tuple[float, float]:
  keys = [k for k in counts if k[0] == op and k[1] == "dp" and k[3] == dtype]
  return sum(counts[k] for k in keys), sum(nbytes[k] for k in keys)


def dp_sync(grad_syncs: tuple) -> None:
  print("\n== dp sync: collectives over dp one step executes, per device (dp2-pp2-tp2 v=2 m=4, bf16 compute, "
        "gradient program)")
  print(f"{'grad_sync':10} {'op':15} {'dtype':6} {'count/step':>11} {'KiB/step':>10} {'leaves':>8}")
  for grad_sync in grad_syncs:
    parallel_step, compiled, lowered = _gradients(_config(2, 2, 2, compute_dtype="bfloat16", grad_sync=grad_sync),
                                                  lowered_text=True)
    text, mesh, weights = compiled.as_text(), parallel_step.mesh, pipeline_branch_weights(parallel_step.pipeline)
    counts = collective_counts(text, mesh, executed=True, by_dtype=True, branch_weights=weights)
    nbytes = collective_counts(text, mesh, executed=True, by_dtype=True, nbytes=True, branch_weights=weights)
    layouts = jax.tree.leaves(parallel_step.layouts, is_leaf=lambda x: hasattr(x, "dp_dim"))
    scattered = sum(layout.dp_dim is not None for layout in layouts)
    leaves = {"reduce-scatter": scattered, "all-reduce": len(layouts) - scattered, "all-gather": scattered}
    for op, dtype in sorted({(k[0], k[3]) for k in counts if k[1] == "dp"}):
      count, size = _dp_row(counts, nbytes, op, dtype)
      print(f"{grad_sync:10} {op:15} {dtype:6} {count:>11.2f} {size / 2**10:>10.1f} {leaves.get(op, ''):>8}")
    gathers = {k[3] for k in counts if k[:2] == ("all-gather", "dp")}
    # What the program asks for, before XLA's passes (every all_gather, tp's too: the dp ones
    # gather the parameters, tp's gather activations in the compute dtype).
    asked = collections.Counter(re.findall(r'"stablehlo.all_gather".*-> tensor<[\dx]*x?([a-z]+\d*)>', lowered))
    (gather_rows, gathers_at), (scatter_rows, scatters_at) = dp_edge_pieces(parallel_step.pipeline, mesh.shape["dp"], grad_sync)
    state, _ = parallel_step.abstract_inputs()
    shard_kib = sum(4 * math.prod(leaf.sharding.shard_shape(leaf.shape)) for leaf in jax.tree.leaves(state.params)) / 2**10
    print(f"{grad_sync:10} the other chunks' rows: gathered in {len(gathers_at)} head tick(s) of {gather_rows} row(s), "
          f"reduce-scattered in {len(scatters_at)} tail tick(s) of {scatter_rows}; the fp32 gradient shards: "
          f"{shard_kib:.1f} KiB per device")
    print(f"{grad_sync:10} {scattered} leaves reduce-scattered over dp, {len(layouts) - scattered} all-reduced "
          f"(no dp split); gathers over dp compiled in {', '.join(sorted(gathers)) or 'none'}; "
          f"all_gathers as lowered: {', '.join(f'{n} {t}' for t, n in sorted(asked.items()))}")


def step_time(repeats: int) -> None:
  print(f"\n== step time: the compiled train step, median of {repeats} on {jax.devices()[0].platform} "
        "(dp1-pp2-tp1 v=2 m=4, fp32)")
  print(f"{'remat':6} {'residuals':>11} {'recompute':>11} {'recompute / residuals':>22}")
  for remat in ("none", "dots"):
    seconds = {}
    for recompute, way in WAYS.items():
      step = CompiledStep(_config(pp=2, remat=remat, recompute=recompute), jax.devices()[:2])
      seconds[way] = median_seconds(step.run, repeats=repeats)
    print(f"{remat:6} {seconds['residuals'] * 1e3:>8.2f} ms {seconds['recompute'] * 1e3:>8.2f} ms "
          f"{seconds['recompute'] / seconds['residuals']:>21.3f}x")


def memory(pipelines: dict) -> None:
  print("\n== memory: temp bytes per device of the gradient program (XLA memory_analysis) vs the planner "
        "(fits.estimate, cpu: remat none), dp1-pp2-tp1 v=2 m=4, fp32")
  print(f"{'':10} {'XLA temp':>10} {'planner: activations+logits+pipeline':>37} {'params_temp':>12} {'total':>10}")
  for recompute, way in WAYS.items():
    _, compiled = pipelines[recompute]
    estimate = fits.estimate(_config(pp=2, remat="none", recompute=recompute), "cpu")   # the step's config
    mib = lambda n: f"{n / 2**20:.2f} MiB"
    print(f"{way:10} {mib(compiled.memory_analysis().temp_size_in_bytes):>10} "
          f"{mib(estimate.activations + estimate.logits + estimate.pipeline):>37} "
          f"{mib(estimate.params_temp):>12} {mib(estimate.total):>10}")


def step_costs(repeats: int, quick: bool = False) -> None:
  """quick=True: remat none and grad_sync="step" only, no step time (the smoke test's size)."""
  pipelines = flops(("none",) if quick else ("none", "dots", "full"))
  dp_sync(("step",) if quick else ("step", "microbatch"))
  if quick:
    print("\n== step time: not measured (--quick)")
  else:
    step_time(repeats)
  memory(pipelines)
