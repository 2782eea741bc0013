"""The cost model's memory against XLA's memory analysis of the real compiled train step."""

import pytest

from megajax.parallel.planner import calibration


@pytest.mark.parametrize("case", calibration.MEMORY_CASES, ids=lambda case: case.name)
def test_memory_matches_xla_memory_analysis(case):
  """Bytes per device of the real compiled train step (arguments + outputs - aliased + temp)."""
  config = calibration.memory_case_config(case)
  predicted, measured = calibration.predicted_bytes(config), calibration.measured_bytes(config)
  print(f"{case.name}: predicted {predicted / 1e6:.2f} MB, XLA {measured / 1e6:.2f} MB")
  within = abs(predicted / measured - 1) <= calibration.MEMORY_TOLERANCE
  assert within != (case.name in calibration.MEMORY_KNOWN_MISSES), (predicted, measured)


def test_memory_cases_cover_both_pipeline_executors_every_policy_and_bf16():
  """A pipeline case with the default executor (residual slots) and one with pipeline_recompute;
  the pipeline under remat none, dots and full in bf16 (and none in fp32)."""
  configs = [calibration.memory_case_config(case) for case in calibration.MEMORY_CASES]
  pipelines = [config for config in configs if config.parallel.pp > 1]
  assert {config.parallel.pipeline_recompute for config in pipelines} == {False, True}
  assert {(config.model.compute_dtype, config.model.remat) for config in pipelines} >= {
      ("float32", "none")} | {("bfloat16", remat) for remat in ("none", "dots", "full")}
