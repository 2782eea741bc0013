"""The 3D-parallel step against the single-device reference, on 8 CPU devices.

Every (mesh, block, tp_overlap, accumulation) the step claims: the loss and every gradient
within 1e-5 relative of megajax.step's single-device step, and the params after 3 LAMB steps
within 1e-5. Then the compiled HLO: tp collectives per layer, ZeRO's reduce-scatter, and the
optimizer state's bytes per device.
"""

import collections
import functools
import re

import jax
import numpy as np
import pytest

from megajax.config import default_config
from megajax.model import GPT, ModelConfig
from megajax.optim import make_optimizer
from megajax.parallel import ParallelPlan, make_mesh
from megajax.step import init_train_state, make_loss_sums_fn, make_train_step, accumulate_gradients

MESHES = [(8, 1, 1), (1, 1, 8), (2, 1, 4), (4, 1, 2)]
MODES = ["none", "collective_matmul", "xla"]
BATCH, SEQ, VOCAB = 16, 16, 64
STEPS = 3


def parallel_config(dp=1, tp=1, block="parallel", mode="none", microbatches=1, layers=2):
  c = default_config()
  c.model.num_layers = layers
  c.model.hidden_dim = 32
  c.model.num_heads = 8
  c.model.num_kv_heads = 8 if tp == 8 else 4   # grouped KV heads wherever tp allows
  c.model.seq_len = SEQ
  c.model.vocab_size = VOCAB
  c.model.window = 8
  c.model.window_pattern = "LG"
  c.model.block = block
  c.model.compute_dtype = "float32"
  c.train.batch_size = BATCH
  c.train.microbatches = microbatches
  c.train.steps = 10
  c.train.z_loss = 1e-3
  c.optimizer.warmup_steps = 2
  c.optimizer.grad_clip_norm = 0.5   # clips the first steps (norms ~0.9, 0.6), not the third (~0.4)
  c.parallel.dp, c.parallel.tp, c.parallel.tp_overlap = dp, tp, mode
  return c


def fixed_batch(rows=BATCH):
  rng = np.random.default_rng(0)
  mask = (rng.random((rows, SEQ)) > 0.2).astype(np.float32)  # unequal token counts per row
  return {"inputs": rng.integers(0, VOCAB, (rows, SEQ)).astype(np.int32),
          "targets": rng.integers(0, VOCAB, (rows, SEQ)).astype(np.int32), "loss_mask": mask}


