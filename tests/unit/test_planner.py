"""The cost model and planner: memory and parameter counts, the published runs (calibration
set, validation set, the sources' own metrics), the calibration's fit, the search. (Memory
against XLA's compiled step: tests/integration; megajax-plan: tests/e2e.)"""

import dataclasses
import itertools
import os
import re

import jax
import pytest

from megajax import flops
from megajax.config import BLOCK_CHOICES, SCHEDULE_CHOICES, TRAVERSAL_CHOICES, ConfigError

from megajax.launch.bench import train as train_bench
from megajax.model import GPT, ModelConfig, count_params, init_params
from megajax.parallel import deviceless
from megajax.parallel.pipeline import Tables, simulate
from megajax.parallel.planner import (calibration, cost_model, explain, hardware, memory, memory_cpu_fit, memory_fit,
                                      memory_gpu_fit, memory_gpu_pipeline_fit, memory_measured, memory_measured_cpu,
                                      memory_measured_gpu, memory_measured_gpu_pipeline, plans, published)
from megajax.parallel.planner.calibration import MemoryCase
from megajax.parallel.planner.cost_model import CALIBRATION, MEGASCALE, MEGATRON, Plan
from megajax.parallel.planner.fits import estimate, plan_of


@pytest.fixture(scope="module")
def paper_setting():
  """MegaScale's 175B model and its A100s."""
  return published.megascale_model(), cost_model.HARDWARE["a100-80g"]


def test_memory_counts_dtypes_and_sharding(tiny_config):
  c = ModelConfig.from_config(tiny_config.model)
  one = memory.memory(c, Plan(1, 1, 1, 1, 4, 4, MEGASCALE))
  tiny_config.model.compute_dtype = "bfloat16"
  bf16 = memory.memory(ModelConfig.from_config(tiny_config.model), Plan(1, 1, 1, 1, 4, 4, MEGASCALE))
  assert bf16.activations < one.activations and bf16.state == one.state    # fp32 master either way
  zero = memory.memory(c, Plan(4, 1, 1, 1, 1, 4, MEGASCALE))
  assert zero.state == pytest.approx(one.state / 4, rel=0.05)              # ZeRO: 1/dp of the state


def test_param_counts_match_the_model(tiny_config):
  """Every block family (the plan's PTB switch keeps the model's parallel block), the
  RMSNorm, bias-free SwiGLU and tied head, Qwen2's biases on q, k and v alone, or the GPT
  defaults, as plan_of reads the config."""
  for block, (norm, mlp, use_bias, qkv_bias, tied) in itertools.product(
      BLOCK_CHOICES, (("layernorm", "gelu", True, False, False), ("rmsnorm", "swiglu", False, False, True),
                      ("rmsnorm", "swiglu", False, True, False))):
    tiny_config.model.update(block=block, norm=norm, mlp=mlp, use_bias=use_bias, qkv_bias=qkv_bias,
                             tie_embeddings=tied)
    model = GPT(ModelConfig.from_config(tiny_config.model))
    params = jax.eval_shape(lambda: init_params(model, jax.random.key(0)))
    plan = plan_of(tiny_config)
    switched = cost_model.apply_switches(model.config, plan.opts)
    assert switched.block == block
    counts = cost_model.param_counts(switched, plan)
    assert counts.model == counts.stage == counts.shard == count_params(params), (block, norm, mlp)


def test_stash_slots_and_bubble_match_the_schedule(tiny_config):
  for p, v, m in ((2, 1, 4), (4, 1, 8), (4, 2, 8), (4, 1, 4), (8, 3, 8), (3, 2, 6)):
    tiny_config.model.num_layers = p * v
    schedule = simulate("interleaved_1f1b" if v > 1 else "1f1b", p, v, m)
    tables = Tables.build(schedule, ModelConfig.from_config(tiny_config.model))
    plan = Plan(1, p, 1, v, 1, m)
    assert memory.stash_slots(plan) == tables.stash_slots
    assert plan.bubble_fraction == pytest.approx(schedule.bubble_fraction)


@pytest.mark.parametrize("schedule", SCHEDULE_CHOICES)
@pytest.mark.parametrize("traversal", TRAVERSAL_CHOICES)
def test_slot_formulas_equal_the_executor_tables(tiny_config, schedule, traversal):
  """stash_slots, cotangent_slots and residual_slots equal what Tables.build assigns, both
  executors, over a grid of (p, v, m): e.g. 1F1B p = 4 keeps 6 residual slots, interleaved v = 2
  10, whatever m beyond that; GPipe m v."""
  for p in (2, 3, 4, 8):
    for v in (1, 2, 3) if schedule != "1f1b" else (1,):
      for m in (1, 2, 3, 4, 6, 8, 12, 16):
        if schedule == "interleaved_1f1b" and v > 1 and m % p:
          continue
        tiny_config.model.num_layers = p * v
        timeline = simulate(schedule, p, v, m, traversal)
        for recompute in (False, True):
          tables = Tables.build(timeline, ModelConfig.from_config(tiny_config.model), recompute)
          plan = Plan(1, p, 1, v, 1, m, pipeline_recompute=recompute, schedule=schedule, traversal=traversal)
          got = (memory.stash_slots(plan), memory.cotangent_slots(plan), memory.residual_slots(plan))
          assert got == (tables.stash_slots, tables.cotangent_slots, tables.residual_slots), (p, v, m, recompute)
  assert memory.residual_slots(Plan(1, 4, 1, 1, 1, 64)) == 6
  assert memory.residual_slots(Plan(1, 4, 1, 2, 1, 64)) == 10


