"""The 3D-parallel step's structure (pp = 1): its compile options, the collectives in its
compiled HLO (tp per layer, collective matmul's rings, ZeRO's reduce-scatter, how often the
gradient sync over dp runs per step, the dtypes of ZeRO's gathers) and the optimizer state's
bytes per device. Its values against the reference: tests/integration.
"""

import collections
import re

import jax
from jax.extend import core as jcore
import numpy as np
import pytest

from megajax.config import TP_OVERLAP_CHOICES
from megajax.parallel import fused, zero
from megajax.parallel.deviceless import bytes_per_device
from tests.support.hlo import collective_counts, compiled_step_text, computations, mesh_groups, replica_groups
from tests.support.reference import BATCH, SEQ, parallel_step_for, parallel_config, pipeline_config

MODES = list(TP_OVERLAP_CHOICES)   # every tp_overlap mode the config accepts


def test_xla_mode_compiles_with_windowed_einsum_options():
  steps = {mode: parallel_step_for(parallel_config(2, 4, mode=mode)) for mode in MODES}
  assert steps["xla"].compiler_options == {"xla_gpu_threshold_for_windowed_einsum_mib": 0,
                                           "xla_gpu_multi_streamed_windowed_einsum": True}
  assert steps["none"].compiler_options is None and steps["collective_matmul"].compiler_options is None


# --- The compiled program.

# (block, its all-gathers per layer, layers): the two-norm block on one depth only (CI time).
PER_LAYER = [(block, n, layers) for block, n in (("parallel", 1), ("serial", 2)) for layers in (2, 3)]
PER_LAYER.append(("parallel_two_norms", 1, 3))


@pytest.mark.parametrize("block,per_layer,layers", PER_LAYER, ids=[f"{b}-{n}-{l}" for b, n, l in PER_LAYER])
def test_tp_collectives_per_layer_without_overlap(block, per_layer, layers):
  """mode none: per layer, forward, per_layer all-gathers and reduce-scatters over tp (and
  their transposes backward); plus the head's all-gather and the embedding's reduce-scatter.
  The two-norm parallel block gathers its input once for both norms, like the parallel block."""
  parallel_step, text = compiled_step_text(2, 4, block, "none", layers)
  counts = collective_counts(text, parallel_step.mesh)
  for phase in ("forward", "backward"):
    assert counts["all-gather", "tp", phase] == per_layer * layers + 1, (phase, counts)
    assert counts["reduce-scatter", "tp", phase] == per_layer * layers + 1, (phase, counts)
  assert counts["collective-permute", "tp", "forward"] == 0


@pytest.mark.parametrize("block", ["parallel", "serial"])
def test_collective_matmul_leaves_only_permutes_in_the_blocks(block):
  """mode collective_matmul: no tp all-gather / reduce-scatter of activations in any block,
  forward or backward. Left: the embedding's reduce-scatter (forward) and its transpose, an
  all-gather (backward), the same for 2 and 3 layers."""
  two = collective_counts(compiled_step_text(2, 4, block, "collective_matmul", 2)[1], parallel_step_for(
      parallel_config(2, 4, block, "collective_matmul")).mesh)
  parallel_step, text = compiled_step_text(2, 4, block, "collective_matmul", 3)
  three = collective_counts(text, parallel_step.mesh)
  for phase, (gathers, scatters) in {"forward": (0, 1), "backward": (1, 0)}.items():
    assert three["all-gather", "tp", phase] == two["all-gather", "tp", phase] == gathers, three
    assert three["reduce-scatter", "tp", phase] == two["reduce-scatter", "tp", phase] == scatters, three
    assert three["collective-permute", "tp", phase] > two["collective-permute", "tp", phase] > 0
    assert three["collective-permute", "other", phase] == three["collective-permute", "dp", phase] == 0


def _zero_parts(parallel_step) -> dict:
  """What ZeRO moves in the step, counted from the model: per layer its fused operands
  (megajax.parallel.fused: its members gathered whole, the result the operand), the other
  matrices (the embedding, the head: one collective each) and the other leaves (norm scales,
  biases: bucketed by kind)."""
  c = parallel_step.model.config
  operands = fused.operands(c).values()
  members = sum(len(operand.members) for operand in operands)
  leaves = len(jax.tree.leaves(parallel_step.layouts))
  matrices = len([k for k in parallel_step.layouts if k in ("embedding", "head")])
  return {"operands": len(operands) * c.num_layers, "matrices": matrices, "leaves": leaves,
          "vectors": leaves - members * c.num_layers - matrices}


