"""The pipeline executor (megajax.parallel.pipeline) against the single-device reference.

Every (dp, pp, tp) mesh the issue names, v in {1, 2}, m in {p, 2p, 4p}, every schedule:
loss, all gradients and the params after 3 LAMB steps within 1e-5 of megajax.step. Then the
executor's tables and memory (bounded in m, unlike GPipe by autodiff), the two send rings,
the stacked parameter layout and the config's errors.
"""

import functools
import re

import jax
import numpy as np
import pytest

from megajax.config import ConfigError, PIPELINE_SCHEDULES, PIPELINE_TRAVERSALS, default_config, validate
from megajax.model import GPT, ModelConfig, init_params
from megajax.parallel import pipeline, schedule as schedules
from megajax.parallel.pipeline_baseline import gpipe_autodiff_gradients
from tests.conftest import run_module
from tests.test_parallel import (assert_matches_reference, build_plan, fixed_batch, parallel_config,
                                 relative_error)

PIPELINE_MESHES = [(1, 2, 1), (1, 4, 1), (1, 8, 1), (2, 2, 2), (1, 2, 4)]
SCHEDULE_CHUNKS = [("gpipe", 1), ("gpipe", 2), ("1f1b", 1), ("interleaved_1f1b", 2)]
ROWS = 32   # 4p microbatches of one row at p = 8


def pipeline_config(mesh, schedule="interleaved_1f1b", virtual_stages=1, microbatches=None, layers=None,
                    mode=None, traversal="depth_first", rows=ROWS):
  dp, pp, tp = mesh
  # tp meshes run the default collective matmul (chunked inside the pipeline's branches).
  c = parallel_config(dp, tp, "parallel", mode or ("collective_matmul" if tp > 1 else "none"),
                      microbatches or pp, layers=layers or max(pp * virtual_stages, 4))
  c.train.batch_size = rows
  c.parallel.pp, c.parallel.virtual_stages = pp, virtual_stages
  c.parallel.schedule, c.parallel.traversal = schedule, traversal
  return c


@pytest.mark.parametrize("factor", [1, 2, 4], ids=["m=p", "m=2p", "m=4p"])
@pytest.mark.parametrize("schedule,virtual_stages", SCHEDULE_CHUNKS, ids=[f"{s}-v{v}" for s, v in SCHEDULE_CHUNKS])
@pytest.mark.parametrize("mesh", PIPELINE_MESHES, ids=["x".join(map(str, m)) for m in PIPELINE_MESHES])
def test_pipeline_matches_the_single_device_reference(mesh, schedule, virtual_stages, factor):
  """One reference per model (one microbatch): accumulation changes only the order of sums."""
  config = pipeline_config(mesh, schedule, virtual_stages, microbatches=factor * mesh[1])
  overrides = (("num_layers", config.model.num_layers),)
  assert_matches_reference(config, overrides, reference_microbatches=1, param_leaf_rtol=3e-5)


def test_breadth_first_traversal_matches_the_reference():
  config = pipeline_config((1, 2, 1), "interleaved_1f1b", 2, microbatches=4, traversal="breadth_first")
  assert_matches_reference(config, (("num_layers", 4),), reference_microbatches=1, param_leaf_rtol=3e-5)


def test_serial_block_remat_and_tied_embeddings_through_the_pipeline():
  """The serial block, recomputation inside the recomputing backward, and a tied embedding
  whose gradient comes from the first stage (lookup) and the last (head)."""
  config = pipeline_config((2, 2, 2), "interleaved_1f1b", 2, microbatches=4)
  overrides = (("num_layers", 4), ("block", "serial"), ("remat", "full"), ("tie_embeddings", True))
  config.model.block, config.model.remat, config.model.tie_embeddings = "serial", "full", True
  assert_matches_reference(config, overrides, reference_microbatches=1, param_leaf_rtol=3e-5)


# --- Tables and memory.