def relative_error(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


@functools.cache
def reference(block, microbatches, kv_heads, overrides=(), rows=BATCH):
  """Single device (megajax.step): the initial params, first gradients, losses, final params."""
  config = parallel_config(block=block, microbatches=microbatches)
  config.model.num_kv_heads = kv_heads
  config.train.batch_size = rows
  for field, value in overrides:
    config.model[field] = value
  model = GPT(ModelConfig.from_config(config.model))
  optimizer = make_optimizer(config)
  with jax.default_device(jax.devices()[0]):
    state = init_train_state(model, optimizer, jax.random.key(0))
    initial = jax.device_get(state.params)
    loss_sums = make_loss_sums_fn(model, config.train.z_loss)
    grads, stats = jax.jit(lambda p, b: accumulate_gradients(loss_sums, p, b, microbatches))(
        state.params, fixed_batch(rows))
    grads = jax.device_get(jax.tree.map(lambda g: g / stats["tokens"], grads))
    step = make_train_step(model, optimizer, config)
    losses, grad_norms = [], []
    for _ in range(STEPS):
      state, metrics = step(state, fixed_batch(rows))
      losses.append(float(metrics["loss"]))
      grad_norms.append(float(metrics["grad_norm"]))
  return initial, grads, (losses, grad_norms), jax.device_get(state.params)


def assert_matches_reference(config, overrides=(), rtol=1e-5, reference_microbatches=None, param_leaf_rtol=None):
  """Sharded init, first gradients, 3 LAMB steps' losses, gradient norms and final params vs the
  reference (with `reference_microbatches`, default the config's: the math is the same for any).

  Final params: every leaf within `param_leaf_rtol` (default rtol) and the whole model within
  rtol. A bias gradient component near Adam's eps (1e-6) turns a 1e-9 difference in summation
  order into a 1e-3 difference in its step, so a leaf may exceed what the whole model does."""
  microbatches = config.train.microbatches
  rows = config.train.batch_size
  initial, ref_grads, (ref_losses, ref_grad_norms), ref_params = reference(
      config.model.block, reference_microbatches or microbatches, config.model.num_kv_heads, overrides, rows)
  plan = build_plan(config)
  state = plan.init_state(jax.random.key(0))
  # Compared on the host: the pipeline's stacked layers are unstacked with numpy slicing.
  model_params = lambda tree: plan.model_params(jax.device_get(tree))
  for got, want in zip(jax.tree.leaves(model_params(state.params)), jax.tree.leaves(initial)):
    np.testing.assert_array_equal(got, want)   # sharded init = reference init

  step = plan.train_step(with_gradients=True)
  losses, grad_norms = [], []
  for i in range(STEPS):
    state, metrics, grads = step(state, plan.put_batch(fixed_batch(rows)))
    losses.append(float(metrics["loss"]))
    grad_norms.append(float(metrics["grad_norm"]))
    if i == 0:  # the first step's gradients, from the same parameters as the reference's
      errors = jax.tree.map(relative_error, model_params(grads), ref_grads)
      worst = max(jax.tree_util.tree_flatten_with_path(errors)[0], key=lambda kv: kv[1])
      assert worst[1] < rtol, f"gradient {jax.tree_util.keystr(worst[0])}: relative error {worst[1]:.2e}"
  np.testing.assert_allclose(losses, ref_losses, rtol=rtol)
  np.testing.assert_allclose(grad_norms, ref_grad_norms, rtol=rtol)  # the clipped steps' norm too
  params = model_params(state.params)
  flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])
  assert relative_error(flat(params), flat(ref_params)) < rtol
  if rtol <= 1e-5:  # (bf16: rounding-level agreement, Adam amplifies sign noise: the whole model only)
    errors = jax.tree.map(relative_error, params, ref_params)
    worst = max(jax.tree_util.tree_flatten_with_path(errors)[0], key=lambda kv: kv[1])
    assert worst[1] < (param_leaf_rtol or rtol), \
        f"param {jax.tree_util.keystr(worst[0])} after {STEPS} steps: {worst[1]:.2e}"
  assert int(state.step) == STEPS


def build_plan(config):
  """The plan on the first dp * pp * tp of the 8 test devices."""
  size = config.parallel.dp * config.parallel.pp * config.parallel.tp
  return ParallelPlan.build(config, GPT(ModelConfig.from_config(config.model)), make_mesh(config, jax.devices()[:size]))


