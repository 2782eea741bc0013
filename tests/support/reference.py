"""The 3D step against the single-device reference step (megajax.reference_step).

`assert_matches_reference(config)`: the sharded initial parameters equal the reference's,
the first step's every gradient is within `rtol` (relative), and after 3 LAMB steps the
losses, gradient norms and parameters are too; the compiled step holds no collective over a
mesh axis of one device. The reference takes the whole batch at once
(accumulation changes only the order of sums; tests/unit/test_reference_step.py checks the
reference's own accumulation), so it runs once per model (cached), whatever the microbatches.
"""

import functools
import hashlib
import pickle

import jax
import numpy as np

from megajax.config import default_config
from megajax.sections import section
from megajax.model import GPT, ModelConfig, init_params
from megajax.observe.hlo import collectives_by_group_size
from megajax.optim import make_optimizer
from megajax.parallel import ParallelStep
from megajax.parallel.pipeline import pipeline_gradients
from megajax.parallel.pipeline.baseline import gpipe_autodiff_gradients
from megajax.reference_step import fresh_train_state, make_reference_step
from megajax.trainer import build_parallel_step
from tests.support.once import once_per_run

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


def fixed_batch(rows=BATCH, packed=False):
  """packed=True: each row holds 1-4 documents (segment_ids, positions restarting at each)."""
  rng = np.random.default_rng(0)
  mask = (rng.random((rows, SEQ)) > 0.2).astype(np.float32)  # unequal token counts per row
  batch = {"inputs": rng.integers(0, VOCAB, (rows, SEQ)).astype(np.int32),
           "targets": rng.integers(0, VOCAB, (rows, SEQ)).astype(np.int32), "loss_mask": mask}
  if packed:
    starts = [np.sort(rng.choice(np.arange(1, SEQ), rng.integers(0, 4), replace=False)) for _ in range(rows)]
    segment_ids = np.stack([np.searchsorted(s, np.arange(SEQ), side="right") + 1 for s in starts])
    first = np.stack([np.concatenate([[0], s])[ids - 1] for s, ids in zip(starts, segment_ids)])
    batch.update(segment_ids=segment_ids.astype(np.int32), positions=(np.arange(SEQ) - first).astype(np.int32))
  return batch


def relative_error(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


@functools.cache
def reference(model_fields, rows=BATCH, packed=False, microbatches=1):
  """Single device (megajax.reference_step), the whole batch as one microbatch (or
  `microbatches` accumulated), for the model whose config.model fields are `model_fields`
  ((name, value) pairs): the initial params, first gradients, losses, final params. Computed
  once per test run (the xdist workers share it: tests.support.once), kept in memory once read.

  Always without remat: a policy changes what the backward recomputes, not the math, so a
  remat'd step is held to the plain model's numbers (one reference for every policy)."""
  key = (tuple(sorted({**dict(model_fields), "remat": "none"}.items())), rows, packed, microbatches)

  def make(path):
    path.mkdir()
    with open(path / "reference.pkl", "wb") as f:
      pickle.dump(_single_device_reference(*key), f)

  path = once_per_run(None, "reference-" + hashlib.sha256(repr(key).encode()).hexdigest()[:16], make)
  with open(path / "reference.pkl", "rb") as f:
    return pickle.load(f)


def _single_device_reference(model_fields, rows, packed, microbatches):
  config = parallel_config(microbatches=microbatches)
  config.model.update(dict(model_fields))
  config.train.batch_size = rows
  model = GPT(ModelConfig.from_config(config.model))
  optimizer = make_optimizer(config.optimizer, config.train.steps)
  with jax.default_device(jax.devices()[0]):
    # init_train_state's state, its parameters by the model's own init (the sharded inits are
    # checked against them bit for bit).
    params = jax.jit(functools.partial(init_params, model))(jax.random.key(0))
    state = jax.jit(fresh_train_state, static_argnums=1)(params, optimizer)
    initial = jax.device_get(state.params)
    # One program (the step with its gradients): the first step's are the first gradients.
    step = make_reference_step(model, optimizer, config, with_gradients=True)
    losses, grad_norms, first_grads = [], [], None
    for _ in range(STEPS):
      state, metrics, grads = step(state, fixed_batch(rows, packed))
      first_grads = first_grads if first_grads is not None else jax.device_get(grads)
      losses.append(float(metrics["loss"]))
      grad_norms.append(float(metrics["grad_norm"]))
  return initial, first_grads, (losses, grad_norms), jax.device_get(state.params)


def assert_matches_reference(config, rtol=1e-5, param_leaf_rtol=None, packed=False, same_program=(),
                             accumulated_reference=False):
  """Sharded init, first gradients, 3 LAMB steps' losses, gradient norms and final params vs the
  reference (the whole batch at once: the math is the same for any number of microbatches).

  Final params: every leaf within `param_leaf_rtol` (default rtol) and the whole model within
  rtol. A bias gradient component near Adam's eps (1e-6) turns a 1e-9 difference in summation
  order into a 1e-3 difference in its step, so a leaf may exceed what the whole model does.
  packed=True: both steps train on packed rows (fixed_batch(packed=True)).
  accumulated_reference=True: the reference accumulates the config's microbatches, summing in
  their order (by default the whole batch at once: one reference for every microbatch count).
  same_program: configs whose step must lower to this one's StableHLO, text for text (so this
  check's numbers are theirs; they are lowered, not compiled or run)."""
  rows = config.train.batch_size
  microbatches = config.train.microbatches if accumulated_reference else 1
  initial, ref_grads, (ref_losses, ref_grad_norms), ref_params = reference(   # the same model, on one device
      tuple(sorted(config.model.to_dict().items())), rows, packed, microbatches)
  parallel_step = parallel_step_for(config)
  state = parallel_step.init_program()(jax.random.key(0))
  # Compared on the host: the pipeline's stacked layers are unstacked with numpy slicing.
  model_params = lambda tree: parallel_step.model_params(jax.device_get(tree))
  for got, want in zip(jax.tree.leaves(model_params(state.params)), jax.tree.leaves(initial)):
    np.testing.assert_array_equal(got, want)   # sharded init = reference init

  batch = parallel_step.put_batch(fixed_batch(rows, packed))
  inputs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), (state, batch))
  lowered = parallel_step.train_step(with_gradients=True).lower(*inputs)
  for other in same_program:
    other_lowered = parallel_step_for(other).train_step(with_gradients=True).lower(*inputs)
    assert other_lowered.as_text() == lowered.as_text(), other.parallel
  step = lowered.compile()
  # No collective over a mesh axis of one device (megajax.parallel.collectives), on any mesh.
  over_one = {key: n for key, n in collectives_by_group_size(step.as_text(), parallel_step.mesh.size).items()
              if key[0] != "collective-permute" and key[1] == 1}
  assert not over_one, f"collectives over groups of one device: {over_one}"
  losses, grad_norms = [], []
  for i in range(STEPS):
    state, metrics, grads = step(state, batch)
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