def test_zero_reduce_scatters_gradients_and_never_all_reduces_them():
  """ZeRO's collectives, never one per parameter: one per fused operand (its members' shards
  packed side by side: the gathered buffer is the operand, its gradient reduce-scattered as
  it is), one per other matrix, and the other leaves in buckets (parallel.dp_bucket_mb,
  32 MiB: this model's leaves of one kind fit one): the gradients' one per kind (fp32,
  varying over dp and tp: the tp-split biases; over dp only: the tp-replicated norms), the
  parameters' one per kind and forward group (the embedding with layer 0, layer 1, the final
  norm with the head). No all-reduce over dp but of scalars."""
  # The serial block: in the parallel one the two output biases share one gradient, and XLA
  # rightly reduces it once.
  parallel_step, text = compiled_step_text(2, 4, "serial", "none", 2)
  counts = collective_counts(text, parallel_step.mesh)
  parts = _zero_parts(parallel_step)
  assert parts == {"operands": 8, "matrices": 2, "leaves": 36, "vectors": 22}
  assert counts["reduce-scatter", "dp", "other"] == 8 + 2 + 2
  assert counts["all-gather", "dp", "forward"] == (1 + 4 + 2) + (4 + 2) + (1 + 1)   # in the forward
  # Prefetch: the program's first collective is a ZeRO parameter gather over dp.
  first = next(line for line in text.split("ENTRY", 1)[1].splitlines()
               if re.search(r" (all-gather|reduce-scatter|all-reduce|collective-permute)(-start)?\(", line))
  assert " all-gather" in first and replica_groups(first) == mesh_groups(parallel_step.mesh, "dp"), first.strip()[:160]
  dp_groups = {frozenset(g) for g in mesh_groups(parallel_step.mesh, "dp")}
  for line in text.splitlines():
    if re.search(r" all-reduce(-start)?\(", line):
      groups = replica_groups(line)
      crosses_dp = any(not any(g <= t for t in mesh_groups(parallel_step.mesh, "tp")) for g in groups)
      result_type = line.split("=", 1)[1].split(" all-reduce")[0]
      dims = re.findall(r"[a-z0-9]+\[([\d,]*)\]", result_type)
      if crosses_dp or groups == dp_groups:
        assert all(d == "" for d in dims), f"a non-scalar all-reduce over dp: {line.strip()[:160]}"


def _sub_jaxprs(eqn):
  for value in eqn.params.values():
    for x in value if isinstance(value, (list, tuple)) else (value,):
      if isinstance(x, jcore.ClosedJaxpr):
        yield x.jaxpr
      elif isinstance(x, jcore.Jaxpr):
        yield x


def _dots(eqns) -> int:
  return sum((e.primitive.name == "dot_general") + sum(_dots(j.eqns) for j in _sub_jaxprs(e)) for e in eqns)


def _shard_map_body(jaxpr):
  for eqn in jaxpr.eqns:
    for sub in _sub_jaxprs(eqn):
      body = sub if eqn.primitive.name == "shard_map" else _shard_map_body(sub)
      if body is not None:
        return body
  return None


