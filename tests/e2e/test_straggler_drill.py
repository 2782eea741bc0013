"""Sampled traces, their rank-aligned merge, the heat map and the straggler detector, on a real
2-process job (2 x 4 CPU devices, mesh dp=2 pp=1 tp=4, gloo collectives)."""

import gzip
import json
import pathlib
import shutil

import numpy as np
import pytest

from megajax.observe import trace_analysis as analysis
from megajax.observe.trace_analysis import analyse
from tests.support import SMALL_MESH, config_flags
from tests.support.once import once_per_run
from tests.support.processes import launch_two_processes


RUN = ["-m", "megajax.launch.train", "--config=configs/default.py", "--config.train.steps=7",
       "--config.optimizer.warmup_steps=1", "--config.model.compute_dtype=float32",
       "--config.checkpoint.every_steps=0", "--config.checkpoint.save_params=False",
       "--config.observe.trace_every=1", *config_flags({**SMALL_MESH, "parallel.tp": 4})]
# tp=4, not SMALL_MESH's 2: the detector compares a rank's compute with its groups' medians,
# and a group of 2 has its straggler in its median (a ratio of 2 at most). SMALL_MESH's one
# layer: the drill's work stands out further from a rank's own than with two (its groups'
# compute ratios with 200 rounds of work were 12-14, not 3-6), and every collective of the
# step is still there.


SLOW = (1, 0, 2)


# CPU "devices" are threads sharing 2 cores (and the other test worker's): in one step of a
# clean run a rank's compute has been up to 2.4x its groups' medians, and a slow step's dp
# peer 5x its own usual (the straggler's ratio then fell under 2 with 200 rounds of work).
# With 1000 rounds the drill's rank measured 60-95x its groups' medians in every slow step
# under 3 busy processes: the threshold sits 12x under that and 2x over the clean noise, and
# the detector takes several traced steps and flags only persistent stragglers.
THRESHOLD = 5.0
CLEAN, SLOW_STEPS = [2, 3], [5, 6, 7]


def traced_job(workdir, *overrides):
  # The tests' compile flags (LLVM -O0, classic emitters): 4 CPU-s less than XLA's default -O2,
  # and the drill's rank stands out further (35-45x its groups' medians at -O2: -O0 slows its
  # matmul loop more than the rest of the step).
  codes, errors = launch_two_processes([*RUN, f"--workdir={workdir}", *overrides])
  assert codes == [0, 0], errors
  return workdir


@pytest.fixture(scope="module")
def drill_run(tmp_path_factory):
  """Every step traced; from step 5 on, rank DP1-PP0-TP2 (process 1) does extra forward work
  (the straggler drill): steps 2-3 are the clean run, 5-7 the slow one, one program. Run once
  per test run, whichever worker needs it first."""
  return once_per_run(tmp_path_factory, "straggler_drill", lambda workdir: traced_job(
      workdir, "--config.debug.slow_rank=1,0,2", "--config.debug.slow_rank_work=1000",
      "--config.debug.slow_rank_from_step=5"))


@pytest.fixture
def drill(drill_run, tmp_path):
  """This test's copy of the drill's workdir: megajax-trace's analysis writes into it."""
  return pathlib.Path(shutil.copytree(drill_run, tmp_path / "drill"))


def test_the_detector_names_the_slow_rank_and_its_victims(drill):
  result = analyse(str(drill), SLOW_STEPS, threshold=THRESHOLD)
  assert [s["rank"] for s in result["stragglers"]] == [analysis.rank_label(SLOW)], result
  evidence = result["stragglers"][0]["evidence"]
  assert evidence["dp_group_compute_ratio"] >= THRESHOLD and evidence["tp_group_compute_ratio"] >= THRESHOLD
  victims = {v["rank"] for v in result["victims"]}
  # Its dp peer and its tp group wait for it; none of them is blamed.
  assert victims and analysis.rank_label(SLOW) not in victims
  assert victims <= {"DP0-PP0-TP2", "DP1-PP0-TP0", "DP1-PP0-TP1", "DP1-PP0-TP3"}
  written = json.loads((drill / "traces" / "analysis" / "stragglers.json").read_text())
  assert written["stragglers"][0]["rank"] == "DP1-PP0-TP2"
  rows = (drill / "traces" / "analysis" / "heatmap.csv").read_text().splitlines()
  assert rows[0].startswith("rank,dp,pp,cp,tp") and len(rows) == 1 + 8
  assert (drill / "traces" / "analysis" / "heatmap.png").read_bytes()[:4] == b"\x89PNG"


def test_a_clean_step_flags_nobody(drill):
  result = analyse(str(drill), CLEAN, threshold=THRESHOLD)
  assert result["stragglers"] == [] and result["victims"] == []


def test_the_merged_trace_has_a_track_per_rank_on_one_clock(drill):
  analyse(str(drill), SLOW_STEPS, threshold=THRESHOLD)
  with gzip.open(drill / "traces" / "analysis" / "merged_trace.json.gz") as f:
    trace = json.load(f)
  names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
  assert names == {analysis.rank_label((d, 0, t)) for d in range(2) for t in range(4)}
  spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
  assert spans and all(isinstance(e["ts"], float) and e["dur"] >= 0 for e in spans)
  assert {e["cat"] for e in spans} >= {"forward", "backward", "optimizer", "communication"}
  assert {"dp reduce-scatter", "dp all-gather", "tp all-gather", "tp reduce-scatter"} <= {e["name"] for e in spans}


def test_alignment_recovers_a_clock_skew(drill):
  """Each process's trace has its own time origin. Skewing process 1 by a further 7 s must be
  undone to within a millisecond, and the participants of each cross-process collective then
  end together (median gap within 20 ms: CPU threads on 2 shared cores)."""
  step_dir = str(drill / "traces" / f"step_{SLOW_STEPS[-1]}")
  ranks = analysis.load_ranks(step_dir)
  shift = analysis.align(ranks)[1]
  skewed = analysis.load_ranks(step_dir)
  for rank in skewed:
    if rank.process == 1:
      for op in rank.ops:
        op.start, op.end = op.start + 7e6, op.end + 7e6
  assert analysis.align(skewed)[1] == pytest.approx(shift - 7e6, abs=1e3)
  spreads = analysis.collective_end_spreads(skewed)
  # 37 cross-process collectives in the step (fewer since ZeRO's go in buckets, parallel.dp_bucket_mb).
  assert spreads.size >= 30 and np.median(spreads) < 20e3
