"""The pipeline's static parts: the executor's tables (bounded stash, every message routed),
the two send rings in the compiled tick, the stacked parameter layout, the config's errors.
Its values against the reference: tests/integration/test_pipeline_reference.py.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from megajax.config import SCHEDULE_CHOICES, TRAVERSAL_CHOICES, ConfigError, default_config, validate
from megajax.model import GPT, ModelConfig, init_params
from megajax.parallel.pipeline import LAYERS, Tables, stacked_layer_order, to_model_params, to_pipeline_params
from megajax.parallel.pipeline import residuals
from megajax.parallel.pipeline import schedule as schedules
from megajax.parallel.pipeline import tables as tables_module
from tests.support.hlo import instructions
from tests.support.reference import compiled_gradients, pipeline_config


# --- Tables.

def tables_for(name, p, v, m, traversal="depth_first", layers=None, recompute=False):
  config = pipeline_config((1, p, 1), name, v, m, layers=layers)
  return Tables.build(schedules.simulate(name, p, v, m, traversal), ModelConfig.from_config(config.model), recompute)


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("interleaved_1f1b", 2)])
def test_1f1b_stash_is_bounded_independently_of_microbatches(name, v):
  p = 4
  small, large = tables_for(name, p, v, 4 * p, recompute=True), tables_for(name, p, v, 16 * p, recompute=True)
  # Rerunning forwards: at most the microbatch-chunks in flight, plus an arrival waiting for its forward.
  assert small.stash_slots == large.stash_slots <= max(schedules.in_flight(small.schedule)) + 1
  assert small.cotangent_slots == large.cotangent_slots
  assert small.residual_slots == large.residual_slots == 0
  gpipe = [tables_for("gpipe", p, v, m, recompute=True).stash_slots for m in (4 * p, 16 * p)]
  assert gpipe == [4 * p * v, 16 * p * v]  # every microbatch-chunk held until the backwards start
  # Keeping residuals: an input waits only for its forward; the residuals of every
  # microbatch-chunk in flight (but the last chunk's, run forward and backward at once).
  small, large = tables_for(name, p, v, 4 * p), tables_for(name, p, v, 16 * p)
  assert small.stash_slots == large.stash_slots == 1
  assert small.residual_slots == large.residual_slots <= max(schedules.in_flight(small.schedule))
  assert small.cotangent_slots == large.cotangent_slots
  gpipe = [tables_for("gpipe", p, v, m).residual_slots for m in (4 * p, 16 * p)]
  assert gpipe == [4 * p * v, 16 * p * v]


@pytest.mark.parametrize("p,m", [(2, 2), (2, 8), (4, 4), (4, 8), (4, 16), (8, 16)])
@pytest.mark.parametrize("recompute", [False, True], ids=["residuals", "recompute"])
@pytest.mark.parametrize("name,v", [("1f1b", 1), ("interleaved_1f1b", 2), ("gpipe", 2)])
def test_tables_route_every_message(name, v, recompute, p, m):
  """Replays the tables: each op reads the slot its input (or cotangent, or residuals) was
  received into, and no slot is overwritten while its message is still needed. For m = p,
  2p, 4p: the pipeline's equality tests run every m on two meshes only."""
  t = tables_for(name, p, v, m, recompute=recompute)
  pairs, last = schedules.paired_timeline(t.schedule), p * v - 1
  received_at = {}   # (stage, kind, slot) -> (microbatch, chunk) held there
  reads_input = lambda op, g: g > 0 and (op.kind == schedules.FORWARD or recompute or g == last)
  for tick in range(t.ticks):
    for stage in range(p):
      for prefix, op in zip(("f_", "b_"), pairs[stage, tick]):
        if op is None:
          assert t.per_stage[prefix + "branch"][tick, stage] == 0   # idle
          continue
        g, key = op.chunk * p + stage, (op.microbatch, op.chunk)
        assert (t.per_stage[prefix + "microbatch"][tick, stage], t.per_stage[prefix + "chunk"][tick, stage]) == key
        if reads_input(op, g):
          assert received_at[stage, "F", t.per_stage[prefix + "in_slot"][tick, stage]] == key
        if op.kind == schedules.BACKWARD and g < last:
          assert received_at[stage, "B", t.per_stage["b_ct_slot"][tick, stage]] == key
          if not recompute:
            assert received_at[stage, "R", t.per_stage["b_res_slot"][tick, stage]] == key
    for stage in range(p):   # the tick's arrivals, written after every read
      sender, slot = pairs[(stage - 1) % p, tick, 0], t.per_stage["recv_fwd"][tick, stage]
      if sender is not None and sender.chunk * p + (stage - 1) % p < last:
        g = sender.chunk * p + (stage - 1) % p + 1
        held = received_at.get((stage, "F", slot))
        last_use = schedules.BACKWARD if held is None or reads_input(schedules.Op("B", *held), held[1] * p + stage) \
            else schedules.FORWARD
        assert held is None or _done(pairs, stage, held, tick, last_use), (tick, stage, slot)
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
      # This stage's forward keeps its residuals (not the last chunk's, nor when recomputing).
      own, slot = pairs[stage, tick, 0], t.per_stage["f_res_slot"][tick, stage]
      if own is not None and own.chunk * p + stage < last and not recompute:
        held = received_at.get((stage, "R", slot))
        assert held is None or _done(pairs, stage, held, tick), (tick, stage, slot)
        received_at[stage, "R", slot] = (own.microbatch, own.chunk)
      else:
        assert slot == t.residual_slots


