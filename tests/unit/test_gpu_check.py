"""The GPU check's pieces that need no GPU: the attention grid and which rows fit a device,
the time(32k)/time(8k) figures, the report's Markdown, the profile's kernel kinds."""

import time

import pytest

from megajax.launch.bench import attention, gpu, profile

H100_BYTES = 80e9 * 0.92


def test_the_gpu_attention_grid_is_the_issues():
  g = attention.grid(on_gpu=True)
  assert g["lengths"] == (2048, 8192, 32768) and g["windows"] == (1024,)
  assert (g["head_dim"], g["heads"], g["dtype"].__name__) == (128, 16, "bfloat16")
  assert list(attention.impls(on_gpu=True, backend="mosaic")) == ["pallas", "hopper-bwd", "fwd-inplace", "fwd-regP",
                                                                 "fwd-kT", "fwd-sched", "fwd-all4", "triton", "cudnn", "xla"]
  assert list(attention.impls(on_gpu=True, backend="triton")) == ["pallas", "cudnn", "xla"]


@pytest.mark.parametrize("s,impl,fits", [
    (2048, "xla", True),       # 32 x 16 x 2k^2 fp32 scores, 4 copies: ~34 GB
    (8192, "xla", False),      # ~137 GB per copy: skipped, not run out of memory
    (32768, "pallas", True), (32768, "cudnn", True), (32768, "hopper-bwd", True),
])
def test_rows_that_would_not_fit_are_skipped_before_they_run(s, impl, fits):
  g = attention.grid(on_gpu=True)
  batch = g["tokens"] // max(g["lengths"])
  assert batch == 32
  assert (attention.bytes_needed(impl, "fwd+bwd", batch, s, g) <= H100_BYTES * attention.FIT_MARGIN) == fits


def test_growth_and_the_table_name_the_skipped_rows():
  g = attention.grid(on_gpu=True)
  rows = [{"s": s, "window": 1024, "impl": impl, "batch": 32, "fwd ms": ms / 3, "fwd TFLOP/s": 1.0,
           "fwd+bwd ms": ms, "fwd+bwd TFLOP/s": 1.0} for s, impl, ms in
          [(8192, "pallas", 10.0), (32768, "pallas", 41.0), (8192, "cudnn", 9.0), (32768, "cudnn", 45.0)]]
  rows.append({"s": 8192, "window": 1024, "impl": "xla", "batch": 32, "fwd ms": None, "fwd TFLOP/s": None,
               "fwd+bwd ms": None, "fwd+bwd TFLOP/s": None, "fwd skipped": "needs ~275 GB > 66 GB of the device",
               "fwd+bwd skipped": "needs ~550 GB > 66 GB of the device"})
  growth = attention.growth(rows, g)
  assert growth == {"pallas fwd+bwd time(s=32768) / time(s=8192) at w=1024": pytest.approx(4.1),
                    "cudnn fwd+bwd time(s=32768) / time(s=8192) at w=1024": pytest.approx(5.0)}
  text = "\n".join(attention.table({"rows": rows, "growth": growth}))
  assert "skipped s=8192 w=1024 xla fwd+bwd: needs ~550 GB > 66 GB of the device" in text
  assert "0.90x" in text      # cudnn's fwd+bwd over pallas' at 8k


def test_the_report_writes_every_part_and_errors():
  report = {"device": "NVIDIA H100 80GB HBM3", "jax": "0.11.2", "parts": ["tests", "train", "run"], "results": {
      "tests": {"summary": "31 passed, 2 skipped in 80s", "lines": ["SKIPPED [1] x: why"], "seconds": 80},
      "train": {"suites": [{"size": "1.3b", "seq": 2048, "window": 512, "rows": [
          {"row": "baseline", "batch": 8, "remat": "dots", "step_s": 0.5, "tokens_per_sec": 32768.0,
           "tflops": 300.0, "mfu": 0.303},
          {"row": "+ LAMB 4x", "batch": 32, "error": "RESOURCE_EXHAUSTED: out of memory"}]}], "seconds": 100},
      "run": {"error": "Traceback: boom", "seconds": 1}}}
  text = gpu.markdown(report)
  assert "31 passed, 2 skipped" in text and "| baseline | 8 | dots | 500.0 | 32768 | 300.0 | 30.3% |" in text
  assert "skipped: RESOURCE_EXHAUSTED" in text and "Traceback: boom" in text