def test_zero_gathers_are_issued_one_layer_ahead():
  """pp = 1, 3 layers, 2 microbatches: every dp all-gather sits in the first microbatch's
  forward, and each waits for exactly the matmuls of the layers before the one ahead of its
  use: the tp-split leaves of layer i + 1 (and the head after the last layer) on layer
  i - 1's output, so they run under layer i. The embedding's, the first two layers' and the
  tp-replicated LayerNorm and bias leaves (a dependency would make them vary over tp) wait
  for nothing. Counted on the step's program (matmuls each gather depends on), then on the
  compiled one: XLA keeps the order."""
  layers = 3
  config = parallel_config(2, 2, "serial", "none", layers=layers, microbatches=2)
  config.parallel.dp_bucket_mb = 0.0    # one gather per leaf or operand: each one's wait counted (buckets wait alike)
  parallel_step = parallel_step_for(config)
  state, batch = parallel_step.abstract_inputs()
  body = _shard_map_body(jax.make_jaxpr(parallel_step.summed_gradients())(state.params, batch).jaxpr)
  producer = {v: eqn for eqn in body.eqns for v in eqn.outvars}

  def ancestors(eqn, seen):
    for v in eqn.invars:
      source = None if isinstance(v, jcore.Literal) else producer.get(v)
      if source is not None and id(source) not in seen:
        seen[id(source)] = source
        ancestors(source, seen)
    return seen

  waits = collections.Counter(_dots(ancestors(eqn, {}).values()) for eqn in body.eqns
                              if eqn.primitive.name == "all_gather" and "dp" in str(eqn.params["axis_name"]))
  layouts = parallel_step.layouts
  # The gathers of a layer's tp-split values: each fused operand whole (its members all
  # tp-split), then the other tp-split leaves one by one.
  operands = fused.operands(parallel_step.model.config).values()
  members = sum(len(operand.members) for operand in operands)
  split = {name: sum(layout.tp_dim is not None for layout in jax.tree.leaves(layouts[name])) for name in layouts}
  split.update({name: split[name] - members + len(operands) for name in layouts if name.startswith("layer_")})
  gathers = len(jax.tree.leaves(layouts)) - layers * (members - len(operands))
  levels = sorted(waits)
  assert len(levels) == layers and levels[0] == 0 and levels[2] == 2 * levels[1] > 0, waits
  assert waits[levels[1]] == split["layer_2"] and waits[levels[2]] == split["head"] == 1, waits
  assert sum(waits.values()) == gathers
  # Compiled: the gathers of layer 2 after some of the step's matmuls, the head's after more.
  text = parallel_step.summed_gradients().lower(state.params, batch).compile().as_text()
  bodies = computations(text)
  matmuls = {name for name, body in bodies.items() if re.search(r" (dot|convolution)\(", body)}
  dots, after = 0, []
  for line in bodies["ENTRY"].splitlines():   # a matmul, or a fusion / call of one
    called = re.findall(r"(?:calls|to_apply)=%?([\w.-]+)", line)
    dots += bool(re.search(r" (dot|convolution)\(", line) or matmuls.intersection(called))
    if re.search(r" all-gather(-start)?\(", line) and replica_groups(line) == mesh_groups(parallel_step.mesh, "dp"):
      after.append(dots)
  assert len(after) == gathers
  after = sorted(after)
  assert after[0] == 0 and 0 < after[-1 - split["layer_2"]] < after[-1], after
  # Each layer's input waits for its gathers through one element (mesh.after_by_one_element),
  # updated in place: no select anywhere writes a layer's input (its rows, its tokens of the
  # tp sequence shard, hidden 32), as the wait by select did in the forward and its transpose.
  rows, tokens = BATCH // 2 // 2, SEQ // 2
  layer_input_selects = re.findall(rf"= f32\[{rows},{tokens},32\]\{{[^}}]*\}} select\(", text)
  assert not layer_input_selects, layer_input_selects


@pytest.mark.parametrize("mesh", [(8, 1, 1), (2, 1, 4)], ids=["8x1x1", "2x1x4"])
def test_optimizer_state_is_split_over_dp(mesh):
  dp, _, tp = mesh
  config = parallel_config(dp, tp)
  config.model.num_kv_heads = 8  # every leaf has a dimension that splits 8 ways
  parallel_step = parallel_step_for(config)
  state = parallel_step.init_state(jax.random.key(0))
  moments = [leaf for leaf in jax.tree.leaves(state.opt_state) if leaf.ndim > 0]
  assert len(moments) == 2 * len(jax.tree.leaves(state.params))  # Adam's mu and nu
  layouts = jax.tree.leaves(parallel_step.layouts) * 2
  per_device = sum(leaf.addressable_shards[0].data.nbytes for leaf in moments)
  expected = sum(leaf.nbytes // (dp * (tp if layout.tp_dim is not None else 1))
                 for leaf, layout in zip(moments, layouts))
  assert per_device == expected
  if tp == 1:
    assert per_device * dp == sum(leaf.nbytes for leaf in moments)  # exactly total / dp
  assert all(layout.dp_dim is not None for layout in jax.tree.leaves(parallel_step.layouts))


