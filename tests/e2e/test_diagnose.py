"""megajax-diagnose on a 2-process job, with the slow-process drill: the findings names it."""

import json

import pytest

from tests.support.processes import launch_two_processes


@pytest.fixture
def two_process_findings(tmp_path):
  path = tmp_path / "findings.json"
  codes, errors = launch_two_processes(
      ["-m", "megajax.launch.diagnose", "--config=configs/default.py", "--config.parallel.dp=2",
       "--config.parallel.pp=1", "--config.parallel.tp=4", f"--output={path}",
       "--config.debug.diagnose_slow_process=1"])
  assert codes == [0, 0], errors
  return json.loads(path.read_text())


def test_two_processes_find_the_slow_process(two_process_findings):
  findings = two_process_findings
  assert findings["process_count"] == 2
  devices = findings["devices"]
  assert len(devices) == 8 and sorted({d["process"] for d in devices}) == [0, 1]
  groups = {c["group"] for c in findings["collectives"]}
  assert groups == {"dp", "tp", "processes"}                 # pp=1 has no collective
  across = [c for c in findings["collectives"] if c["group"] == "processes"]
  assert sorted((c["op"], c["process"]) for c in across) == [
      (op, p) for op in ("all_gather", "all_reduce", "ppermute") for p in (0, 1)]

  # The drill quarters process 1's per-device speed: each of its devices is an outlier, and no
  # device of process 0 is.
  device_outliers = [o for o in findings["outliers"] if o["device_id"] is not None]
  slow_devices = {d["device_id"] for d in devices if d["process"] == 1}
  assert {o["process"] for o in device_outliers} == {1}
  assert {o["device_id"] for o in device_outliers} == slow_devices
  assert {o["metric"] for o in device_outliers} == {"matmul_tflops", "h2d_gbps", "d2h_gbps"}
  # Bad processes come from device outliers only (a collective's members time it together;
  # here gloo over loopback on 2 shared cores can time one process's view 2x another's).
  assert findings["bad_processes"] == [1]
  # ... and slow, the eviction evidence: below 0.5 x the other process's median, every metric.
  assert {(s["process"], s["metric"]) for s in findings["slow"]} == {
      (1, metric) for metric in ("matmul_tflops", "h2d_gbps", "d2h_gbps")}
