"""The diagnostic tests in process: the outlier rule, the slow-process and eviction rules,
the findings's text, runs on the 8 test devices as 2x2x1x2 and 2x1x2x2 (dp, pp, cp, tp) meshes. (The 2-process drill:
tests/e2e/test_diagnose.py; the supervisor acting on it: tests/e2e/test_fault_drills.py.)"""

import json

import pytest

from megajax.launch.supervisor.diagnostics import (SLOW_RATIO, SLOW_RUNS, diagnose, find_outliers, find_slow,
                                                   format_findings, processes_to_evict)


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


def _devices(speeds: dict[int, list[float]]) -> list[dict]:
  """Synthetic findings devices: process -> each device's speed, the same for every metric."""
  return [{"process": p, "host": f"h{p}", "device_id": 8 * p + i, "matmul_tflops": v, "h2d_gbps": 10 * v,
           "d2h_gbps": 10 * v} for p, values in speeds.items() for i, v in enumerate(values)]


def test_slow_is_far_below_the_other_processes_not_noise():
  # The operator's case: host-to-device 8.6 vs a median of 10.4 (0.83x) on a busy machine; the
  # noise measured there reaches 0.69x (docs/robust-training.md): no process is slow.
  assert find_slow(_devices({0: [1.0, 1.0], 1: [0.83, 0.86], 2: [1.0, 0.69]})) == []
  # The drill (DRILL_SLOWDOWN 4x: 0.25x) on one of two processes: its devices, against the
  # other process's median only (with the job's median it would be 0.4x).
  slow = find_slow(_devices({0: [1.0, 0.95, 1.05, 1.0], 1: [0.25, 0.26, 0.24, 0.25]}))
  assert {s["process"] for s in slow} == {1} and len(slow) == 3 * 4
  assert all(s["value"] < SLOW_RATIO * s["others_median"] for s in slow)
  # One bad device is enough; one process alone has nobody to be compared with.
  assert {s["device_id"] for s in find_slow(_devices({0: [1.0, 1.0], 1: [1.0, 0.3]}))} == {9}
  assert find_slow(_devices({0: [1.0, 0.1]})) == []


def test_eviction_needs_repeated_slowness_of_a_blamed_process():
  noisy, slow_1, clean = {"bad_processes": []}, {"bad_processes": [1]}, {"bad_processes": []}
  assert SLOW_RUNS >= 2
  assert processes_to_evict([], [1]) is None                       # not run yet: run
  assert processes_to_evict([noisy], [1]) == []                    # a run without slowness: restart as is
  assert processes_to_evict([slow_1], [1]) is None                 # slow once: run again
  assert processes_to_evict([slow_1, clean], [1]) == []            # not again: noise, no eviction
  assert processes_to_evict([slow_1] * SLOW_RUNS, [1]) == [1]      # slow every time: evicted
  assert processes_to_evict([slow_1] * SLOW_RUNS, [0]) == []       # a slow bystander is not blamed
  assert processes_to_evict([slow_1], []) == []                    # nobody blamed: nothing to decide


def test_format_findings_names_bad_processes_and_their_hosts():
  device = {"process": 1, "host": "b", "device_id": 5, "coords": {"dp": 1, "pp": 0, "cp": 0, "tp": 0},
            "matmul_tflops": 1.0, "h2d_gbps": 2.0, "d2h_gbps": 3.0}
  findings = {"platform": "gpu", "process_count": 2, "devices": [device], "collectives": [], "seconds": 1.0,
            "outliers": [{"metric": "matmul_tflops", "process": 1, "host": "b", "device_id": 5, "value": 1.0,
                          "median": 2.0}],
            "slow": [{"metric": "matmul_tflops", "process": 1, "host": "b", "device_id": 5, "value": 1.0,
                      "others_median": 4.0}], "bad_processes": [1]}
  text = format_findings(findings)
  assert "matmul_tflops" in text and "device 5" in text and "others' median 4.000" in text
  header, row = text.splitlines()[2:4]          # the device table: a column per mesh axis
  assert header.split()[3:7] == ["dp", "pp", "cp", "tp"] and row.split()[3:7] == ["1", "0", "0", "0"]
  assert text.splitlines()[-1] == "bad processes: 1 (host b)"
  clean = {**findings, "outliers": [], "slow": [], "bad_processes": []}
  assert format_findings(clean).splitlines()[-1] == "bad processes: none"


@pytest.mark.parametrize("mesh", [(2, 2, 1, 2), (2, 1, 2, 2)], ids=["dp-pp-tp", "dp-cp-tp"])
def test_diagnose_in_process_on_the_mesh(tiny_config, mesh):
  p = tiny_config.parallel
  p.dp, p.pp, p.cp, p.tp = mesh
  findings = diagnose(tiny_config, matmul_size=32, transfer_mib=0.25, collective_mib=0.0625, repeats=2)

  assert findings["platform"] == "cpu" and findings["process_count"] == 1
  devices = findings["devices"]
  assert len(devices) == 8
  assert len({tuple(d["coords"].values()) for d in devices}) == 8
  assert all(list(d["coords"]) == ["dp", "pp", "cp", "tp"] for d in devices)    # MESH_AXES' order
  assert all(d["coords"][a] < n for d in devices for a, n in zip(("dp", "pp", "cp", "tp"), mesh))
  for metric in ("matmul_tflops", "h2d_gbps", "d2h_gbps"):
    assert all(d[metric] > 0 for d in devices), metric
  axes = [a for a, n in zip(("dp", "pp", "cp", "tp"), mesh) if n > 1]          # an axis of one device: none
  ops = {(c["group"], c["op"]) for c in findings["collectives"]}
  assert ops == {(g, op) for g in axes for op in ("all_reduce", "all_gather", "ppermute")}
  assert all(c["seconds"] > 0 and c["busbw_gbps"] > 0 for c in findings["collectives"])
  gather = next(c for c in findings["collectives"] if c["op"] == "all_gather")
  assert gather["bytes"] == 2**16            # the gathered size
  assert findings["slow"] == [] and findings["bad_processes"] == []     # one process: nobody to compare with
  assert json.loads(json.dumps(findings)) == findings
  text = format_findings(findings)
  for axis in axes:
    assert f"\n{axis} " in text
  assert text.splitlines()[-1].startswith("bad processes: ")