# --- Gradient sync over dp (parallel.grad_sync), counted as the compiled step executes it.

def _compiled_step(config):
  parallel_step = parallel_step_for(config)
  return parallel_step, parallel_step.train_step().lower(*parallel_step.abstract_inputs()).compile().as_text()


def _dp_collectives(parallel_step, text, kind="reduce-scatter", executed=True, nbytes=False):
  counts = collective_counts(text, parallel_step.mesh, executed=executed, by_dtype=True, nbytes=nbytes)
  return {k: v for k, v in counts.items() if k[0] == kind and k[1] == "dp"}


def _shard_bytes(parallel_step):
  """fp32 bytes of this device's 1/dp shard of its tp shard of every leaf."""
  state, _ = parallel_step.abstract_inputs()
  return sum(4 * int(np.prod(leaf.sharding.shard_shape(leaf.shape))) for leaf in jax.tree.leaves(state.params))


@pytest.mark.parametrize("grad_sync,per_step", [("step", 1), ("microbatch", 4)])
def test_dp_reduce_scatters_once_per_step_or_per_microbatch(grad_sync, per_step):
  """m = 4 microbatches: "step" runs the fp32 gradient reduce-scatters once after the scan,
  "microbatch" inside it, 4 times over (and 4 times the bytes); each time one per fused
  operand and other matrix, and one per bucket of the other leaves (parallel.dp_bucket_mb):
  here one per kind (tp-split biases, tp-replicated norms)."""
  config = parallel_config(2, 2, "serial", "none", microbatches=4)
  config.parallel.grad_sync = grad_sync
  parallel_step, text = _compiled_step(config)
  counts, nbytes = _dp_collectives(parallel_step, text), _dp_collectives(parallel_step, text, nbytes=True)
  parts = _zero_parts(parallel_step)
  assert counts == {("reduce-scatter", "dp", "other", "f32"): per_step * (parts["operands"] + parts["matrices"] + 2)}
  assert nbytes == {("reduce-scatter", "dp", "other", "f32"): per_step * _shard_bytes(parallel_step)}


def test_pipeline_dp_collectives_run_per_chunk_in_the_edge_ticks():
  """dp2-pp2-tp2, interleaved v = 2, 8 layers (2 rows per chunk), 4 microbatches, fp32,
  grad_sync="step": the first chunk's rows and the shared leaves are gathered before the tick
  scan and reduce-scattered after it, one collective per leaf; the second chunk's rows in
  pieces inside the scan, one row per tick over the 2 head ticks (gathers) and the 2 tail
  ticks (reduce-scatters) in which only first chunks run. Every byte moves once."""
  config = pipeline_config((2, 2, 2), "interleaved_1f1b", 2, microbatches=4, layers=8)
  config.parallel.dp_bucket_mb = 0.0    # one collective per leaf, so that the pieces can be counted
  key = lambda kind: (kind, "dp", "other", "f32")
  parallel_step, text = _compiled_step(config)
  for kind in ("all-gather", "reduce-scatter"):
    executed, nbytes = _dp_collectives(parallel_step, text, kind), _dp_collectives(parallel_step, text, kind, nbytes=True)
    compiled = _dp_collectives(parallel_step, text, kind, executed=False)
    leaves = len(jax.tree.leaves(parallel_step.layouts))
    # One per leaf outside the scan; a piece's (one per leaf, or per bucket of leaves where
    # XLA:CPU orders them) in a loop body, run once per head or tail tick: twice.
    in_loop = compiled[key(kind)] - leaves
    assert set(compiled) == set(executed) == {key(kind)} and in_loop > 0, (kind, compiled)
    assert executed[key(kind)] == leaves + 2 * in_loop, (kind, executed)
    dp = 1 if kind == "reduce-scatter" else 2      # a gather's result is the whole leaf
    assert nbytes == {key(kind): dp * _shard_bytes(parallel_step)}, (kind, nbytes)


# --- ZeRO gathers in the compute dtype.