def test_pipeline_recompute_costs_a_forward_and_saves_memory(paper_setting):
  """megajax's pipeline: the default executor keeps residuals (no rerun, more memory unless
  remat full keeps only inputs there too); with pipeline_recompute it reruns each chunk's forward
  (a whole forward more per step) and keeps only the inputs. The remat policy's own recompute is there either way (full: every layer; dots
  with a fused attention: none, its kernel's backward reruns the scores and is counted there)."""
  c, hw = paper_setting
  plan = Plan(64, 8, 8, 6, 1, 768)
  default, rerun = plan, dataclasses.replace(plan, pipeline_recompute=True)
  for remat in ("dots", "full"):
    kept, again = cost_model.step_time(c, default, hw, remat), cost_model.step_time(c, rerun, hw, remat)
    assert kept.recompute < again.recompute and kept.mfu > again.mfu
    assert (kept.recompute > 0) == (remat == "full")      # the policy's own
    kept_bytes, rerun_bytes = memory.memory(c, default, remat).total, memory.memory(c, rerun, remat).total
    if remat == "dots":   # the projections' outputs in the residual slots
      assert kept_bytes > rerun_bytes
    else:                 # full: both keep only chunk inputs (XLA:GPU, measured on the fit set's base:
      assert abs(rerun_bytes / kept_bytes - 1) < 0.1   # the rerun 1% smaller; here -2.5%)
  # remat none: the rerun's matmuls are all the pipeline's (fused attention's backward recomputes its scores anyway)
  kept, again = cost_model.step_time(c, default, hw, "none"), cost_model.step_time(c, rerun, hw, "none")
  assert again.gemm == pytest.approx(kept.gemm * 4 / 3, rel=0.05)   # dX and dW GEMMs: other shapes


def test_block_families_in_the_step_time(paper_setting):
  """The two-norm block: the parallel block's tp collectives, its norms on the gathered
  sequence (more memory-bound time); SwiGLU: its third matmul in the GEMM time."""
  c, hw = paper_setting
  plan = Plan(32, 1, 8, 1, 1, 512)
  parallel, two_norms, swiglu = (cost_model.step_time(dataclasses.replace(c, **fields), plan, hw) for fields in (
      {}, {"block": "parallel_two_norms"}, {"mlp": "swiglu"}))
  assert two_norms.tp_comm == parallel.tp_comm and two_norms.memory_bound > parallel.memory_bound
  assert swiglu.gemm / parallel.gemm == pytest.approx(
      flops.projection_macs_per_token(dataclasses.replace(c, mlp="swiglu")) / flops.projection_macs_per_token(c),
      rel=0.05)   # the head's matmul too, and each GEMM shape's wave quantization


def test_table3_rows_increase_with_each_switch():
  """The calibration set, predicted with CALIBRATION: every MegaScale switch raises the MFU."""
  rows = [published.predict(run) for run in published.megascale_table3()]
  for before, after in zip(rows, rows[1:]):
    print(f"{after.run.where:40} predicted {after.predicted:.1f}% (paper {after.run.published:.1f}%)")
    assert after.predicted > before.predicted, after.run.where


def test_calibration_constants_are_the_least_squares_fit():
  """CALIBRATION holds the fit `python -m megajax.launch.bench planner` reprints (rounded), not
  hand-set values; the fit is a new value, and the module's is untouched by it."""
  before = dataclasses.replace(CALIBRATION)
  fitted = calibration.fit_calibration()
  for field in dataclasses.fields(fitted):
    value, held = getattr(fitted, field.name), getattr(CALIBRATION, field.name)
    assert held == pytest.approx(value, rel=0.06, abs=1e-9), field.name
  assert CALIBRATION == before and cost_model.CALIBRATION is CALIBRATION


