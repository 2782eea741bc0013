"""Sampled traces in process: operations classified by their scopes, a workdir without traces,
and the analysis (labels, alignment, stragglers) of synthetic traced steps, with cp > 1 and
from before the cp axis. (The 2-process straggler drill: tests/e2e/test_straggler_drill.py.)"""

import gzip
import json

import pytest

from megajax.observe import trace_analysis as analysis
from megajax.observe.trace_analysis import analyse, rank_label
from megajax.observe.traces import classify, operations


def test_operations_are_classified_from_their_scopes():
  assert classify("reduce-scatter", "jit(step)/transpose(jvp(forward))/dp all-gather/all_gather") == \
      ("communication", "dp reduce-scatter")
  assert classify("all-gather-start", "jit(step)/forward/tp all-gather/all_gather") == ("communication", "tp all-gather")
  assert classify("all-reduce", "jit(step)/psum") == ("communication", "all-reduce")
  assert classify("fusion", "jit(step)/transpose(jvp(forward))/dot_general") == ("backward", "backward")
  assert classify("fusion", "jit(step)/optimizer/mul") == ("optimizer", "optimizer")
  assert classify("dot", "jit(step)/forward/dot_general") == ("forward", "forward")
  hlo = ('HloModule jit_step\n  %ag.1 = f32[8]{0} all-gather(f32[4]{0} %p), dimensions={0}, '
         'metadata={op_name="jit(step)/forward/dp all-gather/all_gather"}\n'
         '  ROOT %fusion.2 = f32[8]{0} fusion(f32[8]{0} %ag.1), kind=kLoop, '
         'metadata={op_name="jit(step)/optimizer/add"}\n')
  assert operations(hlo) == {"ag.1": {"opcode": "all-gather", "category": "communication", "kind": "dp all-gather"},
                             "fusion.2": {"opcode": "fusion", "category": "optimizer", "kind": "optimizer"}}


def test_a_workdir_without_traces_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="trace_every"):
    analyse(str(tmp_path))


# --- The analysis on synthetic traced steps (the real 2-process job: tests/e2e/test_straggler_drill.py).

KINDS = ("cp all-gather", "tp all-gather", "dp reduce-scatter")   # each rank's collectives, in this order
OPS = {"fwd": {"opcode": "fusion", "category": "forward", "kind": "forward"},
       **{f"c{i}": {"opcode": kind.split()[1], "category": "communication", "kind": kind}
          for i, kind in enumerate(KINDS)}}


def write_traced_step(step_dir, coords_of_process: dict[int, list], compute_ms, skew_us: float = 7e6):
  """One traced step of a job: per process, trace_meta.json and a profiler trace in which each
  device computes compute_ms(coords) ms, then runs KINDS' collectives, which every rank ends
  together at 100 ms (+1 ms each): a slow rank's peers wait for it. Process p's clock is p x
  skew_us ahead."""
  for process, coords_list in coords_of_process.items():
    directory = step_dir / f"process_{process}"
    (directory / "plugins" / "profile").mkdir(parents=True)
    devices = [{"ordinal": i, "id": 4 * process + i, "coords": list(c)} for i, c in enumerate(coords_list)]
    (directory / "trace_meta.json").write_text(json.dumps({"process": process, "module": "jit_step",
                                                           "devices": devices, "ops": OPS, "step": 3}))
    events = []
    for device in devices:
      start = 0.0
      spans = [("fwd", compute_ms(tuple(device["coords"])) * 1e3)] + [(f"c{i}", 100e3 + 1e3 * i) for i in range(3)]
      for name, end in spans:
        events.append({"ph": "X", "pid": 1, "ts": start + process * skew_us, "dur": end - start,
                       "args": {"hlo_op": name, "device_ordinal": device["id"], "hlo_module": "jit_step"}})
        start = end
    with gzip.open(directory / "plugins" / "profile" / "host.trace.json.gz", "wt") as f:
      json.dump({"traceEvents": events}, f)


def test_rank_labels_name_cp_only_in_a_job_with_cp():
  assert rank_label((1, 0, 2)) == rank_label((1, 0, 0, 2)) == "DP1-PP0-TP2"      # a trace from before cp
  assert rank_label((1, 0, 0, 2), with_cp=True) == "DP1-PP0-CP0-TP2"
  assert rank_label((1, 0, 1, 2)) == "DP1-PP0-CP1-TP2"


