"""Where the cost model's fitted numbers come from, and how well the model holds.

  fit_calibration  the step-time constants no micro-benchmark gives (cost_model.Calibration, but
                 the straggler slowdown: published) by least squares on
                 published.calibration_set() only: MegaScale's Table 3 (175B on 256 A100s; each
                 switch's row shows its constant). Returns a new Calibration.
  leave_one_out  each calibration row predicted by the fit to the others: how much any one row
                 moves the constants.
  validate       every published.validation_set() row (runs the fit never saw) predicted with
                 CALIBRATION next to its published figure.
  MEMORY_CASES   configs none of the memory fits saw (memory_fit's pipeline set, memory_cpu_fit's
                 single-stage set): the cost model's bytes per device against XLA's memory
                 analysis of the real compiled training step on CPU devices (stored:
                 memory_measured_cpu.HELD_OUT; measured_bytes compiles one); target: within 10%.

`python -m megajax.launch.bench planner` prints all four; the tests hold CALIBRATION to the fit,
the validation table to its goal and the memory model to XLA.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from scipy.optimize import least_squares

from megajax.config import apply_overrides, default_config, validate
from megajax.model import GPT, ModelConfig
from megajax.parallel.mesh import make_mesh
from megajax.parallel.planner import memory, published
from megajax.parallel.planner.cost_model import CALIBRATION, Calibration
from megajax.parallel.planner.fits import plan_of
from megajax.parallel.step import ParallelStep

# The fitted fields, their bounds and scales (least_squares' x_scale).
FITTED = ("gemm_sustained", "hbm_efficiency", "tp_overlap_hidden", "p2p_latency_s", "data_s_per_token")
BOUNDS = ([0.3, 0.3, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 5e-3, 1e-5])
SCALES = [0.1, 0.1, 0.1, 1e-4, 1e-7]
MEMORY_TOLERANCE = 0.10


# --- The step-time constants --------------------------------------------------------------------

def fit_calibration(runs: list[published.Run] | None = None, start: Calibration = CALIBRATION) -> Calibration:
  """Least squares of FITTED to `runs` (default: the calibration set), errors in MFU points."""
  runs = published.calibration_set() if runs is None else runs

  def errors(x):
    calibration = dataclasses.replace(start, **dict(zip(FITTED, x)))
    return np.array([published.predict(run, calibration).error for run in runs])
  x0 = np.clip([getattr(start, name) for name in FITTED], BOUNDS[0], BOUNDS[1])
  result = least_squares(errors, x0, bounds=BOUNDS, x_scale=SCALES)
  return dataclasses.replace(start, **{name: float(value) for name, value in zip(FITTED, result.x)})


def leave_one_out(calibration: Calibration = CALIBRATION) -> list[tuple[published.Run, float, float]]:
  """[(calibration row, its error with the full fit, its error fitted without it)]."""
  runs = published.calibration_set()
  rows = []
  for i, run in enumerate(runs):
    others = fit_calibration(runs[:i] + runs[i + 1:], calibration)
    rows.append((run, published.predict(run, calibration).error, published.predict(run, others).error))
  return rows


def validate_published(calibration: Calibration = CALIBRATION) -> list[published.Prediction]:
  return [published.predict(run, calibration) for run in published.validation_set()]


# --- Memory against XLA ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class MemoryCase:
  name: str
  overrides: dict       # config fields (dotted) over the base below


# The pipeline (default executor: its residual slots hold what the remat policy saves, so the
# policy shows in XLA's bytes even on CPU) in bf16 under each remat policy (measured too, not
# kept in CI for its time: fp32 dots +5.9%, fp32 full +2.7%). memory_fit's fit set varies it
# one field at a time.
PIPELINE_BASE = {"parallel.pp": 2, "parallel.tp": 2, "parallel.virtual_stages": 2, "model.num_layers": 4,
             "model.hidden_dim": 128, "model.num_heads": 8, "model.vocab_size": 512, "train.batch_size": 8,
             "train.microbatches": 8}
# Held out: none of these configs was among those XLA_CPU and XLA_PIPELINE
# (memory_fit.PIPELINE_FIT_CASES) were fitted on. The pipeline config twice: its default executor (residual slots) and
# parallel.pipeline_recompute (the chunk's forward rerun from its stashed input).
MEMORY_CASES = (
    MemoryCase("1 device, 3 layers, h=96", {"model.num_layers": 3, "model.hidden_dim": 96, "model.num_heads": 6,
                                            "model.seq_len": 96, "model.vocab_size": 384, "train.batch_size": 4}),
    MemoryCase("dp=2 tp=2, 2 microbatches", {"parallel.dp": 2, "parallel.tp": 2, "model.hidden_dim": 128,
                                             "model.num_heads": 8, "model.vocab_size": 512,
                                             "train.batch_size": 8, "train.microbatches": 2}),
    MemoryCase("dp=2 pp=2 tp=2, v=2, 8 microbatches", {"parallel.dp": 2, "parallel.pp": 2, "parallel.tp": 2,
                                                       "parallel.virtual_stages": 2, "model.num_layers": 4,
                                                       "model.hidden_dim": 128, "model.num_heads": 8,
                                                       "model.vocab_size": 512, "train.batch_size": 16,
                                                       "train.microbatches": 8}),
    MemoryCase("the same, parallel.pipeline_recompute", {"parallel.dp": 2, "parallel.pp": 2, "parallel.tp": 2,
                                                        "parallel.virtual_stages": 2, "model.num_layers": 4,
                                                        "model.hidden_dim": 128, "model.num_heads": 8,
                                                        "model.vocab_size": 512, "train.batch_size": 16,
                                                        "train.microbatches": 8,
                                                        "parallel.pipeline_recompute": True}),
) + tuple(
    MemoryCase(f"pp=2 tp=2 v=2, {dtype}, remat {remat}", {**PIPELINE_BASE, "model.compute_dtype": dtype,
                                                          "model.remat": remat})
    for dtype, remat in (("bfloat16", "none"), ("bfloat16", "dots"), ("bfloat16", "full")))
# Off the fit sets' neighbourhoods (issue 34: the single stage in bf16, pp 4 with v 2, several
# fields changed at once), chosen before they were measured; their XLA bytes are data
# (memory_measured_cpu.HELD_OUT), a few compiled again in CI.
_OFF = {"model.hidden_dim": 192, "model.num_heads": 6, "model.seq_len": 96, "model.vocab_size": 1024}
MEMORY_CASES += (
    MemoryCase("1 device, bf16, 4 layers, h 192, seq 96", {**_OFF, "model.num_layers": 4,
                                                          "model.compute_dtype": "bfloat16", "train.batch_size": 4}),
    MemoryCase("1 device, bf16, remat full, h 256, seq 256, 3 layers",
               {"model.hidden_dim": 256, "model.num_heads": 4, "model.seq_len": 256, "model.vocab_size": 1024,
                "model.num_layers": 3, "model.remat": "full", "model.compute_dtype": "bfloat16",
                "train.batch_size": 2}),
    MemoryCase("tp 4, bf16, remat dots, h 192, seq 96", {**_OFF, "parallel.tp": 4, "model.num_heads": 12,
                                                         "model.compute_dtype": "bfloat16",
                                                         "model.remat": "dots", "train.batch_size": 4}),
    MemoryCase("dp 2 tp 2, bf16, 4 microbatches, lamb, swiglu, h 192",
               {**_OFF, "parallel.dp": 2, "parallel.tp": 2, "model.compute_dtype": "bfloat16",
                "train.batch_size": 16, "train.microbatches": 4, "optimizer.name": "lamb", "model.mlp": "swiglu"}),
    MemoryCase("dp 4, 4 microbatches, parallel block, h 192", {**_OFF, "parallel.dp": 4, "model.block": "parallel",
                                                               "train.batch_size": 32, "train.microbatches": 4}),
    MemoryCase("pp 4 v 2, bf16, 8 layers, h 192", {**_OFF, "parallel.pp": 4, "parallel.virtual_stages": 2,
                                                   "model.num_layers": 8, "model.compute_dtype": "bfloat16",
                                                   "train.batch_size": 8, "train.microbatches": 8}),
    MemoryCase("pp 4 v 2, fp32, 8 layers, remat dots", {"model.hidden_dim": 128, "model.num_heads": 8,
                                                       "model.vocab_size": 512, "parallel.pp": 4,
                                                       "parallel.virtual_stages": 2, "model.num_layers": 8,
                                                       "model.remat": "dots", "train.batch_size": 8,
                                                       "train.microbatches": 8}),
    MemoryCase("dp 2 pp 2 tp 2 v 2, h 192, parallel block, bf16, remat dots, microbatch 2",
               {**_OFF, "parallel.dp": 2, "parallel.pp": 2, "parallel.tp": 2, "parallel.virtual_stages": 2,
                "model.num_layers": 4, "model.block": "parallel", "model.remat": "dots",
                "model.compute_dtype": "bfloat16", "train.batch_size": 16, "train.microbatches": 4}),
    MemoryCase("pp 2 tp 4 v 2, bf16, remat full, swiglu", {**_OFF, "parallel.pp": 2, "parallel.tp": 4,
                                                           "model.num_heads": 12,
                                                           "parallel.virtual_stages": 2, "model.num_layers": 4,
                                                           "model.remat": "full", "model.mlp": "swiglu",
                                                           "model.compute_dtype": "bfloat16", "train.batch_size": 8,
                                                           "train.microbatches": 4}),
)
# Chosen, and measured once, after the microbatch ordering (step._after_the_others) and the fit
# set's cases for it: unseen by the terms and the fit.
MEMORY_CASES += (
    MemoryCase("dp 2, 3 microbatches, h 224, seq 64, swiglu, bf16",
               {"model.hidden_dim": 224, "model.num_heads": 7, "model.seq_len": 64, "model.vocab_size": 768,
                "parallel.dp": 2, "model.mlp": "swiglu", "model.compute_dtype": "bfloat16",
                "train.batch_size": 12, "train.microbatches": 3}),
    MemoryCase("dp 4 tp 2, 2 microbatches, h 256, seq 48, parallel block",
               {"model.hidden_dim": 256, "model.num_heads": 8, "model.seq_len": 48, "model.vocab_size": 1024,
                "parallel.dp": 4, "parallel.tp": 2, "model.block": "parallel", "train.batch_size": 16,
                "train.microbatches": 2}),
    MemoryCase("tp 2, 4 microbatches, grad_sync microbatch, h 160, 6 layers, bf16, lamb",
               {"model.hidden_dim": 160, "model.num_heads": 10, "model.seq_len": 64, "model.vocab_size": 640,
                "model.num_layers": 6, "parallel.tp": 2, "parallel.grad_sync": "microbatch",
                "model.compute_dtype": "bfloat16", "optimizer.name": "lamb", "train.batch_size": 16,
                "train.microbatches": 4}),
)


# Cases outside MEMORY_TOLERANCE, and why as far as known (the integration test holds the list).
MEMORY_KNOWN_MISSES: dict[str, str] = {
    "dp 2, 3 microbatches, h 224, seq 64, swiglu, bf16":
        "+12.2% (over: the safe side), unseen: with grad_sync step 3 microbatches leave a scan of one between "
        "the first and the last; the accumulator term (weight 0.79, fitted on 3- and 4-microbatch cases at "
        "h 128 / 256) counts a loop-carried sum there. Tried after it was seen (2026-12-05) and not adopted: "
        "counting the sum only for scans longer than one (XLA inlines a scan of one) puts this case at -5.0% "
        "but the CPU fit set at 35 of 44 within 10% (was 39) and XLA:GPU's 3-microbatch fit case at -14.4%: "
        "XLA does not drop the sum there in general",
}


def memory_case_config(case: MemoryCase):
  """fp32 compute, remat none and kept residuals unless the case says otherwise (with pp = 1 XLA on CPU runs a
  policy's recomputation early, measured equal to none; the pipeline's residual slots hold what
  the policy saves), plain collectives."""
  config = default_config()
  config.model.num_layers, config.model.hidden_dim, config.model.num_heads = 2, 64, 4
  config.model.seq_len, config.model.vocab_size, config.model.window = 64, 256, 0
  config.model.compute_dtype, config.model.remat = "float32", "none"
  config.parallel.tp_overlap = "none"
  config.parallel.pipeline_recompute = False     # the residuals unless the case reruns (the GPU default)
  return apply_overrides(config, case.overrides)


def predicted_bytes(config) -> float:
  return memory.memory(ModelConfig.from_config(config.model), plan_of(config), platform="cpu").total


def measured_bytes(config) -> float:
  """XLA's peak for the compiled step on this process's devices: arguments + outputs - what
  the donated state aliases + temporaries."""
  validate(config)
  devices = jax.devices()[:config.parallel.dp * config.parallel.pp * config.parallel.tp]
  step = ParallelStep.build(config, GPT(ModelConfig.from_config(config.model)), make_mesh(config.parallel, devices))
  state, batch = step.abstract_inputs()
  stats = step.train_step().lower(state, batch).compile().memory_analysis()
  return (stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
          + stats.temp_size_in_bytes)