def parallel_step_for(config) -> ParallelStep:
  """The trainer's 3D step (megajax.trainer.build_parallel_step: probes and drills from the
  config) on the first dp * pp * cp * tp of the 8 test devices."""
  size = section(config, "parallel").device_count
  return build_parallel_step(config, jax.devices()[:size])


# --- Pipelines.

ROWS = 32   # 4p microbatches of one row at p = 8


def pipeline_config(mesh, schedule="interleaved_1f1b", virtual_stages=1, microbatches=None, layers=None,
                    mode=None, traversal="depth_first", rows=ROWS):
  dp, pp, tp = mesh
  # tp meshes run the default collective matmul (chunked inside the pipeline's branches). One
  # layer per chunk unless asked (chunks of several layers: the dp-pieces tests, 8 and 12).
  c = parallel_config(dp, tp, "parallel", mode or ("collective_matmul" if tp > 1 else "none"),
                      microbatches or pp, layers=layers or pp * virtual_stages)
  c.train.batch_size = rows
  c.parallel.pp, c.parallel.virtual_stages = pp, virtual_stages
  c.parallel.schedule, c.parallel.traversal = schedule, traversal
  # The kept residuals (the GPU default; CPU's rerun is tested where a case asks for it).
  c.parallel.pipeline_recompute = False
  return c


def compiled_gradients(mesh, m, baseline=False, packed=False, ordered_collectives=None):
  """(the 3D step, its compiled gradient program) for a 1F1B pipeline of m one-row
  microbatches; baseline=True: GPipe by autodiff in its place; packed=True: the batch has
  segment_ids and positions (token data with data.document_masking); ordered_collectives:
  the executor's tick order (None: the step's, ordered on these CPU devices; False: the
  decoupled sends the GPU build runs, compiled here but not run)."""
  config = pipeline_config(mesh, "1f1b", 1, microbatches=m, layers=mesh[1] * 2, mode="none", rows=m)
  config.model.window_pattern = "L"
  if packed:
    config.data.source, config.data.document_masking = "tokens", True
  parallel_step = parallel_step_for(config)
  fn = None
  if baseline:
    fn = functools.partial(gpipe_autodiff_gradients, layouts=parallel_step.layouts, stages=mesh[1], virtual_stages=1,
                           microbatches=m, c=parallel_step.model.config, overlap=parallel_step.overlap,
                           z_loss=config.train.z_loss, bucket_bytes=section(config, "parallel").dp_bucket_bytes)
  elif ordered_collectives is not None:
    fn = functools.partial(pipeline_gradients, layouts=parallel_step.layouts, tables=parallel_step.pipeline,
                           c=parallel_step.model.config, overlap=parallel_step.overlap, z_loss=config.train.z_loss,
                           grad_sync=config.parallel.grad_sync, ordered_collectives=ordered_collectives,
                           bucket_bytes=section(config, "parallel").dp_bucket_bytes)
  state, batch = parallel_step.abstract_inputs()
  return parallel_step, parallel_step.summed_gradients(fn).lower(state.params, batch).compile()
