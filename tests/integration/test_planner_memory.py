"""The cost model's memory against XLA's memory analysis of the real compiled train step."""

import pytest

from megajax.parallel.planner import calibration


@pytest.mark.parametrize("case", calibration.MEMORY_CASES, ids=lambda case: case.name)
def test_memory_matches_xla_memory_analysis(case):
  """Bytes per device of the real compiled train step (arguments + outputs - aliased + temp)."""
  config = calibration.memory_case_config(case)
  predicted, measured = calibration.predicted_bytes(config), calibration.measured_bytes(config)
  print(f"{case.name}: predicted {predicted / 1e6:.2f} MB, XLA {measured / 1e6:.2f} MB")
  assert abs(predicted / measured - 1) <= calibration.MEMORY_TOLERANCE, (predicted, measured)


def test_memory_cases_cover_both_pipeline_executors():
  """A pipeline case with the default executor (residual slots) and one with pipeline_recompute."""
  executors = {calibration.memory_case_config(case).parallel.pipeline_recompute
               for case in calibration.MEMORY_CASES if calibration.memory_case_config(case).parallel.pp > 1}
  assert executors == {False, True}
