"""Where memory.XLA_PIPELINE comes from: the pipeline's memory terms fitted to XLA.

  PIPELINE_FIT_CASES  the fit set: pipeline configs (pp 2-4, dp 1-2, tp 1-2, v 1-2, shapes,
                      both executors and grad syncs), each in bf16 and fp32 under remat none,
                      dots and full. None is a calibration.MEMORY_CASES config: those are held out.
  measure             XLA's bytes of each (calibration.measured_bytes: compiles the real step; a
                      few minutes on 8 CPU devices). `python -m megajax.launch.bench planner
                      --measure_memory` writes them to memory_measured.py.
  fit                 non-negative least squares of the weights of memory.pipeline_terms to
                      those bytes, in relative error; returns the weights and each case's error.

The measurements are data in the repository (memory_measured.py, with the jax version they were
taken on); tests/unit/test_planner.py refits XLA_PIPELINE from them in CI and
tests/integration/test_planner_memory.py checks the held-out MEMORY_CASES against XLA itself.
"""

from __future__ import annotations

import itertools

import jax
import numpy as np
from scipy.optimize import nnls

from megajax.model import ModelConfig
from megajax.parallel.planner import memory
from megajax.parallel.planner.calibration import PIPELINE_BASE, MemoryCase, measured_bytes, memory_case_config
from megajax.parallel.planner.fits import plan_of

# calibration.PIPELINE_BASE (itself held out) with one or two fields changed:
_SHAPES = {
    "seq 128": {"model.seq_len": 128},
    "h 256": {"model.hidden_dim": 256},
    "8 layers": {"model.num_layers": 8},
    "vocab 2048": {"model.vocab_size": 2048},
    "dp 2": {"parallel.dp": 2, "train.batch_size": 16},
    "tp 1, v 1": {"parallel.tp": 1, "parallel.virtual_stages": 1},
    "microbatch 2": {"train.batch_size": 16},
    "pp 4, v 1, 8 layers": {"parallel.pp": 4, "parallel.virtual_stages": 1, "model.num_layers": 8},
    "grad_sync microbatch": {"parallel.grad_sync": "microbatch"},
    "pipeline_recompute, h 192": {"parallel.pipeline_recompute": True, "model.hidden_dim": 192},
    "pipeline_recompute, dp 2, seq 128": {"parallel.pipeline_recompute": True, "parallel.dp": 2,
                                          "train.batch_size": 16, "model.seq_len": 128},
    "dp 2, tp 1, 4 microbatches": {"parallel.dp": 2, "parallel.tp": 1, "train.batch_size": 8,
                                   "train.microbatches": 4},
}
PIPELINE_FIT_CASES = tuple(
    MemoryCase(f"{shape}, {dtype}, remat {remat}", {**PIPELINE_BASE, **overrides, "model.compute_dtype": dtype,
                                                    "model.remat": remat})
    for (shape, overrides), dtype, remat in itertools.product(_SHAPES.items(), ("bfloat16", "float32"),
                                                              ("none", "dots", "full")))


def measure(cases=PIPELINE_FIT_CASES, log=lambda line: None) -> dict[str, int]:
  """{case name: XLA:CPU's bytes}, compiling each case's step on this process's devices."""
  measured = {}
  for case in cases:
    measured[case.name] = int(measured_bytes(memory_case_config(case)))
    log(f"  {case.name}: {measured[case.name] / 1e6:.2f} MB")
  return measured


def fit(measured: dict[str, int], cases=PIPELINE_FIT_CASES) -> tuple[dict[str, float], dict[str, float]]:
  """(weights of memory.pipeline_terms, {case: relative error with them}), nnls on the cases'
  relative errors."""
  return fit_platform(memory.XLA_PIPELINE, cases, measured, memory_case_config, "cpu")


def fit_platform(held: dict[str, float], cases, measured: dict[str, int], config_of, platform: str):
  """`fit_weights` of `held` (one of memory's weight sets) to the `cases` (`config_of(case)`: its
  config) on `platform`, each case's terms as memory.weighed_terms gives them."""
  weighed = []
  for case in cases:
    config = config_of(case)
    weighed.append(memory.weighed_terms(ModelConfig.from_config(config.model), plan_of(config, platform),
                                        platform=platform))
  return fit_weights(held, [(w.fixed, w.terms) for w in weighed], measured, cases)


def fit_weights(held: dict[str, float], case_terms: list[tuple[float, dict[str, float]]], measured: dict[str, int],
                cases) -> tuple[dict[str, float], dict[str, float]]:
  """Non-negative least squares of the weights of `held`'s terms to XLA's bytes, in relative
  error: (the weights, {case: relative error}). `case_terms[i]`: case i's bytes no weight scales
  and its unweighted terms; a term no case has keeps its held value."""
  names = list(held)
  rows, targets = [], []
  for case, (fixed, terms) in zip(cases, case_terms):
    scale = measured[case.name]
    rows.append([terms[name] / scale for name in names])
    targets.append(1 - fixed / scale)
  rows, targets = np.array(rows), np.array(targets)
  used = rows.any(axis=0)
  weights, _ = nnls(rows[:, used], targets)
  fitted = dict(held)
  fitted.update({name: float(w) for name, w in zip(np.array(names)[used], weights)})
  errors = rows @ np.array([fitted[name] for name in names]) - targets
  return fitted, {case.name: float(error) for case, error in zip(cases, errors)}


def write_data(path: str, docstring: str, **tables: dict[str, int]) -> None:
  """A memory fit's measurements as a module: `docstring`, the jax version, and each table
  ({case name: XLA's bytes}) as a dict named by its keyword (data, with where it came from)."""
  lines = [f'"""{docstring}"""', "", f"JAX_VERSION = {jax.__version__!r}"]
  for name, measured in tables.items():
    lines += [f"{name} = {{"] + [f"    {case!r}: {nbytes}," for case, nbytes in measured.items()] + ["}"]
  with open(path, "w") as f:
    f.write("\n".join(lines + [""]))


def write_measured(path: str, measured: dict[str, int]) -> None:
  """memory_measured.py: the pipeline fit set's bytes."""
  write_data(path, "XLA's bytes per device of memory_fit.PIPELINE_FIT_CASES: generated by\n"
             "`python -m megajax.launch.bench planner --measure_memory` (8 CPU devices); do not edit.",
             MEASURED=measured)