@pytest.mark.parametrize("rows,ticks,pieces", [(1, 2, (1, (0,))), (2, 2, (1, (0, 1))), (3, 2, (2, (0, 1))),
                                               (14, 6, (3, (0, 3, 6, 9, 11))), (5, 16, (1, (0, 1, 2, 3, 4))),
                                               (0, 4, (0, ())), (3, 0, (0, ()))])
def test_dp_pieces_cover_every_row_once_per_tick(rows, ticks, pieces):
  size, starts = tables_module.dp_pieces(rows, ticks)
  assert (size, starts) == pieces
  assert len(starts) <= ticks
  assert set().union(*(range(s, s + size) for s in starts)) == (set(range(rows)) if ticks else set())


@pytest.mark.parametrize("name,v,traversal", [("interleaved_1f1b", 2, "depth_first"), ("interleaved_1f1b", 3, "depth_first"),
                                              ("interleaved_1f1b", 2, "breadth_first"), ("gpipe", 2, "depth_first")])
def test_first_chunk_only_ticks_start_and_end_the_schedule(name, v, traversal):
  """At least p leading and trailing ticks run only first chunks (where the executor moves
  the other chunks' dp collectives), and the tick after the leading ones does not."""
  for p, m in ((2, 4), (4, 8)):
    t = tables_for(name, p, v, m, traversal)
    lead, trail = t.first_chunk_only_ticks()
    assert lead >= p and trail >= p, (p, m, lead, trail)
    chunks = np.concatenate([t.per_stage["f_chunk"][lead], t.per_stage["b_chunk"][lead]])
    assert chunks.max() > 0
    assert (t.per_stage["f_chunk"][:lead] == 0).all() and (t.per_stage["b_chunk"][-trail:] == 0).all()


def _done(pairs, stage, key, tick, kind=schedules.BACKWARD):
  """Whether `stage` ran the `kind` op of (microbatch, chunk) `key` by `tick` (its last use)."""
  column = 0 if kind == schedules.FORWARD else 1
  return any(op is not None and op.kind == kind and (op.microbatch, op.chunk) == key
             for op in pairs[stage, :tick + 1, column])


# --- The compiled tick.

def test_decoupled_send_rings_over_pp():
  """Activations travel to stage s+1 and cotangents to s-1 in two collective-permutes of their
  own, outside every branch, and nothing the backward slot computes depends on the forward's
  send: the scheduler may run the send during the backward (decoupled send/recv)."""
  _, compiled = compiled_gradients((1, 4, 1), 4, ordered_collectives=False)
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
  found = instructions(body)
  # Everything downstream of the send, inside the tick: no conditional (the slots' switches) among it.
  downstream, frontier = set(), {send}
  while frontier:
    frontier = {name for name, (_, operands) in found.items() if operands & frontier} - downstream
    downstream |= frontier
  conditionals = [name for name, (op, _) in found.items() if op == "conditional"]
  assert len(conditionals) >= 2                                   # the forward and backward slots
  assert not downstream & set(conditionals), downstream & set(conditionals)
  assert all(op != "conditional" for op, _ in (found[n] for n in downstream))


@functools.cache
def _four_stage_gradients():
  """compiled_gradients((1, 4, 1), 4): a 4-stage 1F1B pipeline of 4 microbatches (shared)."""
  return compiled_gradients((1, 4, 1), 4)


def test_on_cpu_the_tick_orders_its_collectives():
  """XLA:CPU may start independent collectives in different orders on different devices (a
  rendezvous then waits until it aborts): the step on CPU devices runs the backward slot after
  the forward slot and both sends after the backward slot."""
  _, compiled = _four_stage_gradients()
  body = next(c for c in re.split(r"\n(?=\S)", compiled.as_text()) if re.search(r" collective-permute(-start)?\(", c))
  found = instructions(body)
  def upstream(name):
    seen, frontier = set(), {name}
    while frontier:
      frontier = {o for n in frontier for o in found.get(n, ("", set()))[1]} - seen
      seen |= frontier
    return seen
  sends = [n for n, (op, _) in found.items() if op.startswith("collective-permute")]
  conditionals = {n for n, (op, _) in found.items() if op == "conditional"}
  assert len(sends) == 2 and len(conditionals) >= 2
  for send in sends:                       # every slot's switch runs before either send
    assert conditionals <= upstream(send), (send, conditionals - upstream(send))


def test_the_residual_buffers_are_updated_in_place():
  """Each tick reads the backward's slot of a residual buffer and writes the forward's slot:
  no copy of a whole buffer ([residual slots + 1, words] of uint words) in the compiled
  program (XLA:CPU copied each twice per tick until the write waited for the read)."""
  parallel_step, compiled = _four_stage_gradients()
  rows = parallel_step.pipeline.residual_slots + 1
  assert rows > 1
  copies = re.findall(rf"= (u8|u16|u32)\[{rows},(\d+)\]\S* copy\(", compiled.as_text())
  assert not copies, copies