def tables_for(name, p, v, m, traversal="depth_first", layers=None):
  config = pipeline_config((1, p, 1), name, v, m, layers=layers)
  return pipeline.Tables.build(schedules.simulate(name, p, v, m, traversal), ModelConfig.from_config(config.model))


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_1f1b_stash_is_bounded_independently_of_microbatches(name, v):
  p = 4
  small, large = tables_for(name, p, v, 4 * p), tables_for(name, p, v, 16 * p)
  # At most the microbatch-chunks in flight, plus an arrival waiting for its forward.
  assert small.stash_slots == large.stash_slots <= max(schedules.in_flight(small.schedule)) + 1
  assert small.cotangent_slots == large.cotangent_slots
  gpipe = [tables_for("gpipe", p, v, m).stash_slots for m in (4 * p, 16 * p)]
  assert gpipe == [4 * p * v, 16 * p * v]  # every microbatch-chunk held until the backwards start


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("interleaved_1f1b", 2), ("gpipe", 2)])
def test_tables_route_every_message(name, v):
  """Replays the tables: each op reads the slot its input (or cotangent) was received into,
  and no slot is overwritten while its message is still needed."""
  p = 4
  t = tables_for(name, p, v, 8)
  pairs, last = schedules.paired_timeline(t.schedule), p * v - 1
  received_at = {}   # (stage, kind, slot) -> (microbatch, chunk) held there
  for tick in range(t.ticks):
    for stage in range(p):
      for prefix, op in zip(("f_", "b_"), pairs[stage, tick]):
        if op is None:
          assert t.per_stage[prefix + "branch"][tick, stage] == 0   # idle
          continue
        g, key = op.chunk * p + stage, (op.microbatch, op.chunk)
        assert (t.per_stage[prefix + "microbatch"][tick, stage], t.per_stage[prefix + "chunk"][tick, stage]) == key
        if g > 0:
          assert received_at[stage, "F", t.per_stage[prefix + "in_slot"][tick, stage]] == key
        if op.kind == schedules.BACKWARD and g < last:
          assert received_at[stage, "B", t.per_stage["b_ct_slot"][tick, stage]] == key
    for stage in range(p):   # the tick's arrivals, written after every read
      sender, slot = pairs[(stage - 1) % p, tick, 0], t.per_stage["recv_fwd"][tick, stage]
      if sender is not None and sender.chunk * p + (stage - 1) % p < last:
        g = sender.chunk * p + (stage - 1) % p + 1
        held = received_at.get((stage, "F", slot))
        assert held is None or _done(pairs, stage, held, tick), (tick, stage, slot)
        received_at[stage, "F", slot] = (sender.microbatch, g // p)
      else:
        assert slot == t.stash_slots            # nothing arrives: the trash slot
      sender, slot = pairs[(stage + 1) % p, tick, 1], t.per_stage["recv_bwd"][tick, stage]
      if sender is not None and sender.chunk * p + (stage + 1) % p > 0:
        g = sender.chunk * p + (stage + 1) % p - 1
        held = received_at.get((stage, "B", slot))
        assert held is None or _done(pairs, stage, held, tick), (tick, stage, slot)
        received_at[stage, "B", slot] = (sender.microbatch, g // p)
      else:
        assert slot == t.cotangent_slots


def _done(pairs, stage, key, tick):
  """Whether `stage` ran the backward of (microbatch, chunk) `key` by `tick` (its last use)."""
  return any(op is not None and op.kind == schedules.BACKWARD and (op.microbatch, op.chunk) == key
             for op in pairs[stage, :tick + 1, 1])


def compiled_gradients(mesh, m, baseline=False):
  config = pipeline_config(mesh, "1f1b", 1, microbatches=m, layers=mesh[1] * 2, mode="none", rows=m)
  config.model.window_pattern = "L"
  plan = build_plan(config)
  fn = None
  if baseline:
    fn = functools.partial(gpipe_autodiff_gradients, layouts=plan.layouts, stages=mesh[1], virtual_stages=1,
                           microbatches=m, c=plan.model.config, overlap=plan.overlap, z_loss=config.train.z_loss)
  state, batch = plan.abstract_inputs()
  return plan, plan.summed_gradients(fn).lower(state.params, batch).compile()


def test_1f1b_temp_memory_is_flat_in_microbatches_while_gpipe_by_autodiff_grows():
  p = 2
  ours = [compiled_gradients((1, p, 1), m)[1].memory_analysis().temp_size_in_bytes for m in (4 * p, 16 * p)]
  base = [compiled_gradients((1, p, 1), m, True)[1].memory_analysis().temp_size_in_bytes for m in (4 * p, 16 * p)]
  assert abs(ours[1] - ours[0]) <= 0.1 * ours[0], ours
  assert base[1] > 2 * base[0], base


def test_gpipe_by_autodiff_baseline_computes_the_same_gradients():
  """The benchmark's baseline is an honest one: its gradients are the executor's."""
  m = 4
  plan, ours = compiled_gradients((1, 2, 1), m)
  _, base = compiled_gradients((1, 2, 1), m, True)
  params = plan.init_state(jax.random.key(0)).params
  batch = plan.put_batch(fixed_batch(m))
  (g_ours, s_ours), (g_base, s_base) = ours(params, batch), base(params, batch)
  assert float(s_ours["nll_sum"]) == pytest.approx(float(s_base["nll_sum"]), rel=1e-6)
  errors = jax.tree.leaves(jax.tree.map(relative_error, g_base, g_ours))
  assert max(errors) < 1e-5


def _instructions(computation: str) -> dict:
  """name -> (opcode, operand names) of one HLO computation's instructions."""
  found = {}
  for line in computation.splitlines():
    match = re.match(r"\s*(?:ROOT )?%?([\w.-]+) = .*? ([a-z][a-z0-9-]*)\((.*)", line)
    if match:
      found[match.group(1)] = (match.group(2), set(re.findall(r"%([\w.-]+)", match.group(3))))
  return found


def test_decoupled_send_rings_over_pp():
  """Activations travel to stage s+1 and cotangents to s-1 in two collective-permutes of their
  own, outside every branch, and nothing the backward slot computes depends on the forward's
  send: the scheduler may run the send during the backward (decoupled send/recv)."""
  _, compiled = compiled_gradients((1, 4, 1), 4)
  text = compiled.as_text()
  forward, backward = {(i, (i + 1) % 4) for i in range(4)}, {(i, (i - 1) % 4) for i in range(4)}
  # The HLO's device ids are mesh positions; on a (1, 4, 1) mesh the id is the stage.
  rings = {}
  for computation in re.split(r"\n(?=\S)", text):
    for line in computation.splitlines():
      if re.search(r" collective-permute(-start)?\(", line):
        pairs = {(int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", line.split("source_target_pairs=")[1])}
        name = re.match(r"\s*(?:ROOT )?%?([\w.-]+) =", line).group(1)
        rings[name] = ("forward" if pairs == forward else "backward" if pairs == backward else "other", computation)
  assert sorted(kind for kind, _ in rings.values()) == ["backward", "forward"], rings.keys()
  (send, body), = [(name, body) for name, (kind, body) in rings.items() if kind == "forward"]
  assert rings[next(n for n, (k, _) in rings.items() if k == "backward")][1] == body   # same tick body
  instructions = _instructions(body)
  # Everything downstream of the send, inside the tick: no conditional (the slots' switches) among it.
  downstream, frontier = set(), {send}
  while frontier:
    frontier = {name for name, (_, operands) in instructions.items() if operands & frontier} - downstream
    downstream |= frontier
  conditionals = [name for name, (op, _) in instructions.items() if op == "conditional"]
  assert len(conditionals) >= 2                                   # the forward and backward slots
  assert not downstream & set(conditionals), downstream & set(conditionals)
  assert all(op != "conditional" for op, _ in (instructions[n] for n in downstream))


# --- The stacked layout and the config.

def test_stacked_layers_are_round_robin_chunks_and_round_trip():
  assert pipeline.stacked_layer_order(8, 2, 2) == [0, 1, 4, 5, 2, 3, 6, 7]  # stage 0: chunks 0, 2
  config = pipeline_config((1, 2, 1), "interleaved_1f1b", 2, layers=8)
  params = init_params(GPT(ModelConfig.from_config(config.model)), jax.random.key(0))
  stacked = pipeline.to_pipeline_params(params, 2, 2)
  assert jax.tree.leaves(stacked[pipeline.LAYERS])[0].shape[0] == 8
  np.testing.assert_array_equal(stacked["layers"]["norm"]["scale"][2], params["layer_4"]["norm"]["scale"])
  back = pipeline.to_model_params(stacked, 2, 2)
  assert jax.tree.structure(back) == jax.tree.structure(params)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)


def test_config_names_match_the_schedules():
  assert PIPELINE_SCHEDULES == schedules.SCHEDULES and PIPELINE_TRAVERSALS == schedules.TRAVERSALS


@pytest.mark.parametrize("field,value,pattern", [
    ("model.num_layers", 6, r"^model\.num_layers=6: the pipeline cuts .* = 4 equal chunks; use a multiple of 4"),
    ("train.microbatches", 3, r"^train\.microbatches=3: interleaved 1F1B .* groups of parallel\.pp=2; use a multiple of 2"),
    ("parallel.schedule", "zero_bubble", r"^parallel\.schedule='zero_bubble': unknown name; choose one of gpipe"),
    ("parallel.traversal", "random", r"^parallel\.traversal='random': unknown name"),
    ("parallel.virtual_stages", 0, r"^parallel\.virtual_stages=0: must be a positive integer"),
])
def test_pipeline_config_errors_name_the_field_and_the_fix(field, value, pattern):
  config = default_config()
  config.model.num_layers, config.train.batch_size, config.train.microbatches = 4, 12, 2
  config.parallel.pp, config.parallel.virtual_stages = 2, 2
  validate(config)
  group, name = field.split(".")
  config[group][name] = value
  with pytest.raises(ConfigError, match=pattern):
    validate(config)


def test_1f1b_with_virtual_stages_is_refused():
  config = default_config()
  config.model.num_layers, config.parallel.virtual_stages = 4, 2
  config.parallel.schedule = "1f1b"
  validate(config)   # pp = 1: the pipeline fields are unused
  config.parallel.pp = 2
  with pytest.raises(ConfigError, match=r"^parallel\.virtual_stages=2: the 1f1b schedule has one chunk"):
    validate(config)


def test_pipeline_benchmark_prints_its_ratios():
  """`python -m megajax.launch.bench pipeline` (small: p=2, few repeats) runs and prints the
  memory, LAMB and lockstep figures side by side."""
  result = run_module(["-m", "megajax.launch.bench", "pipeline", "--stages=2", "--repeats=2"], timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  out = result.stdout
  assert "bubble ticks cut by 75.0%, bubble fraction by 75.0%" in out
  ours, baseline = re.search(r"m=16p over m=4p: ours ([\d.]+)x, GPipe by autodiff ([\d.]+)x", out).groups()
  assert abs(float(ours) - 1) <= 0.1 and float(baseline) > 2
  assert re.search(r"interleaved_1f1b p=2 v=2 m=4 .* 1\.000x", out)