def test_train_sizes_and_parts_are_checked_with_the_fix():
  assert gpu._train_sizes("1.3b:2048,3b:8192") == [("1.3b", 2048), ("3b", 8192)]
  with pytest.raises(ValueError, match="SIZE:SEQ"):
    gpu._train_sizes("7b:2048")
  with pytest.raises(SystemExit, match="choose from tests,train,attention,run,checkpoint,profile"):
    gpu.gpu_check("/tmp/unused", "tests,bogus", 1, "tiny:32", 1)
  with pytest.raises(SystemExit, match="--budget_s=-1"):
    gpu.gpu_check("/tmp/unused", "tests", 1, "tiny:32", 1, budget_s=-1)


def test_the_default_parts_are_planned_inside_eight_minutes():
  """The parts a lease runs by default (launch/bench/gpu_lease.sh) are planned to fit 8
  minutes together, and the budget is their plan."""
  default = "tests,train,attention,run,checkpoint".split(",")
  assert sum(gpu.PLAN_S[part] for part in default) == gpu.BUDGET_S <= 480
  assert set(gpu.PLAN_S) == set(gpu.PARTS)


def test_a_part_past_its_limit_is_cut_and_recorded_with_its_log(tmp_path):
  """A part in its own process, killed at its limit with what it started (the run part's three
  megajax-train processes): recorded as cut, the log's tail kept, in about the limit."""
  start = time.time()
  result = gpu.run_part_limited("run", str(tmp_path), limit_s=3, flags=["--run_steps=30"])
  assert time.time() - start < 30
  assert result["error"].startswith("cut at its limit of 3 s"), result
  assert (tmp_path / "run.log").exists()


def test_profile_sorts_gpu_kernels_into_kinds():
  assert profile.kind_of("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT") == "matmul"
  assert profile.kind_of("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n") == "matmul"
  assert profile.kind_of("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "attention"
  assert profile.kind_of("_dkdv_kernel") == "attention"
  assert profile.kind_of("ncclDevKernel_AllGather_RING_LL") == "communication"
  assert profile.kind_of("loop_multiply_fusion_3") == "fusion"
  events = [{"name": "nvjet_x", "dur": 3000.0, "args": {"hlo_op": "dot.1"}},
            {"name": "loop_add_fusion", "dur": 1000.0, "args": {"hlo_op": "add_fusion"}}]
  summary = profile.summarize(events, steps=2)
  assert summary["busy_ms_per_step"] == pytest.approx(2.0)
  assert summary["by_kind"] == {"matmul": pytest.approx(1.5), "fusion": pytest.approx(0.5)}
  assert summary["top_ops"][0] == {"op": "dot.1", "kind": "matmul", "ms": pytest.approx(1.5)}


@pytest.mark.parametrize("budget_s", [0, 60])
def test_the_check_leaves_the_gpu_to_what_its_spawning_parts_start(tmp_path, monkeypatch, budget_s):
  """A process that starts a jax backend on a GPU takes its memory first (XLA preallocates), so
  neither the budgeted parent nor a tests / run part's own process asks jax for its devices:
  pytest's workers and the megajax-train runs get the GPU."""
  def no_backend():
    raise AssertionError("jax.devices() called: a backend would hold the GPU")
  monkeypatch.setattr(gpu.jax, "devices", no_backend)
  monkeypatch.setattr(gpu, "run_tests", lambda timeout_s: {"summary": "1 passed", "lines": [], "counts": {"passed": 1}})
  monkeypatch.setattr(gpu, "run_part_limited", lambda part, out, limit_s, flags: {"summary": "1 passed", "lines": []})
  gpu.gpu_check(str(tmp_path), "tests", 1, "tiny:32", 1, budget_s=budget_s)
  assert "1 passed" in (tmp_path / "gpu_check.md").read_text()
