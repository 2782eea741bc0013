"""Each benchmark runs as a user runs it (python -m megajax.launch.bench NAME), small, on CPU,
and prints its side-by-side figures."""

import json
import re

import pytest

from tests.support.processes import run_module


@pytest.mark.cpu_only
def test_attention_benchmark_runs_side_by_side_on_cpu():
  """`python -m megajax.launch.bench attention` on CPU: the reduced grid, said to be interpret mode."""
  result = run_module(["-m", "megajax.launch.bench", "attention", "--repeats=1"])
  assert result.returncode == 0, result.stderr[-3000:]
  assert "Pallas kernels in interpret mode (times the interpreter: no GPU figure)" in result.stdout
  rows = [line.split() for line in result.stdout.splitlines() if line.split()[:1] in (["128"], ["512"])]
  assert {(row[0], row[1], row[2]) for row in rows} == {
      (s, w, impl) for s in ("128", "512") for w in ("32", "None") for impl in ("pallas", "xla")}
  assert "pallas fwd+bwd time(s=512) / time(s=128) at w=32:" in result.stdout


def test_operators_benchmark_runs_side_by_side_on_cpu():
  """`python -m megajax.launch.bench operators`: each fused kernel next to XLA, in one run."""
  result = run_module(["-m", "megajax.launch.bench", "operators", "--repeats=1"])
  assert result.returncode == 0, result.stderr[-3000:]
  assert "Pallas kernels in interpret mode (times the interpreter: no GPU figure)" in result.stdout
  rows = {tuple(line.split()[:2]) for line in result.stdout.splitlines() if len(line.split()) == 4}
  ops = ("layer_norm", "add_layer_norm", "rms_norm", "add_rms_norm", "bias_gelu", "swiglu")
  assert {(op, impl) for op in ops for impl in ("pallas", "xla")} <= rows
  for op in ops:
    assert f"{op}: xla / ours: forward " in result.stdout


def test_pipeline_benchmark_prints_its_ratios():
  """`python -m megajax.launch.bench pipeline` (small: p=2, few repeats) runs and prints the
  memory, LAMB and lockstep figures side by side."""
  result = run_module(["-m", "megajax.launch.bench", "pipeline", "--stages=2", "--repeats=2"])
  assert result.returncode == 0, result.stderr[-3000:]
  out = result.stdout
  assert "bubble ticks cut by 75.0%, bubble fraction by 75.0%" in out
  ours, baseline = re.search(r"m=16p over m=4p: ours ([\d.]+)x, GPipe by autodiff ([\d.]+)x", out).groups()
  assert abs(float(ours) - 1) <= 0.1 and float(baseline) > 2
  assert re.search(r"interleaved_1f1b p=2 v=2 m=4 .* 1\.000x", out)


def test_data_benchmark_prints_the_input_side_against_the_step():
  """`python -m megajax.launch.bench data`: prepare and loader tokens/s side by side, the need
  of 8 GPUs of a 1.3B model, and the default job's wait for data as a share of its step."""
  result = run_module(["-m", "megajax.launch.bench", "data", "--data_batches=5", "--data_steps=1",
                       "--data_words=20000", "--data_tokens=1000000"])
  assert result.returncode == 0, result.stderr[-3000:]
  out = result.stdout
  assert re.search(r"prepare: bpe / bytes tokens/s \(1 worker\): [\d.]+", out)
  on_off = float(re.search(r"loader: packing on / off tokens/s: ([\d.]+)", out).group(1))
  assert on_off > 0    # a timing ratio: printed for the reader, not bounded here (a loaded machine skews it)
  need = float(re.search(r"at 55% MFU consume ([\d,]+) tokens/s per host", out).group(1).replace(",", ""))
  assert 3e5 < need < 1e6    # the estimate: about 0.6M tokens/s
  share = float(re.search(r"waits [\d.]+ ms for its batch = ([\d.]+)% of the step", out).group(1))
  assert 0 <= share < 100