# --- The residuals a forward keeps for its backward (residuals.py).

@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int32", "int8", "uint8", "bool"])
def test_residuals_pack_into_words_bit_exactly(dtype):
  rng = np.random.default_rng(0)
  values = rng.normal(size=(3, 5)) * 100
  x = jnp.asarray(values > 0 if dtype == "bool" else values.astype(dtype))
  if dtype == "float32":   # a NaN payload and a negative zero survive
    x = x.at[0, 0].set(-0.0).at[0, 1].set(jax.lax.bitcast_convert_type(np.uint32(0x7FC00ABC), jnp.float32))
  words = residuals._to_words(x)
  assert words.shape == (x.size,) and words.dtype.itemsize == x.dtype.itemsize and words.dtype.kind == "u"
  leaf = residuals._Leaf(0, x.shape, np.dtype(x.dtype), residuals._group_of(jax.typeof(x)))
  back = residuals._from_words(words, leaf)
  assert back.dtype == x.dtype
  np.testing.assert_array_equal(np.asarray(back).view(np.uint8), np.asarray(x).view(np.uint8))


def test_a_split_chunk_stashes_activations_recomputes_weights_and_keeps_the_gradients():
  """The forward's own work (what depends on the activation or the tokens) is stashed; the
  weights' casts and slices and what depends only on positions are rebuilt in the backward,
  without reading the activation; the rebuilt pullback gives jax.vjp's gradients."""
  def run(layers, shared, x, mb):
    w = layers["w"][0].astype(jnp.bfloat16)                     # a slice and a cast of a weight
    rotary = jnp.sin(mb["positions"].astype(jnp.float32))[..., None]   # metadata only
    h = jnp.tanh((x * rotary).astype(jnp.bfloat16) @ w).astype(jnp.float32)
    h = h + shared["embedding"][mb["inputs"]]                   # the tokens: stashed work
    return (h * shared["scale"]).sum(), {"tokens": mb["loss_mask"].sum()}

  rng = np.random.default_rng(0)
  layers = {"w": jnp.asarray(rng.normal(size=(2, 8, 8)), jnp.float32)}
  shared = {"embedding": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32), "scale": jnp.float32(0.5)}
  x = jnp.asarray(rng.normal(size=(4, 8)), jnp.float32)
  mb = {"inputs": jnp.arange(4) % 16, "positions": jnp.arange(4), "loss_mask": jnp.ones(4)}
  split = residuals.SplitChunk.trace(run, layers, shared, x, mb)
  stashed_shapes = sorted(leaf.shape for leaf in split.stashed)
  assert (2, 8, 8) not in stashed_shapes and (8, 8) not in stashed_shapes     # no weight per microbatch
  avals = [v.aval for v in split.forward_jaxpr.jaxpr.outvars[split.outputs.num_leaves:]]
  assert any(avals[i].shape == (8, 8) and avals[i].dtype == jnp.bfloat16 for i in split.recomputed)

  (out, aux), packed = split.forward(layers, shared, x, mb, words=split.words)
  want_out, pullback, want_aux = jax.vjp(lambda l, s, x: run(l, s, x, mb), layers, shared, x, has_aux=True)
  assert out == want_out and aux == want_aux
  # The backward never reads the activation: a NaN one changes nothing.
  rebuilt = split.pullback_from(layers, shared, jnp.full_like(x, jnp.nan), mb, packed)
  for got, want in zip(jax.tree.leaves(rebuilt(jnp.float32(1))), jax.tree.leaves(pullback(jnp.float32(1)))):
    np.testing.assert_array_equal(got, want)


# --- The stacked layout and the config.

def test_stacked_layers_are_round_robin_chunks_and_round_trip():
  assert stacked_layer_order(8, 2, 2) == [0, 1, 4, 5, 2, 3, 6, 7]  # stage 0: chunks 0, 2
  config = pipeline_config((1, 2, 1), "interleaved_1f1b", 2, layers=8)
  params = init_params(GPT(ModelConfig.from_config(config.model)), jax.random.key(0))
  stacked = to_pipeline_params(params, 2, 2)
  assert jax.tree.leaves(stacked[LAYERS])[0].shape[0] == 8
  np.testing.assert_array_equal(stacked["layers"]["norm"]["scale"][2], params["layer_4"]["norm"]["scale"])
  back = to_model_params(stacked, 2, 2)
  assert jax.tree.structure(back) == jax.tree.structure(params)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)


def test_every_schedule_and_traversal_the_config_names_is_implemented():
  """The config's names are the ones the schedule module runs, and nothing else."""
  for name in SCHEDULE_CHOICES:
    for traversal in TRAVERSAL_CHOICES:
      assert schedules.simulate(name, 2, 1, 4, traversal).name == name
  with pytest.raises(ValueError, match="unknown"):
    schedules.simulate("zero_bubble", 2, 1, 4)


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