def test_a_straggler_in_a_job_with_context_parallelism(tmp_path):
  """dp=2 pp=1 cp=2 tp=2 on 2 processes (one per dp rank): DP1-PP0-CP1-TP0 computes 5x as long;
  its dp, cp and tp peers wait for it. The clocks are aligned (process 1's 7 s ahead) over
  the dp collectives, the only ones across processes."""
  slow = (1, 0, 1, 0)
  coords = {d: [(d, 0, c, t) for c in range(2) for t in range(2)] for d in range(2)}
  write_traced_step(tmp_path / "traces" / "step_3", coords, lambda c: 50.0 if c == slow else 10.0)

  ranks = analysis.load_ranks(str(tmp_path / "traces" / "step_3"))
  assert [r.label for r in ranks][:2] == ["DP0-PP0-CP0-TP0", "DP0-PP0-CP0-TP1"]     # every label names cp
  result = analyse(str(tmp_path), threshold=3.0)
  assert result["clock_shift_us"][1] == pytest.approx(-7e6)
  assert result["collective_end_spread_us"]["max"] == pytest.approx(0.0, abs=1e-3)
  [straggler] = result["stragglers"]
  assert straggler["rank"] == "DP1-PP0-CP1-TP0" and (straggler["dp"], straggler["cp"], straggler["tp"]) == (1, 1, 0)
  evidence = straggler["evidence"]
  assert {k for k in evidence if k.endswith("_group_compute_ratio")} == {"dp_group_compute_ratio",
                                                                        "cp_group_compute_ratio",
                                                                        "tp_group_compute_ratio"}
  assert evidence["cp_group"] == ["DP1-PP0-CP0-TP0", "DP1-PP0-CP1-TP0"]
  lateness = evidence["last_to_start_fraction"]      # its first collectives: the cp and tp ones
  assert set(lateness) == {"cp", "tp", "dp"} and lateness["cp"] == lateness["tp"] == 1.0
  assert {v["rank"] for v in result["victims"]} == {"DP0-PP0-CP1-TP0", "DP1-PP0-CP0-TP0", "DP1-PP0-CP1-TP1"}
  out = tmp_path / "traces" / "analysis"
  rows = (out / "heatmap.csv").read_text().splitlines()
  assert rows[0].startswith("rank,dp,pp,cp,tp,process,") and len(rows) == 1 + 8
  assert (out / "heatmap.png").read_bytes()[:4] == b"\x89PNG"
  with gzip.open(out / "merged_trace.json.gz") as f:
    names = {e["args"]["name"] for e in json.load(f)["traceEvents"] if e["name"] == "process_name"}
  assert names == {rank_label(c, with_cp=True) for cs in coords.values() for c in cs}


def test_a_trace_from_before_the_cp_axis_still_loads(tmp_path):
  """trace_meta.json of (dp, pp, tp) coordinates: cp 0, labels and groups as they were."""
  coords = {d: [(d, 0, t) for t in range(2)] for d in range(2)}
  write_traced_step(tmp_path / "traces" / "step_3", coords, lambda c: 40.0 if c == (0, 0, 1) else 10.0)
  ranks = analysis.load_ranks(str(tmp_path / "traces" / "step_3"))
  assert [r.coords for r in ranks] == [(0, 0, 0, 0), (0, 0, 0, 1), (1, 0, 0, 0), (1, 0, 0, 1)]
  assert [r.label for r in ranks] == ["DP0-PP0-TP0", "DP0-PP0-TP1", "DP1-PP0-TP0", "DP1-PP0-TP1"]
  result = analyse(str(tmp_path), threshold=3.0)
  assert [(s["rank"], s["cp"]) for s in result["stragglers"]] == [("DP0-PP0-TP1", 0)]
  assert "cp_group_compute_ratio" not in result["stragglers"][0]["evidence"]    # a cp group of one: no peers
  assert {v["rank"] for v in result["victims"]} == {"DP0-PP0-TP0", "DP1-PP0-TP1"}
