"""The cost model and planner: memory against XLA, MFU against the MegaScale paper, the search, the CLI."""

import jax
import numpy as np
import pytest

from megajax.launch import bench_planner
from megajax.model import GPT, ModelConfig, count_params, init_params
from megajax.parallel import cost_model, planner
from megajax.parallel.cost_model import MEGASCALE, MEGATRON, Plan
from tests.conftest import run_module


@pytest.fixture(scope="module")
def paper():
  return bench_planner.paper_model(), bench_planner.a100()


@pytest.mark.parametrize("case", bench_planner.MEMORY_CASES, ids=lambda case: case.name)
def test_memory_matches_xla_memory_analysis(case):
  """Bytes per device of the real compiled train step (arguments + outputs - aliased + temp)."""
  config = bench_planner.memory_case_config(case)
  predicted, measured = bench_planner.predicted_bytes(config), bench_planner.measured_bytes(config)
  print(f"{case.name}: predicted {predicted / 1e6:.2f} MB, XLA {measured / 1e6:.2f} MB")
  assert abs(predicted / measured - 1) <= bench_planner.MEMORY_TOLERANCE, (predicted, measured)


def test_memory_counts_dtypes_and_sharding(tiny_config):
  c = ModelConfig.from_config(tiny_config.model)
  one = cost_model.memory(c, Plan(1, 1, 1, 1, 4, 4, MEGASCALE))
  tiny_config.model.compute_dtype = "bfloat16"
  bf16 = cost_model.memory(ModelConfig.from_config(tiny_config.model), Plan(1, 1, 1, 1, 4, 4, MEGASCALE))
  assert bf16.activations < one.activations and bf16.state == one.state    # fp32 master either way
  zero = cost_model.memory(c, Plan(4, 1, 1, 1, 1, 4, MEGASCALE))
  assert zero.state == pytest.approx(one.state / 4, rel=0.05)              # ZeRO: 1/dp of the state


def test_param_counts_match_the_model(tiny_config):
  for block in ("parallel", "serial"):
    tiny_config.model.block = block
    model = GPT(ModelConfig.from_config(tiny_config.model))
    params = jax.eval_shape(lambda: init_params(model, jax.random.key(0)))
    plan = Plan(1, 1, 1, 1, 1, 4, cost_model.Optimizations(ptb=block == "parallel"))
    counts = cost_model.param_counts(cost_model.apply_switches(model.config, plan.opts), plan)
    assert counts.model == counts.stage == counts.shard == count_params(params)


def test_stash_slots_and_bubble_match_the_schedule(tiny_config):
  from megajax.parallel import pipeline
  from megajax.parallel.schedule import simulate
  for p, v, m in ((2, 1, 4), (4, 1, 8), (4, 2, 8), (4, 1, 4), (8, 3, 8), (3, 2, 6)):
    tiny_config.model.num_layers = p * v
    schedule = simulate("interleaved_1f1b" if v > 1 else "1f1b", p, v, m)
    tables = pipeline.Tables.build(schedule, ModelConfig.from_config(tiny_config.model))
    plan = Plan(1, p, 1, v, 1, m)
    assert cost_model.stash_slots(plan) == tables.stash_slots
    assert plan.bubble_fraction == pytest.approx(schedule.bubble_fraction)


def test_table3_rows_increase_with_the_papers_increments(paper):
  rows = planner.table3(*paper)
  for (ours, theirs), row in zip(planner.table3_increments(rows), rows[1:]):
    print(f"{row.name:24} predicted {row.predicted:.1f}% (+{ours:.1f}), paper {row.published:.1f}% (+{theirs:.1f})")
    assert ours > 0, row.name
    assert abs(ours - theirs) <= planner.TABLE3_INCREMENT_TOLERANCE, row.name
  assert abs(rows[0].error) <= planner.TABLE2_TOLERANCE


def test_table2_within_five_points(paper):
  for megatron, megascale in planner.table2(*paper):
    for row in (megatron, megascale):
      assert abs(row.error) <= planner.TABLE2_TOLERANCE, (row.plan, row.predicted, row.published)
    assert megascale.predicted > megatron.predicted