def test_step_costs_benchmark_counts_the_pipelines_flops_and_the_dp_sync():
  """`python -m megajax.launch.bench step_costs --quick`: the pipeline's executed matmul FLOPs
  (read from the compiled HLO) within 2% of one device's when the backward reads the forward's
  residuals, more when it reruns the forward; every gradient byte reduce-scattered over dp once per step,
  in buckets (parallel.dp_bucket_mb): fewer collectives than leaves, the pipeline's pieces included."""
  result = run_module(["-m", "megajax.launch.bench", "step_costs", "--quick"])
  assert result.returncode == 0, result.stderr[-3000:]
  out = result.stdout
  residuals, recompute = map(float, re.search(r"^none .* ([\d.]+)x +([\d.]+)x ", out, re.M).groups())
  assert residuals <= 1.02 < recompute
  count, kib, leaves = re.search(r"^step +reduce-scatter +f32 +([\d.]+) +([\d.]+) +(\d+)$", out, re.M).groups()
  shards = re.search(r"^step .* the fp32 gradient shards: ([\d.]+) KiB per device", out, re.M).group(1)
  assert float(kib) == float(shards) > 0 and 0 < float(count) < int(leaves)    # every gradient byte once
  assert re.search(r"^residuals +[\d.]+ MiB", out, re.M) and re.search(r"^recompute +[\d.]+ MiB", out, re.M)


def test_cp_benchmark_shows_the_halo_flat_in_the_sequence():
  """`python -m megajax.launch.bench cp --quick`: in the compiled training step a local layer's
  permute bytes the same at both lengths and equal to the halo's, the ring's growing with s,
  no all-gather; the step's memory at cp = 4 under cp = 1's, the H100 rows (or the reason they
  are skipped) and the time-per-token rows with cp scaled with s."""
  result = run_module(["-m", "megajax.launch.bench", "cp", "--quick", "--repeats=1"])
  assert result.returncode == 0, result.stderr[-3000:]
  rows = {(m[0], int(m[1])): (m[2], m[3], m[4]) for m in
          re.findall(r"^(local|global) +(\d+) +([\d,]+) +([\d,]+) +(\d+)$", result.stdout, re.M)}
  assert rows[("local", 2048)][0] == rows[("local", 8192)][0] == rows[("local", 2048)][1]
  assert rows[("global", 8192)][0] == rows[("global", 8192)][1] != rows[("global", 2048)][0]
  assert all(gathers == "0" for _, _, gathers in rows.values())
  assert re.search(r"^  LG cp = 4: +[\d.]+ MiB +\(0\.\d+ x cp = 1\)$", result.stdout, re.M)   # the step's, on CPU
  assert re.search(r"s = +16384, cp = 4: +[\d.]+ MiB|skipped: ", result.stdout)
  assert re.findall(r"^L +(256|512|1024) +(1|2|4) +[\d.]+ +[\d.]+ ", result.stdout, re.M) == [
      ("256", "1"), ("512", "2"), ("1024", "4")]


def test_sample_benchmark_prints_cache_against_recompute():
  """`python -m megajax.launch.bench sample` (few tokens): tokens/s of the KV cache next to the
  full recompute for batches 1 and 8, both decoding the same greedy tokens; a local layer's
  cache the window's size (64 of 16 + 8 positions: all of them), a global layer's every position."""
  result = run_module(["-m", "megajax.launch.bench", "sample", "--repeats=1", "--new_tokens=8"])
  assert result.returncode == 0, result.stderr[-3000:]
  rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)x\s+(\d+)/(\d+)\s+([\d.]+) / ([\d.]+)$", result.stdout, re.M)
  assert [row[0] for row in rows] == ["1", "8"], result.stdout
  for batch, _, _, _, same, total, local, global_ in rows:
    assert same == total == str(8 * int(batch))
    assert float(local) == float(global_) == int(batch) * 24 * 128 // 2 * 4 * 2 / 1024   # 24 slots: window > length