@pytest.mark.parametrize("microbatches", [1, 2], ids=["no_accum", "accum2"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("block", ["parallel", "serial"])
@pytest.mark.parametrize("mesh", MESHES, ids=["x".join(map(str, m)) for m in MESHES])
def test_matches_the_single_device_reference(mesh, block, mode, microbatches):
  dp, _, tp = mesh
  assert_matches_reference(parallel_config(dp, tp, block, mode, microbatches))


@pytest.mark.parametrize("overrides,rtol", [
    ((("remat", "full"),), 1e-5),
    ((("tie_embeddings", True), ("use_bias", False)), 1e-5),
    ((("compute_dtype", "bfloat16"),), 3e-2),   # the default dtype: bf16 matmuls on both sides
], ids=["remat", "tied_no_bias", "bf16"])
def test_model_variants_match_the_reference(overrides, rtol):
  """Recomputation around the ring matmuls' custom VJPs; the tied head on the vocab shard;
  bf16 compute, where only rounding (not math) may differ."""
  config = parallel_config(2, 4, "parallel", "collective_matmul", 2)
  for field, value in overrides:
    config.model[field] = value
  assert_matches_reference(config, overrides, rtol)


def test_xla_mode_compiles_with_windowed_einsum_options():
  plans = {mode: build_plan(parallel_config(2, 4, mode=mode)) for mode in MODES}
  assert plans["xla"].compiler_options == {"xla_gpu_threshold_for_windowed_einsum_mib": 0,
                                           "xla_gpu_multi_streamed_windowed_einsum": True}
  assert plans["none"].compiler_options is None and plans["collective_matmul"].compiler_options is None


# --- The compiled program.

def _groups(line: str):
  """The replica groups of one HLO collective, as a set of frozensets of device ids."""
  match = re.search(r"replica_groups=\{(\{[\d,{} ]*\})\}", line)
  if match:
    return {frozenset(map(int, g.split(","))) for g in re.findall(r"\{([\d, ]+)\}", match.group(1))}
  match = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
  if match:  # iota form: [groups, size] <= [dims] transposed by perm
    groups, size, dims, perm = match.groups()
    ids = np.arange(int(groups) * int(size)).reshape([int(d) for d in dims.split(",")])
    if perm:
      ids = ids.transpose([int(p) for p in perm.split(",")])
    return {frozenset(row) for row in ids.reshape(int(groups), int(size)).tolist()}
  return None


def _permute_groups(line: str, mesh):
  """A collective-permute's axis, as the groups of that axis if every pair stays inside one."""
  pairs = re.findall(r"\{(\d+),(\d+)\}", line.split("source_target_pairs=", 1)[-1].split("}}", 1)[0] + "}")
  if "source_target_pairs=" not in line or not pairs:
    return None
  for axis in mesh.axis_names:
    groups = mesh_groups(mesh, axis)
    if all(any({int(a), int(b)} <= g for g in groups) for a, b in pairs):
      return groups
  return None


def mesh_groups(mesh, axis):
  """The device-id groups of one mesh axis, in the logical ids the HLO uses."""
  ids = np.arange(mesh.size).reshape(mesh.devices.shape)
  moved = np.moveaxis(ids, mesh.axis_names.index(axis), -1)
  return {frozenset(row) for row in moved.reshape(-1, moved.shape[-1]).tolist()}


def collective_counts(text: str, mesh) -> collections.Counter:
  """(op, axis, phase) -> count; phase is forward / backward from the ops' jvp metadata."""
  axes = {frozenset(map(frozenset, mesh_groups(mesh, a))): a for a in mesh.axis_names if mesh.shape[a] > 1}
  counts = collections.Counter()
  for line in text.splitlines():
    op = re.search(r"= [^=]*? (all-gather|reduce-scatter|all-reduce|collective-permute)(?:-start)?\(", line)
    if not op:
      continue
    phase = "backward" if "transpose(" in line else "forward" if "jvp(" in line else "other"
    groups = _groups(line) or _permute_groups(line, mesh)
    axis = axes.get(frozenset(groups), "other") if groups else "other"
    counts[op.group(1), axis, phase] += 1
  return counts


@functools.cache
def compiled_step_text(dp, tp, block, mode, layers):
  plan = build_plan(parallel_config(dp, tp, block, mode, layers=layers))
  return plan, plan.train_step().lower(*plan.abstract_inputs()).compile().as_text()


@pytest.mark.parametrize("layers", [2, 3])
@pytest.mark.parametrize("block,per_layer", [("parallel", 1), ("serial", 2)])
def test_tp_collectives_per_layer_without_overlap(block, per_layer, layers):
  """mode none: per layer, forward, per_layer all-gathers and reduce-scatters over tp (and
  their transposes backward); plus the head's all-gather and the embedding's reduce-scatter."""
  plan, text = compiled_step_text(2, 4, block, "none", layers)
  counts = collective_counts(text, plan.mesh)
  for phase in ("forward", "backward"):
    assert counts["all-gather", "tp", phase] == per_layer * layers + 1, (phase, counts)
    assert counts["reduce-scatter", "tp", phase] == per_layer * layers + 1, (phase, counts)
  assert counts["collective-permute", "tp", "forward"] == 0


@pytest.mark.parametrize("block", ["parallel", "serial"])
def test_collective_matmul_leaves_only_permutes_in_the_blocks(block):
  """mode collective_matmul: no tp all-gather / reduce-scatter of activations in any block,
  forward or backward. Left: the embedding's reduce-scatter (forward) and its transpose, an
  all-gather (backward), the same for 2 and 3 layers."""
  two = collective_counts(compiled_step_text(2, 4, block, "collective_matmul", 2)[1], build_plan(
      parallel_config(2, 4, block, "collective_matmul")).mesh)
  plan, text = compiled_step_text(2, 4, block, "collective_matmul", 3)
  three = collective_counts(text, plan.mesh)
  for phase, (gathers, scatters) in {"forward": (0, 1), "backward": (1, 0)}.items():
    assert three["all-gather", "tp", phase] == two["all-gather", "tp", phase] == gathers, three
    assert three["reduce-scatter", "tp", phase] == two["reduce-scatter", "tp", phase] == scatters, three
    assert three["collective-permute", "tp", phase] > two["collective-permute", "tp", phase] > 0
    assert three["collective-permute", "other", phase] == three["collective-permute", "dp", phase] == 0


def test_zero_reduce_scatters_gradients_and_never_all_reduces_them():
  # The serial block: in the parallel one the two output biases share one gradient, and XLA
  # rightly reduces it once.
  plan, text = compiled_step_text(2, 4, "serial", "none", 2)
  counts = collective_counts(text, plan.mesh)
  leaves = len(jax.tree.leaves(plan.layouts))
  assert counts["reduce-scatter", "dp", "other"] == leaves   # one per gradient leaf
  assert counts["all-gather", "dp", "other"] == leaves       # the ZeRO parameter gather
  # Prefetch: the program's first collective is a ZeRO parameter gather over dp.
  first = next(line for line in text.split("ENTRY", 1)[1].splitlines()
               if re.search(r" (all-gather|reduce-scatter|all-reduce|collective-permute)(-start)?\(", line))
  assert " all-gather" in first and _groups(first) == mesh_groups(plan.mesh, "dp"), first.strip()[:160]
  dp_groups = {frozenset(g) for g in mesh_groups(plan.mesh, "dp")}
  for line in text.splitlines():
    if re.search(r" all-reduce(-start)?\(", line):
      groups = _groups(line)
      crosses_dp = any(not any(g <= t for t in mesh_groups(plan.mesh, "tp")) for g in groups)
      result_type = line.split("=", 1)[1].split(" all-reduce")[0]
      dims = re.findall(r"[a-z0-9]+\[([\d,]*)\]", result_type)
      if crosses_dp or groups == dp_groups:
        assert all(d == "" for d in dims), f"a non-scalar all-reduce over dp: {line.strip()[:160]}"


@pytest.mark.parametrize("mesh", [(8, 1, 1), (2, 1, 4)], ids=["8x1x1", "2x1x4"])
def test_optimizer_state_is_split_over_dp(mesh):
  dp, _, tp = mesh
  config = parallel_config(dp, tp)
  config.model.num_kv_heads = 8  # every leaf has a dimension that splits 8 ways
  plan = build_plan(config)
  state = plan.init_state(jax.random.key(0))
  moments = [leaf for leaf in jax.tree.leaves(state.opt_state) if leaf.ndim > 0]
  assert len(moments) == 2 * len(jax.tree.leaves(state.params))  # Adam's mu and nu
  layouts = jax.tree.leaves(plan.layouts) * 2
  per_device = sum(leaf.addressable_shards[0].data.nbytes for leaf in moments)
  expected = sum(leaf.nbytes // (dp * (tp if layout.tp_dim is not None else 1))
                 for leaf, layout in zip(moments, layouts))
  assert per_device == expected
  if tp == 1:
    assert per_device * dp == sum(leaf.nbytes for leaf in moments)  # exactly total / dp
  assert all(layout.dp_dim is not None for layout in jax.tree.leaves(plan.layouts))