def test_zero_gathers_the_linears_in_the_compute_dtype(monkeypatch):
  """compute_dtype=bfloat16 on dp2-tp2: one dp all-gather per fused operand and per other
  leaf, those of the linears (zero.gathers_in_compute_dtype) in bf16, half the bytes of
  their fp32 gathers; the LayerNorms and the embedding still fp32; every gradient still
  reduce-scattered in fp32. Here (2 serial layers, hidden 32): 21 bf16 gathers of 25,216
  bytes and 11 fp32 of 5,376 per device and step, against 32 fp32 of 55,808."""
  config = parallel_config(2, 2, "serial", "none")
  config.model.compute_dtype = "bfloat16"
  config.parallel.dp_bucket_mb = 0.0    # one collective per leaf: each leaf's dtype counted

  def dp_collectives(fp32_gathers: bool):
    with monkeypatch.context() as patch:
      if fp32_gathers:
        patch.setattr(zero, "gathers_in_compute_dtype", lambda path: False)
      parallel_step = parallel_step_for(config)
      # The program as JAX emits it: XLA:CPU's float normalization then runs the bf16 gathers in
      # fp32 (convert, gather, convert back; the same values), a backend choice GPUs do not make.
      text = parallel_step.train_step().lower(*parallel_step.abstract_inputs()).as_text(dialect="hlo")
    # The ZeRO collectives (the dp all-reduces left are the step's scalars).
    return parallel_step, {measure: {k: v for k, v in collective_counts(text, parallel_step.mesh, by_dtype=True,
                                                                        nbytes=measure == "bytes").items()
                                     if k[1] == "dp" and k[0] != "all-reduce"}
                           for measure in ("count", "bytes")}

  parallel_step, got = dp_collectives(False)
  _, fp32 = dp_collectives(True)
  state, _ = parallel_step.abstract_inputs()
  paths_and_leaves = jax.tree_util.tree_flatten_with_path(state.params)[0]
  cast = [zero.gathers_in_compute_dtype(tuple(k.key for k in path)) for path, _ in paths_and_leaves]
  # What a dp all-gather returns: the leaf's tp shard, whole over dp.
  tp_shard = [int(np.prod(leaf.shape)) // (2 if layout.tp_dim is not None else 1)
              for (_, leaf), layout in zip(paths_and_leaves, jax.tree.leaves(parallel_step.layouts))]
  assert 0 < sum(cast) < len(cast)
  linears = sum(n for n, c in zip(tp_shard, cast) if c)
  others = sum(n for n, c in zip(tp_shard, cast) if not c)
  gather, scatter = ("all-gather", "dp", "other"), ("reduce-scatter", "dp", "other")
  parts = _zero_parts(parallel_step)
  packed = parts["leaves"] - parts["vectors"] - parts["matrices"] - parts["operands"]   # members less operands
  assert got["count"] == {gather + ("bf16",): sum(cast) - packed, gather + ("f32",): len(cast) - sum(cast),
                          scatter + ("f32",): len(cast) - packed}
  assert got["count"][gather + ("bf16",)] == 21 and got["count"][gather + ("f32",)] == 11
  assert got["bytes"][gather + ("bf16",)] == 2 * linears
  assert got["bytes"][gather + ("f32",)] == 4 * others
  assert fp32["count"] == {gather + ("f32",): len(cast) - packed, scatter + ("f32",): len(cast) - packed}
  assert fp32["bytes"][gather + ("f32",)] == 4 * (linears + others)
  assert got["bytes"][scatter + ("f32",)] == fp32["bytes"][scatter + ("f32",)]


@pytest.mark.cpu_only
def test_microbatches_run_one_after_another():
  """Gradient accumulation holds one microbatch's activations at a time: each microbatch's
  forward depends on the running sum (step._after_the_others). Without it XLA ran the ones
  outside a loop (the last after the scan, a scan of one it inlines) beside the others: dp2-tp2,
  3 microbatches held 2.4x the bytes of one (XLA:CPU, grad_sync step), 1.15x with it; the
  gradients and the loss are the reference's either way (tests/integration/test_parallel_reference.py)."""
  def step_bytes(microbatches):
    config = parallel_config(dp=2, tp=2, microbatches=microbatches, layers=4)
    config.model.hidden_dim, config.model.seq_len = 128, 128
    config.train.batch_size = 4 * microbatches
    step = parallel_step_for(config)
    return bytes_per_device(step.train_step().lower(*step.abstract_inputs()).compile())

  one, three = step_bytes(1), step_bytes(3)
  assert three < 1.4 * one, (three, one)