def test_gpu_check_writes_its_results_on_cpu(tmp_path):
  """`python -m megajax.launch.bench gpu` on a machine without a GPU: the tests part reports
  tests/gpu skipped with the reason, the profile part traces the tiny `+ Pallas` row (no GPU
  tracks, so no GPU time), the checkpoint part measures the save; each part in its own process
  under the budget (its log kept); both files written. (The train part's suite: tests/integration/
  test_mfu_suite.py; the tables' Markdown: tests/unit/test_gpu_check.py.)"""
  out = tmp_path / "check"
  result = run_module(["-m", "megajax.launch.bench", "gpu", f"--out={out}", "--parts=tests,profile,checkpoint",
                       "--train_sizes=tiny:32", "--budget_s=900"])
  assert result.returncode == 0, result.stderr[-3000:]
  assert "note: no GPU here (cpu)" in result.stdout and "plan: tests 175 s, profile 60 s, checkpoint 30 s" in result.stdout
  check = json.loads((out / "gpu_check.json").read_text())
  assert check["parts"] == ["tests", "profile", "checkpoint"] and check["platform"] == "cpu"
  assert all((out / f"{part}.log").exists() for part in check["parts"])      # each part in its own process
  checkpoint = check["results"]["checkpoint"]
  assert "error" not in checkpoint and any(line.startswith("async") for line in checkpoint["lines"]), checkpoint
  tests = check["results"]["tests"]
  assert tests["counts"].get("skipped", 0) >= 30 and "failed" not in tests["counts"], tests
  assert any("needs a GPU and MEGAJAX_TESTS_ON=gpu" in line for line in tests["lines"])
  profile = check["results"]["profile"]
  assert "error" not in profile, profile
  assert profile["busy_ms_per_step"] == 0 and (out / "step_trace.json.gz").stat().st_size > 0
  assert "## profile" in (out / "gpu_check.md").read_text() and "## checkpoint" in (out / "gpu_check.md").read_text()


def test_peer_benchmark_compares_with_plain_jit():
  """`python -m megajax.launch.bench peer` on the tiny model, dp=8 and the dp2-pp2-tp2 pipeline:
  per mesh its peers (jax.jit + GSPMD) and megajax, each with tokens/s, a ratio, GFLOP, GB, the
  MB its copies write (some: the step's concatenations) and its collectives; the same first
  losses (no timing asserted). The jit DP peer's gradient sum is there: one combined
  all-reduce over the 8 devices; megajax's step has no collective over a group of one, and its
  ZeRO collectives move fused operands whole and the rest in buckets."""
  result = run_module(["-m", "megajax.launch.bench", "peer", "--peer_size=tiny", "--rounds=2",
                       "--peer_meshes=8x1x1,2x2x2"])
  assert result.returncode == 0, result.stderr[-3000:]
  out = result.stdout
  assert "mesh dp=8 pp=1 tp=1:" in out and "mesh dp=2 pp=2 tp=2 (interleaved_1f1b, v=2, m=4):" in out
  rows = re.findall(r"^  (jit [\w+-]+|megajax)\s+(\d+x\d+x\d+)\s+\d+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+([\d.]+)\s+[\d. ]+(.*)$",
                    out, re.MULTILINE)
  copied = {(name, mesh): float(mb) for name, mesh, mb, _ in rows}
  rows = [(name, mesh, collectives) for name, mesh, _, collectives in rows]
  assert [(name, mesh) for name, mesh, _ in rows] == [
      ("jit DP", "8x1x1"), ("jit FSDP", "8x1x1"), ("megajax", "8x1x1"),
      ("jit DP", "8x1x1"), ("jit FSDP", "8x1x1"), ("jit Megatron-TP", "2x1x4"), ("megajax", "2x2x2")], out
  assert rows[0][2] == "all-reduce x8: 1"
  assert not any(" x1: " in f" {collectives}" for name, _, collectives in rows if name == "megajax"), rows
  # ZeRO's collectives, not one per parameter (60 leaves): dp=8, 4 parallel layers, one kind:
  # one per fused operand (2 a layer) and other matrix (embedding, head), the other leaves in
  # buckets (parallel.dp_bucket_mb): one per forward group's gather (5), one reduce-scatter.
  dp8 = dict(re.findall(r"([\w-]+ x\d+): (\d+)", rows[2][2]))
  assert int(dp8["all-gather x8"]) == 8 + 2 + 5 and int(dp8["reduce-scatter x8"]) == 8 + 2 + 1, rows[2]
  assert copied[("megajax", "2x2x2")] > 0, copied
  spreads = [float(s) for s in re.findall(r"first losses agree to ([\d.e+-]+)", out)]
  assert len(spreads) == 2 and max(spreads) < 1e-5, spreads