def test_pipeline_memory_weights_are_the_fit_to_the_measured_data():
  """XLA_PIPELINE is memory_fit.fit of the stored measurements (every fit case measured, none a
  held-out memory-check case), and the fit holds its cases: rms under 6%, each within 15%."""
  assert set(memory_measured.MEASURED) == {case.name for case in memory_fit.PIPELINE_FIT_CASES}
  held_out = [case.overrides for case in calibration.MEMORY_CASES]
  assert not any(case.overrides in held_out for case in memory_fit.PIPELINE_FIT_CASES)
  fitted, errors = memory_fit.fit(memory_measured.MEASURED)
  assert fitted == pytest.approx(memory.XLA_PIPELINE, abs=0.006)
  assert sum(e * e for e in errors.values()) / len(errors) < 0.06 ** 2
  assert max(abs(e) for e in errors.values()) < 0.15


def test_cpu_memory_weights_are_the_fit_to_xla_cpu_and_hold_the_held_out_cases():
  """XLA_CPU is memory_cpu_fit.fit of XLA:CPU's stored bytes of the single-stage fit set; every
  held-out calibration.MEMORY_CASES config (none a fit config of either CPU fit: the single stage
  in bf16, pp 4 with v 2, several fields changed at once among them) is predicted within 10% of
  its stored XLA bytes but for calibration.MEMORY_KNOWN_MISSES (tests/integration/
  test_planner_memory.py compiles some again: the stored bytes are XLA's own)."""
  fit_cases, held_out = memory_cpu_fit.CPU_FIT_CASES, calibration.MEMORY_CASES
  assert list(memory_measured_cpu.FIT) == [case.name for case in fit_cases]
  assert list(memory_measured_cpu.HELD_OUT) == [case.name for case in held_out]
  fitted_overrides = [case.overrides for case in fit_cases + memory_fit.PIPELINE_FIT_CASES]
  assert not any(case.overrides in fitted_overrides for case in held_out)
  fitted, errors = memory_cpu_fit.fit(memory_measured_cpu.FIT)
  assert fitted == pytest.approx(memory.XLA_CPU, abs=0.006)
  # 0.17: the worst fit case since the microbatch ordering, h 256 seq 32 with 4 microbatches on
  # dp 4 in bf16, is -16.1% (parameters outweigh activations there; the dp gather weighs 0 on CPU)
  assert max(abs(e) for e in errors.values()) < 0.17
  for case in held_out:
    error = calibration.predicted_bytes(calibration.memory_case_config(case)) / memory_measured_cpu.HELD_OUT[case.name] - 1
    print(f"{case.name:70} {100 * error:+.1f}%")
    assert (abs(error) <= calibration.MEMORY_TOLERANCE) != (case.name in calibration.MEMORY_KNOWN_MISSES), case.name


def test_gpu_memory_weights_are_the_fit_to_xla_gpu_and_hold_the_held_out_cases():
  """XLA_GPU is memory_gpu_fit.fit of XLA:GPU's stored bytes (a described H100) of the fit set;
  the held-out cases, none a fit config (the MFU suite's 1.3B and 3B rows among them), are
  predicted within 10% of XLA:GPU's bytes but for the known misses (no MFU row under-predicted:
  a row over by more is refused or run with fewer sequences a microbatch, one under may not fit)."""
  fit_cases, held_out = memory_gpu_fit.GPU_FIT_CASES, memory_gpu_fit.GPU_HELD_OUT
  assert set(memory_measured_gpu.FIT) == {case.name for case in fit_cases}
  assert set(memory_measured_gpu.HELD_OUT) == {case.name for case in held_out}
  assert not any(case.overrides == other.overrides for case in fit_cases for other in held_out)
  fitted, errors = memory_gpu_fit.fit(memory_measured_gpu.FIT)
  assert fitted == pytest.approx(memory.XLA_GPU, abs=0.006)
  # 0.17: the worst fit case since tp 8 joined the fit set (2026-12-06), tp 8 at h 1024, is -16.6%
  # (the head's ring transfers all in flight)
  assert max(abs(e) for e in errors.values()) < 0.17
  predicted = {case.name: memory_gpu_fit.predicted_bytes(case) for case in held_out}
  missed = {name for name in predicted if not memory_gpu_fit.within(
      name, predicted[name], memory_measured_gpu.HELD_OUT[name], memory_measured_gpu.BUDGETED)}
  assert missed == set(memory_gpu_fit.GPU_KNOWN_MISSES)
  assert all(predicted[name] / memory_measured_gpu.HELD_OUT[name] - 1 > -calibration.MEMORY_TOLERANCE
             for name in predicted if name.startswith("MFU"))


def test_a_described_gpu_with_less_memory_is_the_same_gpu_with_that_memory():
  """deviceless.with_memory names a target XLA compiles for as a smaller device (the budgeted
  memory checks); a malformed one is refused naming the target."""
  smaller = deviceless.described(deviceless.with_memory("h100-80g", 3 * 2**30 + 5))
  assert smaller.memory_bytes == 3 * 2**30
  assert dataclasses.replace(smaller, memory_bytes=deviceless.GPU_TARGETS["h100-80g"].memory_bytes) == (
      deviceless.GPU_TARGETS["h100-80g"])
  for name in ("h100-80g@3GiB", "h100-40g@100MiB", "h100-80g@MiB"):
    with pytest.raises(ConfigError, match="^target="):
      deviceless.described(name)


