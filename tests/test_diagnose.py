"""megajax-diagnose: outlier rule, an in-process run on the 8 test devices, the 2-process fault drill."""

import json

import pytest

from megajax.launch.diagnose import diagnose, find_outliers, format_report
from tests.conftest import launch_two_processes, run_module


def test_find_outliers_flags_only_values_below_threshold_times_median():
  values = [{"process": p, "host": f"h{p}", "device_id": p, "tflops": v}
            for p, v in enumerate([10.0, 10.0, 9.5, 8.9, 20.0])]   # median 10: 8.9 < 9 is the only one
  assert find_outliers(values, "tflops") == [
      {"metric": "tflops", "process": 3, "host": "h3", "device_id": 3, "value": 8.9, "median": 10.0}]
  assert find_outliers(values, "tflops", threshold=0.5) == []
  assert find_outliers([{**v, "tflops": 5.0} for v in values], "tflops") == []   # all equal: none
  assert find_outliers([], "tflops") == []
  collective = [{"process": 0, "host": "a", "busbw": 1.0}, {"process": 1, "host": "b", "busbw": 2.0}]
  assert [o["device_id"] for o in find_outliers(collective, "busbw")] == [None]  # no device: None


def test_format_report_names_bad_processes_and_their_hosts():
  device = {"process": 1, "host": "b", "device_id": 5, "coords": {"dp": 1, "pp": 0, "tp": 0},
            "matmul_tflops": 1.0, "h2d_gbps": 2.0, "d2h_gbps": 3.0}
  report = {"platform": "gpu", "process_count": 2, "devices": [device], "collectives": [], "seconds": 1.0,
            "outliers": [{"metric": "matmul_tflops", "process": 1, "host": "b", "device_id": 5, "value": 1.0,
                          "median": 2.0}], "bad_processes": [1]}
  text = format_report(report)
  assert "matmul_tflops" in text and "device 5" in text
  assert text.splitlines()[-1] == "bad processes: 1 (host b)"
  assert format_report({**report, "outliers": [], "bad_processes": []}).splitlines()[-1] == "bad processes: none"


def test_diagnose_in_process_on_a_3d_mesh(tiny_config):
  tiny_config.parallel.dp, tiny_config.parallel.pp, tiny_config.parallel.tp = 2, 2, 2
  report = diagnose(tiny_config, matmul_size=32, transfer_mib=0.25, collective_mib=0.0625, repeats=2)

  assert report["platform"] == "cpu" and report["process_count"] == 1
  devices = report["devices"]
  assert len(devices) == 8
  assert len({tuple(d["coords"].values()) for d in devices}) == 8
  assert all(set(d["coords"]) == {"dp", "pp", "tp"} for d in devices)
  for metric in ("matmul_tflops", "h2d_gbps", "d2h_gbps"):
    assert all(d[metric] > 0 for d in devices), metric
  ops = {(c["group"], c["op"]) for c in report["collectives"]}
  assert ops == {(g, op) for g in ("dp", "pp", "tp") for op in ("all_reduce", "all_gather", "ppermute")}
  assert all(c["seconds"] > 0 and c["busbw_gbps"] > 0 for c in report["collectives"])
  gather = next(c for c in report["collectives"] if c["op"] == "all_gather")
  assert gather["bytes"] == 2**16            # the gathered size
  assert report["bad_processes"] == sorted({o["process"] for o in report["outliers"] if o["device_id"] is not None})
  assert json.loads(json.dumps(report)) == report
  text = format_report(report)
  for axis in ("dp", "pp", "tp"):
    assert f"\n{axis} " in text
  assert text.splitlines()[-1].startswith("bad processes: ")


def test_config_error_is_one_line_and_exit_2():
  result = run_module(["-m", "megajax.launch.diagnose", "--config=configs/default.py", "--config.parallel.tp=3"],
                      timeout=120)
  assert result.returncode == 2
  assert result.stderr.strip().startswith("megajax-diagnose: config error: ")
  assert len(result.stderr.strip().splitlines()) == 1


@pytest.fixture
def two_process_report(tmp_path):
  path = tmp_path / "report.json"
  codes, errors = launch_two_processes(
      ["-m", "megajax.launch.diagnose", "--config=configs/default.py", "--config.parallel.dp=2",
       "--config.parallel.pp=1", "--config.parallel.tp=4", f"--output={path}",
       "--config.debug.diagnose_slow_process=1"], timeout=240)
  assert codes == [0, 0], errors
  return json.loads(path.read_text())


def test_two_processes_find_the_slow_process(two_process_report):
  report = two_process_report
  assert report["process_count"] == 2
  devices = report["devices"]
  assert len(devices) == 8 and sorted({d["process"] for d in devices}) == [0, 1]
  groups = {c["group"] for c in report["collectives"]}
  assert groups == {"dp", "tp", "processes"}                 # pp=1 has no collective
  across = [c for c in report["collectives"] if c["group"] == "processes"]
  assert sorted((c["op"], c["process"]) for c in across) == [
      (op, p) for op in ("all_gather", "all_reduce", "ppermute") for p in (0, 1)]

  # The drill halves process 1's per-device speed: each of its devices is an outlier, and no
  # device of process 0 is.
  device_outliers = [o for o in report["outliers"] if o["device_id"] is not None]
  slow_devices = {d["device_id"] for d in devices if d["process"] == 1}
  assert {o["process"] for o in device_outliers} == {1}
  assert {o["device_id"] for o in device_outliers} == slow_devices
  assert {o["metric"] for o in device_outliers} == {"matmul_tflops", "h2d_gbps", "d2h_gbps"}
  # Bad processes come from device outliers only (a collective's members time it together;
  # here gloo over loopback on 2 shared cores can time one process's view 2x another's).
  assert report["bad_processes"] == [1]
