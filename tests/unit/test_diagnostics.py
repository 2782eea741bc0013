"""The diagnostic tests in process: the outlier rule, the report's text, a run on the 8 test
devices as a 2x2x2 mesh. (The 2-process drill: tests/e2e/test_diagnose.py.)"""

import json

from megajax.launch.supervisor.diagnostics import diagnose, find_outliers, format_report


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