def test_a_case_under_its_estimate_by_more_than_10_percent_is_within_only_if_it_fits_the_budgeted_device():
  """memory_gpu_fit.within: 80 GB bytes within 10% pass; above the estimate by more, only a
  compile for a device of at most BUDGET x the current estimate that the program fits counts."""
  within = memory_gpu_fit.within
  assert within("a", 95.0, 100, {}) and within("a", 109.0, 100, {}) and not within("a", 111.0, 100, {})
  assert not within("a", 80.0, 100, {})
  assert within("a", 80.0, 100, {"a": [88, 87]})           # fits a device of 1.1 x the estimate
  assert not within("a", 80.0, 100, {"a": [88, 89]})       # rescheduled, still over the device
  assert not within("a", 70.0, 100, {"a": [88, 87]})       # measured at a larger estimate than today's
  assert not within("a", 120.0, 100, {"a": [132, 100]})    # over-predictions are judged at 80 GB


def test_the_fit_margin_covers_every_held_out_gpu_case_at_planner_sizes():
  """A fit decision (plans.assess, fits.check_fits) raises the estimate by memory.estimate_margin:
  every held-out GPU case of 1 GiB and more (single stage and pipeline, never fitted on) is under
  its estimate so raised, and the margin is no looser than the worst case needs by more than 5
  points."""
  cases = [(case, memory_measured_gpu.HELD_OUT[case.name]) for case in memory_gpu_fit.GPU_HELD_OUT] + [
      (case, memory_measured_gpu_pipeline.HELD_OUT[case.name]) for case in memory_gpu_pipeline_fit.GPU_PIPELINE_HELD_OUT]
  budgeted = {**memory_measured_gpu.BUDGETED, **memory_measured_gpu_pipeline.BUDGETED}
  needed = 0.0
  for case, measured in cases:
    if measured < 2**30:
      continue
    margin = memory.estimate_margin(plan_of(memory_gpu_fit.case_config(case), "gpu"))
    predicted = memory_gpu_fit.predicted_bytes(case)
    # What the case needs: its 80 GB bytes, or less where it fits a smaller device measured for it.
    device, held = budgeted.get(case.name, (measured, measured))
    need = held if held <= device <= predicted * (1 + margin) else measured
    assert margin == memory.ESTIMATE_MARGIN and predicted * (1 + margin) >= need, case.name
    needed = max(needed, need / predicted - 1)
  assert memory.ESTIMATE_MARGIN - needed <= 0.05, needed


def test_gpu_pipeline_memory_weights_are_the_fit_to_xla_gpu_and_hold_the_held_out_cases():
  """XLA_GPU_PIPELINE is memory_gpu_pipeline_fit.fit of XLA:GPU's stored bytes of the pipeline
  fit set; the held-out pipelines (none a fit config) within 10% but for the known misses; the
  planner weighs a GPU pipeline with it, a CPU one with XLA_PIPELINE."""
  fit_cases, held_out = memory_gpu_pipeline_fit.GPU_PIPELINE_FIT_CASES, memory_gpu_pipeline_fit.GPU_PIPELINE_HELD_OUT
  assert list(memory_measured_gpu_pipeline.FIT) == [case.name for case in fit_cases]
  assert list(memory_measured_gpu_pipeline.HELD_OUT) == [case.name for case in held_out]
  assert not any(case.overrides == other.overrides for case in fit_cases for other in held_out)
  fitted, errors = memory_gpu_pipeline_fit.fit(memory_measured_gpu_pipeline.FIT)
  assert fitted == pytest.approx(memory.XLA_GPU_PIPELINE, abs=0.006)
  assert max(abs(e) for e in errors.values()) < 0.15
  misses = {case.name for case in held_out
            if abs(memory_gpu_fit.predicted_bytes(case) / memory_measured_gpu_pipeline.HELD_OUT[case.name] - 1)
            > calibration.MEMORY_TOLERANCE}
  assert misses == set(memory_gpu_pipeline_fit.GPU_PIPELINE_KNOWN_MISSES)
  config = memory_gpu_fit.case_config(held_out[0])
  c = ModelConfig.from_config(config.model)
  on = {platform: memory.memory(c, plan_of(config, "gpu"), platform=platform).total for platform in ("gpu", "cpu")}
  assert on["gpu"] != on["cpu"]


