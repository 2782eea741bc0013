"""Where memory.XLA_GPU_PIPELINE comes from: the pipeline's memory terms fitted to XLA:GPU.

The pipeline (pp > 1) on GPUs had XLA:CPU's weights (memory.XLA_PIPELINE) until XLA:GPU's own
bytes were measured: on ten pipeline configs compiled for a described H100 they over-predicted
by 6-17%, so a megajax pipeline plan was refused memory it has. Here the same terms
(memory.pipeline_terms) are weighed by XLA:GPU's bytes, measured like the single stage's
(memory_gpu_fit.measure: parallel.deviceless, no GPU needed):

  GPU_PIPELINE_FIT_CASES  the fit set: GPU_PIPELINE_BASE (bf16, cuDNN attention, pp 2 tp 2 v 2,
                          8 layers, 8 microbatches) with one or two fields changed, each under
                          remat none, dots and full.
  GPU_PIPELINE_HELD_OUT   configs never fitted on; the goal: every one within 10%.
  fit                     non-negative least squares of the weights, in relative error.

`python -m megajax.launch.bench planner --measure_memory_gpu` measures both sets into
memory_measured_gpu_pipeline.py (with the single stage's, ~20 minutes).
"""

from __future__ import annotations

import itertools

from megajax.parallel.planner import memory
from megajax.parallel.planner.calibration import MemoryCase
from megajax.parallel.planner.memory_fit import fit_platform, write_data
from megajax.parallel.planner.memory_gpu_fit import GPU_BASE, case_config

GPU_PIPELINE_BASE = {**GPU_BASE, "parallel.pp": 2, "parallel.tp": 2, "parallel.virtual_stages": 2,
                     "model.num_layers": 8, "train.batch_size": 8, "train.microbatches": 8}
_SHAPES = {
    "base": {},
    "h 1024": {"model.hidden_dim": 1024, "model.num_heads": 8},
    "seq 1024": {"model.seq_len": 1024},
    "16 layers": {"model.num_layers": 16},
    "microbatch 2": {"train.batch_size": 16},
    "dp 2": {"parallel.dp": 2, "train.batch_size": 16},
    "tp 1, v 1": {"parallel.tp": 1, "parallel.virtual_stages": 1},
    "pp 4, v 1, 16 layers": {"parallel.pp": 4, "parallel.virtual_stages": 1, "model.num_layers": 16},
    "tp 4": {"parallel.tp": 4},
    "pipeline_recompute": {"parallel.pipeline_recompute": True},
    "vocab 32768": {"model.vocab_size": 32768},
    # The regime the planner is used in: a 0.8B slice at s = 2048, a few GB a device.
    "h 2048, seq 2048, vocab 32768, 16 microbatches": {
        "model.hidden_dim": 2048, "model.num_heads": 16, "model.seq_len": 2048, "model.vocab_size": 32768,
        "train.batch_size": 16, "train.microbatches": 16},
}
GPU_PIPELINE_FIT_CASES = tuple(
    MemoryCase(f"{shape}, remat {remat}", {**GPU_PIPELINE_BASE, **overrides, "model.remat": remat})
    for (shape, overrides), remat in itertools.product(_SHAPES.items(), ("none", "dots", "full")))

_L = {"model.hidden_dim": 2048, "model.num_heads": 16, "model.num_layers": 8, "model.seq_len": 2048,
      "model.vocab_size": 32768, "train.batch_size": 16, "train.microbatches": 8}
# Held out. The first six were compiled once before the fit existed (to see XLA_PIPELINE's
# error on GPUs: +6 to +17%); the last three were written down with the fit set and not looked at.
GPU_PIPELINE_HELD_OUT = (
    MemoryCase("pp 2 tp 2 v 2, seq 1024, dp 2, remat dots",
               {**GPU_PIPELINE_BASE, "parallel.dp": 2, "train.batch_size": 16, "model.seq_len": 1024}),
    MemoryCase("pp 4 tp 1 v 2, h 1024, remat dots",
               {**GPU_PIPELINE_BASE, "parallel.pp": 4, "parallel.tp": 1, "model.hidden_dim": 1024,
                "model.num_heads": 8}),
    MemoryCase("h 2048 s 2048, pp 2 tp 2 v 2, remat dots", {**GPU_PIPELINE_BASE, **_L}),
    MemoryCase("h 2048 s 2048, pp 2 tp 2 v 2, remat full", {**GPU_PIPELINE_BASE, **_L, "model.remat": "full"}),
    MemoryCase("h 2048 s 2048, pp 4 tp 2 v 1, 16 layers, remat dots",
               {**GPU_PIPELINE_BASE, **_L, "parallel.pp": 4, "parallel.virtual_stages": 1, "model.num_layers": 16}),
    MemoryCase("h 2048 s 2048, pp 2 tp 4 v 2, lamb, remat dots",
               {**GPU_PIPELINE_BASE, **_L, "parallel.tp": 4, "optimizer.name": "lamb"}),
    MemoryCase("h 4096, 8 layers, seq 2048, pp 2 tp 8 v 2, remat dots",
               {**GPU_PIPELINE_BASE, **_L, "model.hidden_dim": 4096, "model.num_heads": 32, "parallel.tp": 8}),
    MemoryCase("dp 2 pp 4 tp 2 v 2, h 1536, 16 layers, swiglu, remat full",
               {**GPU_PIPELINE_BASE, "parallel.dp": 2, "parallel.pp": 4, "model.hidden_dim": 1536,
                "model.num_heads": 12, "model.num_layers": 16, "model.mlp": "swiglu", "model.remat": "full",
                "train.batch_size": 16}),
    MemoryCase("pp 2 tp 2 v 4, 16 layers, seq 2048, parallel block, pipeline_recompute, remat none",
               {**GPU_PIPELINE_BASE, "parallel.virtual_stages": 4, "model.num_layers": 16, "model.seq_len": 2048,
                "model.block": "parallel", "parallel.pipeline_recompute": True, "model.remat": "none"}),
)

# Held-out cases outside 10%, and why as far as known (the unit test holds the list).
GPU_PIPELINE_KNOWN_MISSES = {
    "h 4096, 8 layers, seq 2048, pp 2 tp 8 v 2, remat dots":
        "+11.1% (over: the safe side; XLA_PIPELINE's weights: +25.8%): tp 8 at h 4096, beyond the fit set's "
        "tp <= 4 and h <= 2048; three small tp 8 cases added to the fit set, tried, left it at +11.8%: "
        "not the tp degree alone",
}


def fit(measured: dict[str, int], cases=GPU_PIPELINE_FIT_CASES) -> tuple[dict[str, float], dict[str, float]]:
  """(weights of memory.pipeline_terms on GPUs, {case: relative error with them})."""
  return fit_platform(memory.XLA_GPU_PIPELINE, cases, measured, case_config, "gpu")


def write_measured(path: str, fit_bytes: dict[str, int], held_out_bytes: dict[str, int],
                   budgeted: dict[str, list[int]]) -> None:
  """memory_measured_gpu_pipeline.py: the fit set's and the held-out cases' bytes, and the
  held-out cases compiled for a smaller device (memory_gpu_fit.measure_under_budget)."""
  write_data(path, "XLA:GPU's bytes per device (a described H100, parallel.deviceless) of memory_gpu_pipeline_fit's\n"
             "cases: generated by `python -m megajax.launch.bench planner --measure_memory_gpu`; do not edit.",
             FIT=fit_bytes, HELD_OUT=held_out_bytes, BUDGETED=budgeted)