def test_peer_benchmark_compiles_every_contender_for_h100s():
  """`bench peer --compile_for=h100-80g` on the tiny model, dp=8: nothing runs; each contender
  compiled for 8 described H100s (megajax.parallel.deviceless) with XLA's bytes per device,
  its collectives, and how many of each kind the scheduler overlapped with compute: megajax's
  dp reduce-scatters all, its all-gathers all but the first layer's."""
  result = run_module(["-m", "megajax.launch.bench", "peer", "--peer_size=tiny", "--peer_meshes=8x1x1",
                       "--compile_for=h100-80g"])
  assert result.returncode == 0, result.stderr[-3000:]
  out = result.stdout
  assert re.search(r"^mesh dp=8 pp=1 tp=1: .*; compiled for 8 described h100-80g \(nothing runs: no tokens/s\)$",
                   out, re.MULTILINE), out
  rows = dict(re.findall(r"^  (jit [\w+-]+|megajax)\s+8x1x1\s+[\d.]+\s+([\d.]+)  .*$", out, re.MULTILINE))
  assert set(rows) == {"jit DP", "jit FSDP", "megajax"} and all(float(mib) > 0 for mib in rows.values()), out
  megajax = next(line for line in out.splitlines() if line.startswith("  megajax"))
  gathers = re.search(r"all-gather dp (\d+)/(\d+)", megajax)
  assert int(gathers.group(1)) >= int(gathers.group(2)) - 1 >= 1, megajax
  scatters = re.search(r"reduce-scatter dp (\d+)/(\d+)", megajax)
  assert scatters.group(1) == scatters.group(2), megajax
  assert " x1: " not in megajax, megajax


def test_fbd_benchmark_compares_with_the_colocated_step():
  """`bench fbd --fbd_size=tiny`: the 3D step and both FBD splits side by side, the same first
  loss, each FBD split's bytes between its groups."""
  result = run_module(["-m", "megajax.launch.bench", "fbd", "--fbd_size=tiny", "--repeats=2"])
  assert result.returncode == 0, result.stderr[-3000:]
  rows = {m.group(1): m.groups()[1:] for m in re.finditer(
      r"^(3D step dp2 tp4|FBD 4\+4|FBD 2\+6)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(.+?)\s{2,}(\S+)\s+(\S+)$",
      result.stdout, re.M)}
  assert set(rows) == {"3D step dp2 tp4", "FBD 4+4", "FBD 2+6"}, result.stdout
  assert len({row[2] for row in rows.values()}) == 1, result.stdout          # the same first loss
  assert rows["3D step dp2 tp4"][1] == "1.000" and float(rows["FBD 4+4"][5]) > 0, result.stdout
  by_remat = re.findall(r"^\s+(none|dots|full)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", result.stdout, re.M)
  assert [r[0] for r in by_remat] == ["none", "dots", "full"], result.stdout     # sent vs the planner's count
  assert float(by_remat[0][1]) > float(by_remat[1][1]) > float(by_remat[2][1]) > 0, result.stdout
  weights = re.findall(r"^weights backward -> forward a step, compute dtype (\w+): sent ([\d.]+) MB, planner ([\d.]+) MB",
                       result.stdout, re.M)
  assert [w[0] for w in weights] == ["float32", "bfloat16"] and all(w[1] == w[2] for w in weights), result.stdout
  assert float(weights[1][1]) < float(weights[0][1]), result.stdout         # bf16 weights: fewer bytes
  planned = dict(re.findall(r"^  remat (full|dots): MegaFBD .* against the h100-80g alone [\d.]+ s: ([\d.]+)x$",
                            result.stdout, re.M))
  assert float(planned["full"]) > 1 > float(planned["dots"]), result.stdout    # the docs' worked example
  traced = {m.group(1): [float(x) for x in m.groups()[1:]] for m in re.finditer(
      r"^trace (FBD 4\+4|FBD 1\+1|FBD 1\+1 serial) +([\d.]+) +([\d.]+) +([\d.]+)$", result.stdout, re.M)}
  assert set(traced) == {"FBD 4+4", "FBD 1+1", "FBD 1+1 serial"}, result.stdout
  assert all(forward > 0 and backward > 0 for forward, backward, _ in traced.values()), result.stdout
  # Waiting for each program leaves the groups nothing to run at once; XLA:CPU runs programs that
  # hold collectives one at a time (the 1+1 split's overlap is printed, not held: timing decides it).
  assert traced["FBD 1+1 serial"][2] == 0 and traced["FBD 4+4"][2] == 0, result.stdout
  assert re.search(r"^FBD 4\+4 serial\s+[\d.]+", result.stdout, re.M), result.stdout
  # (the overlap's ratio is printed, not held to a bound: a loaded machine decides it)
  assert float(re.search(r"overlap: FBD 4\+4 takes ([\d.]+) of its time", result.stdout).group(1)) > 0