@pytest.mark.parametrize("size,shape,seq", [("1.3b", memory_gpu_fit._1P3B, 2048), ("3b", memory_gpu_fit._3B, 8192)])
def test_the_gpu_memory_cases_mfu_rows_are_the_suites_own(size, shape, seq):
  """memory_gpu_fit writes the MFU suite's rows again (the planner sits below launch/bench):
  each is bench train's row_config, field for field, but the remat the case names."""
  fields = {"model": ("num_layers", "hidden_dim", "num_heads", "vocab_size", "seq_len", "window", "block",
                      "attention_impl", "compute_dtype"), "optimizer": ("name",), "train": ("batch_size", "microbatches")}
  for row in range(len(train_bench.ROWS)):
    suite = train_bench.row_config(size, seq, seq // 4, row, on_gpu=True)
    case = memory_gpu_fit.case_config(MemoryCase("row", memory_gpu_fit._suite_row(shape, seq, "full", row)))
    for section, names in fields.items():
      assert {n: case[section][n] for n in names} == {n: suite[section][n] for n in names}, (size, row, section)


def test_the_mfu_suites_3b_lamb_row_takes_smaller_microbatches_to_fit_an_h100():
  """bench train's rule (fit_to): remat full, then the same batch in more microbatches until
  the estimate fits 92% of an H100 (80 GB). The 3B LAMB 4x row at s = 8192 fits with remat full
  and its 4 microbatches since they run one after another (XLA:GPU 68.18 GiB, was 81.20: it took
  8); on a smaller device it still takes more."""
  limit = train_bench.GPU_MEMORY_FRACTION * deviceless.GPU_TARGETS["h100-80g"].memory_bytes
  row = lambda: train_bench.row_config("3b", 8192, 2048, train_bench.ROWS.index("+ LAMB 4x"), True)
  config = train_bench.fit_to(row(), limit)
  assert (config.model.remat, config.train.batch_size, config.train.microbatches) == ("full", 16, 4)
  assert estimate(config, "gpu").total <= limit
  smaller = train_bench.fit_to(row(), 0.8 * limit)
  assert smaller.train.microbatches > 4 and estimate(smaller, "gpu").total <= 0.8 * limit
  baseline = train_bench.fit_to(train_bench.row_config("1.3b", 2048, 512, 0, True), limit)
  assert (baseline.model.remat, baseline.train.microbatches) == ("dots", 1)


def test_every_device_no_published_run_validates_is_marked_extrapolated():
  """megajax-plan says so beside an H100's or H200's figures: every published run it is fitted
  and validated on ran on A100s (published.predict evaluates them there), the only measured row."""
  assert "a100-80g" not in hardware.EXTRAPOLATED
  assert set(hardware.EXTRAPOLATED) == set(cost_model.HARDWARE) - {"a100-80g"}
  assert published.PEAK_TFLOPS == flops.PEAK_BF16_TFLOPS["a100"]


def test_rows_with_unstated_values_carry_their_alternatives_and_an_error_range():
  """Every row that assumes something the source does not state carries the plans its other
  plausible values give; bench planner prints the error over all of them (the assumed plan's
  error inside the range). Narayanan et al.'s Table 1 (microbatch not stated): 1 and 4 beside
  the assumed 2; its Table 2 states microbatch 1: no other microbatch there."""
  runs = published.all_runs()
  assert all(run.alternatives for run in runs if "microbatch" in run.assumed or "1F1B" in run.assumed)
  for run in runs:
    low, high = published.error_range(run)
    assert low <= published.predict(run).error <= high
  table1 = [run for run in runs if run.where.startswith("Table 1, ")]
  assert all({1, 4} <= {plan.micro_batch for plan in run.alternatives} for run in table1
             if (run.plan.batch // run.plan.dp) % (4 * run.plan.pp) == 0)
  table2 = [run for run in runs if run.where.startswith("Table 2, PTD-P")]
  assert all(plan.micro_batch == 1 for run in table2 for plan in run.alternatives)
  # MegaScale does not state its recomputation: selective (the Megatron-LM 175B recipe), with
  # none and full in the range; the other sources state theirs.
  assert all(run.remat == "dots" and set(run.remat_alternatives) == {"none", "full"} and "recomputation" in run.assumed
             for run in runs if run.source == "MegaScale")
  assert not any(run.remat_alternatives for run in runs if run.source != "MegaScale")
  full = published.predict(dataclasses.replace(runs[0], remat="full")).error
  assert published.error_range(runs[0])[0] <= full
  # Megatron-LM's distributed optimizer (MegaScale's rows without its DP overlap): plain all-reduce beside it.
  megatron = [run for run in runs if run.source == "MegaScale" and not run.plan.opts.dp_overlap]
  assert megatron and all("distributed optimizer" in run.assumed and any(
      not plan.distributed_optimizer for plan in run.alternatives) for run in megatron)


def test_every_megajax_executor_term_says_how_it_is_known_and_its_tests_exist():
  """explain.MEGAJAX_TERMS labels each way megajax's executor is modelled apart from the paper's:
  HLO-verified ones name the tests that check the compiled step, and those tests exist."""
  kinds = ("HLO-verified", "schedule-read", "counted", "not in the step time")
  assert all(known.startswith(kinds) for _, known in explain.MEGAJAX_TERMS)
  sources = "".join(open(os.path.join(os.path.dirname(__file__), name)).read()
                    for name in ("test_parallel.py", "test_planner.py"))
  named = re.findall(r"\btest_[a-z_]+\b(?!\.py)", " ".join(known for _, known in explain.MEGAJAX_TERMS))
  assert named and all(f"def {name}(" in sources for name in named), named


def test_no_constant_is_fitted_to_a_row_it_is_validated_on():
  """The calibration set is MegaScale's Table 3 (Table 2's 256-GPU MegaScale row, the same run
  as its last, counted once: not in either set), the validation set everything else (Narayanan
  et al.'s Table 2 among it); no run is in twice, no validation run has a calibration run's
  model, plan and recomputation, and the fit reads only the calibration set."""
  calibration_runs, validation_runs = published.calibration_set(), published.validation_set()
  assert calibration_runs and validation_runs
  assert {run.where for run in calibration_runs} == {run.where for run in published.megascale_table3()}
  assert sum(run.where.startswith("Table 2, PTD-P") for run in validation_runs) == 6
  every = [(run.model, run.plan, run.remat, run.published) for run in published.all_runs()]
  assert len(every) == len(set(every))
  keys = lambda runs: {(run.model, run.plan, run.remat) for run in runs}
  assert not keys(calibration_runs) & keys(validation_runs)
  assert {run.source for run in published.all_runs()} == set(published.SOURCES)
  assert calibration.fit_calibration(calibration_runs) == calibration.fit_calibration()            # what it reads by default


def test_published_metrics_follow_the_sources_formulas():
  """Korthikanti et al.: MFU = 72 B s L h^2 (1 + s/6h + V/12hL) / (t x GPUs x 312 TFLOP/s) (their
  530B row: 37.83 s -> 56.0%); Narayanan et al.: TFLOP/s with the recomputed forward (their 1T row:
  163 TFLOP/s on 3072 GPUs is 502 PFLOP/s)."""
  run = next(r for r in published.korthikanti() if r.where.startswith("Table 5, 530B") and "present" in r.where)
  assert published._mfu_of_seconds(run, 37.83) == pytest.approx(56.0, abs=0.1)
  one_t = next(r for r in published.narayanan() if "1008.0B" in r.where)
  seconds = published.model_flops(one_t) / (163e12 * 3072)
  assert published.model_flops(one_t) / seconds / 1e15 == pytest.approx(502.0, rel=0.01)
  assert 100 < seconds < 106            # about 103 s an iteration


def test_validation_rows_meet_the_goal_but_the_known_misses():
  """Every validation row within +-3 MFU points or +-6% TFLOP/s, but those published.KNOWN_MISSES
  names with the reason; a known miss that starts to pass is taken off that list."""
  for row in calibration.validate_published():
    print(f"{row.run.where:64} published {row.run.published:6.1f} predicted {row.predicted:6.1f} ({row.error:+.1f})")
    assert row.within_goal != (row.run.where in published.KNOWN_MISSES), row.run.where


def test_leave_one_out_errors_for_every_calibration_row():
  """Each calibration row predicted by the fit to the others (bench planner prints them)."""
  rows = calibration.leave_one_out()
  assert [run.where for run, _, _ in rows] == [run.where for run in published.calibration_set()]
  assert any(held_out != full for _, full, held_out in rows)     # refitted, not the full fit reused
  for run, full, held_out in rows:
    print(f"{run.where:40} {full:+.1f} held out {held_out:+.1f}")


def test_step_time_scales_with_the_work():
  """No fixed seconds per step: twice the batch on the same plan is twice the step, less only the
  optimizer's pass and the pipeline's bubble, which do not grow with it."""
  run = next(r for r in published.korthikanti() if r.where.startswith("Table 5, 22B") and "present" in r.where)
  hw = cost_model.HARDWARE["a100-80g"]
  one = cost_model.step_time(run.model, run.plan, hw, run.remat)
  two = cost_model.step_time(run.model, dataclasses.replace(run.plan, batch=2 * run.plan.batch), hw, run.remat)
  without = lambda t: t.total - t.optimizer - t.straggler        # the straggler wait is a share of the rest
  assert without(two) == pytest.approx(2 * without(one), rel=1e-6)
  assert two.straggler / (two.total - two.straggler) == pytest.approx(one.straggler / (one.total - one.straggler))
  assert one.total < 1.5                     # the 22B step of 1.10 s is not swamped by overheads


def test_gemm_model_is_the_measured_rate_at_the_measured_shape():
  hw = hardware.HARDWARE["a100-80g"]
  m, n = hardware.MEASURED_GEMM_SHAPE
  seconds = hardware.gemm_seconds(m, n, 5120, hw, 1.0)
  assert 2 * m * n * 5120 / seconds / 1e12 == pytest.approx(271.2, rel=1e-6)
  assert hardware.wave_efficiency(2048, 4608, 108) == pytest.approx(288 / 324)   # 288 tiles in 3 waves


def test_search_returns_even_plans_that_fit(paper_setting):
  c, hw = paper_setting
  gpus, batch = 12288, 6144
  for executor, remat in (("paper", "dots"), ("megajax", "full")):
    best, even = plans.search(c, gpus, batch, hw, MEGASCALE, executor, remat)
    assert 0 < len(best) < even
    assert [x.time.mfu for x in best] == sorted((x.time.mfu for x in best), reverse=True)
    for x in best:
      p = x.plan
      assert p.gpus == gpus and p.tp <= hw.gpus_per_node
      assert c.num_layers % (p.pp * p.virtual_stages) == 0 and batch % (p.dp * p.micro_batch) == 0
      assert p.virtual_stages == 1 or p.microbatches % p.pp == 0
      assert x.fits and x.memory.total <= cost_model.usable_bytes(hw)
    print(f"{executor}: {plans.describe(best[0].plan)}: MFU {best[0].time.mfu:.1%}, "
          f"bottleneck {best[0].time.bottleneck}")
  # Too little memory: 175B on 8 GPUs fits nowhere.
  assert not plans.search(c, 8, 64, hw, MEGATRON, "paper", "dots")[0]


def test_megajax_plans_rerun_the_chunk_only_where_residuals_do_not_fit(paper_setting):
  """On 256 GPUs the best plans keep their residuals (remat none: deep pipelines, pp 16); where
  a plan's residuals do not fit and its reruns do, that plan is chosen explicitly
  (pipeline_recompute), shown in its row and in its config overrides."""
  c, hw = paper_setting
  for remat in ("none", "dots"):
    best, _ = plans.search(c, 256, 768, hw, MEGASCALE, "megajax", remat)
    assert not best[0].plan.pipeline_recompute, remat
    rerun = [(i, x) for i, x in enumerate(best, 1) if x.plan.pipeline_recompute]
    assert rerun, remat
    for i, x in rerun:
      assert not plans.assess(c, dataclasses.replace(x.plan, pipeline_recompute=False), hw, remat).fits
      assert plans.plan_line(i, x).endswith("; pipeline_recompute")
      assert "--config.parallel.pipeline_recompute=True" in plans.config_overrides(x.plan)


def test_megajax_dp_overlap_is_what_its_step_does(paper_setting):
  """megajax's exposed dp communication as built: with pp = 1 the gathers one layer ahead in
  the first microbatch's forward and the reduce-scatters under the backward (at least one
  layer's exposed: only one microbatch's forward hides the gathers); with pp > 1 the first
  chunk's and the shared leaves' exposed, the other chunks' in the tick scan's head and tail,
  more than the paper's executor, which also prefetches the first chunk's."""
  c, hw = paper_setting
  for pp, v in ((1, 1), (8, 4), (8, 1)):
    plan = Plan(32, pp, 8, v, 1, 32 * 16)
    serial = cost_model.step_time(c, dataclasses.replace(plan, opts=dataclasses.replace(MEGASCALE, dp_overlap=False)), hw)
    overlapped = cost_model.step_time(c, plan, hw)
    paper_executor = cost_model.step_time(c, dataclasses.replace(plan, executor="paper"), hw)
    layers = c.num_layers // pp
    if pp == 1:
      assert serial.dp_comm / layers <= overlapped.dp_comm < serial.dp_comm, (overlapped, serial)
    elif v == 1:     # one chunk: nothing to move into the edge ticks
      assert overlapped.dp_comm == serial.dp_comm
    else:
      assert paper_executor.dp_comm < overlapped.dp_comm < serial.dp_comm, (overlapped, serial)


def test_a_job_waits_for_its_slow_machines_more_often_as_it_grows(paper_setting):
  """The straggler part: the rest of the step x Calibration.straggler_slowdown x the chance that
  one of the job's nodes is among MegaScale's 0.5% slow ones (1 - 0.995^nodes)."""
  c, hw = paper_setting
  assert hardware.slow_machine_chance(8, hw) == pytest.approx(0.005)
  assert hardware.slow_machine_chance(9, hw) == pytest.approx(1 - 0.995 ** 2)        # a second node
  chances = [hardware.slow_machine_chance(gpus, hw) for gpus in (256, 1024, 3072, 12288)]
  assert chances == sorted(chances) and chances[0] < 0.2 < 0.99 < chances[-1]
  for dp in (4, 192):
    t = cost_model.step_time(c, Plan(dp, 8, 8, 4, 1, 32 * dp), hw)
    rest = t.total - t.straggler
    assert t.straggler == pytest.approx(rest * CALIBRATION.straggler_slowdown * hardware.slow_machine_chance(64 * dp, hw))
    slow = cost_model.step_time(c, Plan(dp, 8, 8, 4, 1, 32 * dp), hw,
                                calibration=dataclasses.replace(CALIBRATION, straggler_slowdown=0.0))
    assert slow.total == pytest.approx(rest) and slow.straggler == 0


def test_a_hidden_collective_slows_the_compute_under_it(paper_setting):
  """hardware.OVERLAP_SLOWDOWN (Lee et al. 2025): what a collective hides costs that share of its
  time; an exposed one costs itself. The tp collective-matmul ring, all hidden, costs exactly it."""
  assert hardware.overlapped_seconds(1.0, 1.0) == 1.0
  assert hardware.overlapped_seconds(1.0, 0.25) == pytest.approx(0.25 + 0.75 * hardware.OVERLAP_SLOWDOWN)
  c, hw = paper_setting
  plan = Plan(4, 8, 8, 4, 1, 256)
  without = cost_model.step_time(c, dataclasses.replace(plan, opts=dataclasses.replace(MEGASCALE, tp_overlap=False)), hw)
  with_ring = cost_model.step_time(c, plan, hw)
  assert CALIBRATION.tp_overlap_hidden == 1.0
  assert with_ring.tp_comm == pytest.approx(hardware.OVERLAP_SLOWDOWN * without.tp_comm)


def test_megascale_table2_loses_mfu_with_scale_as_published():
  """Issue 34's goal: the MegaScale system's predicted fall from 256 to 12,288 GPUs within
  SLOPE_GOAL_POINTS of the published one (1.8 short); Megatron-LM's (2.7 short) held where it is.
  Without a slow-machine term it is 6.5 short: the goal rests on MegaScale's measured 10%."""
  slopes = published.scale_slope()
  for system, (fall, predicted) in slopes.items():
    print(f"{system}: published {fall:+.1f}, predicted {predicted:+.1f}")
    assert fall < predicted < 0
  assert abs(slopes["MegaScale"][1] - slopes["MegaScale"][0]) <= published.SLOPE_GOAL_POINTS
  assert abs(slopes["Megatron-LM"][1] - slopes["Megatron-LM"][0]) < 3.0
  assert CALIBRATION.straggler_slowdown == hardware.SLOW_MACHINE_SLOWDOWN == 0.10
  assert "straggler_slowdown" not in calibration.FITTED


def test_megatron_activations_in_flight_follow_the_published_counts():
  """Korthikanti et al.: the first stage of 1F1B holds p microbatches (not 2p - 1), interleaved
  p (1 + (p-1)/(p v)), GPipe all m; their 1T run (tp 8, pp 64, 512 A100 80 GB) fits."""
  plan = Plan(1, 64, 8, 1, 1, 512, MEGATRON, "paper")
  assert memory.megatron_microbatches_in_flight(plan) == 64
  assert memory.megatron_microbatches_in_flight(dataclasses.replace(plan, virtual_stages=2)) == 64 * (1 + 63 / 128)
  assert memory.megatron_microbatches_in_flight(dataclasses.replace(plan, schedule="gpipe")) == 512
  one_t = next(r for r in published.korthikanti() if r.where.startswith("Table 5, 1T") and "present" in r.where)
  x = plans.assess(one_t.model, one_t.plan, cost_model.HARDWARE["a100-80g"], one_t.remat)
  print(f"1T on 512 A100s: {x.memory.total / 1e9:.1f} GB")
  assert x.fits


def test_plans_read_with_their_parts_and_why_the_first_wins(paper_setting):
  c, hw = paper_setting
  best, _ = plans.search(c, 256, 768, hw, MEGASCALE, "paper", "dots")
  for x in best[:3]:
    assert sum(explain.memory_parts(x).values()) == pytest.approx(x.memory.total)
    assert sum(x.time.parts().values()) == pytest.approx(x.time.total)
  for other in best[1:4]:
    line = explain.why_first(best[0], other)
    assert line.startswith("#1 over this: ") and "step -" in line
    # The parts shown (the largest either way, then the rest) add up to the step's change.
    parts = [float(x) for x in re.findall(r" ([+-]\d+\.\d+) s", line.split("(step")[0])]
    step = float(re.search(r"step ([+-]\d+\.\d+) s", line).group(1))
    assert sum(parts) == pytest.approx(step, abs=0.005 * len(parts) + 0.005), line
    tie = abs(best[0].time.total - other.time.total) <= explain.TIE_FRACTION * best[0].time.total
    assert line.endswith("a tie: within the model's error") == tie
  assert explain.why_first(best[0], best[0]).endswith("a tie: within the model's error")
  lines = explain.explain(c, best[0].plan, hw, "dots")
  assert lines[0].startswith(f"plan {plans.describe(best[0].plan)}") and any("TFLOP/s per GPU" in x for x in lines)
  with pytest.raises(ValueError, match="five positive integers"):
    explain.parse_explain("8,4,8", 768, MEGASCALE, "paper")