def test_calibration_constants_are_the_least_squares_fit(paper):
  """The constants in cost_model are the fit bench_planner reprints (rounded), not hand-set."""
  fitted = bench_planner.fit(*paper)
  for name, value in fitted.items():
    held = bench_planner._get(name)
    assert held == pytest.approx(value, rel=0.06, abs=2e-5), name


def test_search_returns_even_plans_that_fit(paper):
  c, hw = paper
  gpus, batch = 12288, 6144
  for executor, remat in (("paper", "dots"), ("megajax", "full")):
    best, even = planner.search(c, gpus, batch, hw, MEGASCALE, executor, remat)
    assert 0 < len(best) < even
    assert [x.time.mfu for x in best] == sorted((x.time.mfu for x in best), reverse=True)
    for x in best:
      p = x.plan
      assert p.dp * p.pp * p.tp == gpus and p.tp <= hw.gpus_per_node
      assert c.num_layers % (p.pp * p.virtual_stages) == 0 and batch % (p.dp * p.micro_batch) == 0
      assert p.virtual_stages == 1 or p.microbatches % p.pp == 0
      assert x.fits and x.memory.total <= cost_model.usable_bytes(hw)
    print(f"{executor}: {planner.describe(best[0].plan)}: MFU {best[0].time.mfu:.1%}, "
          f"bottleneck {best[0].time.bottleneck}")
  # Too little memory: 175B on 8 GPUs fits nowhere.
  assert not planner.search(c, 8, 64, hw, MEGATRON, "paper", "dots")[0]


def test_plan_cli_prints_the_best_plan_with_its_bottleneck():
  result = run_module(["-m", "megajax.launch.plan", "--config=configs/gpt_175b.py", "--gpus=12288",
                       "--hardware=a100-80g", "--batch=6144", "--top=3"], timeout=120)
  print(result.stdout)
  assert result.returncode == 0, result.stderr
  lines = result.stdout.splitlines()
  header = next(i for i, line in enumerate(lines) if "bottleneck" in line)
  assert lines[header + 1].split()[0] == "1" and "compute" in lines[header + 1]
  assert lines[-1].startswith("best: dp=")


@pytest.mark.parametrize("flags, flag", [(["--gpus=12288", "--hardware=a200"], "--hardware=a200"),
                                         (["--gpus=12290"], "--gpus=12290"),
                                         (["--gpus=8", "--batch=64"], "--gpus=8")])
def test_plan_cli_bad_input_is_one_line_naming_the_flag(flags, flag):
  result = run_module(["-m", "megajax.launch.plan", "--config=configs/gpt_175b.py", *flags], timeout=120)
  assert result.returncode == 2
  error = result.stderr.strip().splitlines()
  assert len(error) == 1 and flag in error[0] and "; " in error[0], result.stderr


def test_mfu_suite_rows_add_one_switch_each_and_run_on_cpu():
  """The MFU suite's harness (megajax.launch.bench_train): each ablation row changes what its
  name says and nothing else, and the rows compile and run on CPU (MFU n/a there)."""
  from megajax.launch.bench_train import ROWS, measure, row_config
  fields = ("model.block", "model.window", "model.attention_impl", "optimizer.name", "train.batch_size",
            "train.microbatches")

  def values(row, on_gpu=True):
    c = row_config("tiny", 32, 8, row, on_gpu)
    return {f: c[f.split(".")[0]][f.split(".")[1]] for f in fields}

  changed = [{f for f in fields if values(r)[f] != values(r - 1)[f]} for r in range(1, len(ROWS))]
  assert changed == [{"model.block"}, {"model.window"}, {"model.attention_impl"},
                     {"optimizer.name", "train.batch_size", "train.microbatches"}]
  assert values(0)["model.attention_impl"] == "cudnn" and values(3)["model.attention_impl"] == "pallas"
  assert values(4)["train.batch_size"] == 4 * values(0)["train.batch_size"]
  for row in (0, len(ROWS) - 1):
    result = measure(row_config("tiny", 32, 8, row, on_gpu=False), repeats=1)
    assert result["tokens_per_sec"] > 0 and result["mfu"] is None and np.isfinite(result["loss"])
