"""The cost model's memory against XLA's memory analysis of the real compiled train step: the
held-out cases' stored bytes (memory_measured_cpu.HELD_OUT, which tests/unit/test_planner.py
holds the model to) are XLA's own, compiled again here for a few of them."""

import pytest

from megajax.parallel.planner import calibration, memory_measured_cpu

# One of each kind the stored set has: the single stage in bf16, the pipeline at pp 4 with v 2,
# pipeline_recompute, several fields changed at once.
RECOMPILED = ("1 device, bf16, 4 layers, h 192, seq 96", "pp 4 v 2, bf16, 8 layers, h 192",
              "the same, parallel.pipeline_recompute",
              "dp 2 pp 2 tp 2 v 2, h 192, parallel block, bf16, remat dots, microbatch 2")


@pytest.mark.parametrize("name", RECOMPILED)
def test_stored_memory_is_xlas_and_the_model_holds_it(name):
  """Bytes per device of the real compiled train step (arguments + outputs - aliased + temp)."""
  case = next(case for case in calibration.MEMORY_CASES if case.name == name)
  config = calibration.memory_case_config(case)
  predicted, measured = calibration.predicted_bytes(config), calibration.measured_bytes(config)
  print(f"{case.name}: predicted {predicted / 1e6:.2f} MB, XLA {measured / 1e6:.2f} MB")
  assert measured == pytest.approx(memory_measured_cpu.HELD_OUT[name], rel=0.01)
  within = abs(predicted / measured - 1) <= calibration.MEMORY_TOLERANCE
  assert within != (case.name in calibration.MEMORY_KNOWN_MISSES), (predicted, measured)


def test_memory_cases_cover_both_pipeline_executors_every_policy_and_bf16():
  """A pipeline case with the default executor (residual slots) and one with pipeline_recompute;
  the pipeline under remat none, dots and full in bf16 (and none in fp32); the single stage in
  bf16; pp 4 with v 2."""
  configs = [calibration.memory_case_config(case) for case in calibration.MEMORY_CASES]
  pipelines = [config for config in configs if config.parallel.pp > 1]
  assert {config.parallel.pipeline_recompute for config in pipelines} == {False, True}
  assert {(config.model.compute_dtype, config.model.remat) for config in pipelines} >= {
      ("float32", "none")} | {("bfloat16", remat) for remat in ("none", "dots", "full")}
  assert any(config.parallel.pp == 1 and config.model.compute_dtype == "bfloat16" for config in configs)
  assert any(config.parallel.pp == 4 and config.parallel.virtual_stages == 2 for config in configs)
  assert set(RECOMPILED) <= set(memory_measured_cpu.HELD_OUT)
