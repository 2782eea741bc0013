"""The 3D-parallel step against the single-device reference, on 8 CPU devices (pp = 1).

Every mesh, block, tp_overlap and accumulation the step claims, and every pair of them on each
mesh (a covering array: CASES): the loss and every gradient within 1e-5 relative of
megajax.reference_step's single-device step, and the params after 3 LAMB steps within 1e-5
(with the default parallel.grad_sync="step"; tp_overlap="xla" is mode none's program on CPU,
and collective_matmul at tp = 1, checked as such); both gradient syncs
over dp with 4 microbatches; then the model variants (recomputation, tied head, bf16, the
block families: RMSNorm + SwiGLU, the two-norm parallel block); then
the linears gathered in bf16 against fp32 gathers, bit for bit.
"""

import jax
import numpy as np
import pytest

from megajax.config import GRAD_SYNC_CHOICES, TP_OVERLAP_CHOICES
from megajax.parallel import zero
from megajax.parallel.step import XLA_WINDOWED_EINSUM_OPTIONS
from tests.support.reference import (assert_matches_reference, fixed_batch, parallel_config, parallel_step_for,
                                     pipeline_config)

MESHES = [(8, 1, 1), (1, 1, 8), (2, 1, 4), (4, 1, 2)]
# Every tp_overlap mode the config accepts is checked on every mesh; "xla" (and "collective_matmul"
# at tp = 1) as the program of mode none, below, the others run.
assert set(TP_OVERLAP_CHOICES) == {"none", "collective_matmul", "xla"}
# A covering array, not the full product (the same checks, half the compiles): every mesh runs
# both blocks and both accumulations, every tp mesh both modes and every pair of (block, mode,
# microbatches), and the tp meshes together every triple: each takes half of the 2 x 2 x 2 cube
# (an orthogonal array, each pair once), the next mesh the other half. At tp = 1 (mode none
# only) the serial block accumulates and the parallel one does not.
HALVES = ([("parallel", "none", 1), ("parallel", "collective_matmul", 2), ("serial", "none", 2),
           ("serial", "collective_matmul", 1)],
          [("parallel", "none", 2), ("parallel", "collective_matmul", 1), ("serial", "none", 1),
           ("serial", "collective_matmul", 2)])
CASES = [((8, 1, 1), "parallel", "none", 1), ((8, 1, 1), "serial", "none", 2)] + [
    (mesh, *case) for i, mesh in enumerate(MESHES[1:]) for case in HALVES[i % 2]]


@pytest.mark.parametrize("mesh,block,mode,microbatches", CASES,
                         ids=["x".join(map(str, m)) + f"-{b}-{o}-{'accum2' if n > 1 else 'no_accum'}"
                              for m, b, o, n in CASES])
def test_matches_the_single_device_reference(mesh, block, mode, microbatches):
  """Accumulating: two layers (the first microbatch gathers each layer's ZeRO shards a layer
  ahead, the second reuses them); without accumulation one layer (the gathers, the ring
  matmuls and the reductions are each layer's own: a second adds compile time, not a path).

  Mode none's case also checks the modes whose step is its program, text for text (checked
  as such, not compiled again): "xla" (XLA's windowed-einsum rewrite is a GPU pass: on CPU
  the step is mode none's StableHLO with GPU-only compiler options, asserted) and, at tp = 1,
  "collective_matmul" (no ring over one device)."""
  dp, _, tp = mesh
  layers = 2 if microbatches > 1 else 1
  config = parallel_config(dp, tp, block, mode, microbatches, layers=layers)
  same_program = []
  if mode == "none":
    same_program = [parallel_config(dp, tp, block, other, microbatches, layers=layers)
                    for other in ("xla", "collective_matmul") if other == "xla" or tp == 1]
    xla = parallel_step_for(same_program[0])
    assert xla.compiler_options == XLA_WINDOWED_EINSUM_OPTIONS and parallel_step_for(config).compiler_options is None
  assert_matches_reference(config, same_program=same_program)


GRAD_SYNC_MESHES = [(2, 1, 2), (4, 1, 2)]


@pytest.mark.parametrize("grad_sync", GRAD_SYNC_CHOICES)
@pytest.mark.parametrize("mesh", GRAD_SYNC_MESHES, ids=["x".join(map(str, m)) for m in GRAD_SYNC_MESHES])
def test_both_gradient_syncs_match_the_reference(mesh, grad_sync):
  """Once per step (the local fp32 sum of 4 microbatches, then the dp reduce-scatter) and per
  microbatch (4 reduce-scatters summed into the shard): the same gradients and steps."""
  dp, _, tp = mesh
  config = parallel_config(dp, tp, "serial", "collective_matmul", microbatches=4)
  config.parallel.grad_sync = grad_sync
  assert_matches_reference(config)


@pytest.mark.parametrize("overrides,rtol", [
    ((("block", "serial"), ("norm", "rmsnorm"), ("mlp", "swiglu"), ("use_bias", False), ("remat", "full")),
     1e-5),
    ((("block", "parallel_two_norms"), ("mlp", "gelu_exact"), ("tie_embeddings", True)), 1e-5),
    ((("compute_dtype", "bfloat16"),), 3e-2),   # the default dtype: bf16 matmuls on both sides
    ((("norm", "layernorm_nobias"), ("mlp", "swiglu"), ("use_bias", False), ("global_rope", False),
      ("logit_scale", 0.0625), ("tie_embeddings", True)), 1e-5),
    ((("block", "serial"), ("norm", "rmsnorm"), ("mlp", "swiglu"), ("use_bias", False), ("qkv_bias", True)), 1e-5),
    ((("mlp", "swiglu"), ("use_bias", False), ("qkv_bias", True)), 1e-5),
    ((("block", "parallel_two_norms"), ("use_bias", False), ("qkv_bias", True)), 1e-5),
], ids=["llama-remat", "neox-tied", "bf16", "cohere2-nope", "qwen2", "qkv-bias-parallel", "qkv-bias-two-norms"])
def test_model_variants_match_the_reference(overrides, rtol):
  """The block families, each with one more switch (one compile checks two code paths, each
  against the reference): Llama's serial block (RMSNorm, a bias-free SwiGLU: gate and up in one
  column matmul) recomputed in its backward around the ring matmuls' custom VJPs; GPT-NeoX's
  two-norm parallel block (its input gathered around the ring by autodiff, both norms after it)
  with its biases and a tied head on the vocab shard (bias-free linears: Llama's case); then
  bf16 compute, where only rounding (not math) may differ; Cohere2's (a LayerNorm without bias,
  SwiGLU in the parallel block, the global layer without positions, the logit scale on the vocab
  shard); Qwen2's (Llama's with biases on q, k and v alone: model.qkv_bias), and those biases in
  both parallel blocks, whose fused column matmul then adds zeros for the MLP's inputs. (SwiGLU
  in a parallel block: the pipeline's case too.)"""
  config = parallel_config(2, 4, "parallel", "collective_matmul", 2)
  for field, value in overrides:
    config.model[field] = value
  assert_matches_reference(config, rtol)


@pytest.mark.parametrize("mesh,block", [((2, 1, 4), "parallel"), ((4, 1, 2), "serial")], ids=["2x1x4", "4x1x2"])
def test_packed_documents_match_the_reference(mesh, block):
  """Packed rows (segment_ids, positions) through the sharded forward: attention sees the
  full sequence's segment ids on every tp rank; equal to the reference on the same rows."""
  dp, _, tp = mesh
  assert_matches_reference(parallel_config(dp, tp, block, "collective_matmul", 2), packed=True)


def _two_bf16_steps(config, fp32_gathers: bool, monkeypatch, compiler_options=None):
  """Two steps of `config` (bf16 compute): (losses, first gradients, final params) on the
  host; fp32_gathers=True: every leaf gathered in fp32, as before compute-dtype gathers;
  compiler_options: the step compiled with these XLA options."""
  with monkeypatch.context() as patch:
    if fp32_gathers:
      patch.setattr(zero, "gathers_in_compute_dtype", lambda path: False)
    parallel_step = parallel_step_for(config)
    state = parallel_step.init_state(jax.random.key(0))
    step = parallel_step.train_step(with_gradients=True)
    if compiler_options:
      step = step.lower(*parallel_step.abstract_inputs()).compile(compiler_options)
    losses, first_grads = [], None
    for _ in range(2):
      state, metrics, grads = step(state, parallel_step.put_batch(fixed_batch(config.train.batch_size)))
      losses.append(np.asarray(metrics["loss"]))
      first_grads = first_grads if first_grads is not None else jax.device_get(grads)
    return losses, first_grads, jax.device_get(state.params)


@pytest.mark.parametrize("grad_sync", GRAD_SYNC_CHOICES)
def test_compute_dtype_gathers_are_bit_identical_to_fp32_gathers(grad_sync, monkeypatch):
  """The linears gathered in bf16 (cast on the shard) against every leaf gathered in fp32 and
  cast where it is used: the same bits in the losses, the gradients (fp32 either way) and the
  params after 2 steps of 2 microbatches."""
  config = parallel_config(2, 2, "serial", "collective_matmul", microbatches=2)
  config.model.compute_dtype = "bfloat16"
  config.parallel.grad_sync = grad_sync
  bf16, fp32 = _two_bf16_steps(config, False, monkeypatch), _two_bf16_steps(config, True, monkeypatch)
  for got, want in zip(jax.tree.leaves(bf16), jax.tree.leaves(fp32)):
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def test_pipeline_compute_dtype_gathers_are_bit_identical_to_fp32_gathers(monkeypatch):
  """The same on a 1F1B pipeline (dp2 pp2 tp2), the steps compiled without XLA's excess
  precision: inside a stage, collective matmul runs chunk by chunk, so a kernel's cotangent
  is a bf16 sum over the chunks; with the fp32 gather its conversion to fp32 follows that sum
  at once, and XLA (xla_allow_excess_precision, on by default) may skip the bf16 rounding of
  the sum, which a slice before the conversion keeps with the bf16 gather. Without it, the
  same bits."""
  config = pipeline_config((2, 2, 2), "1f1b", microbatches=2, rows=4)
  config.model.compute_dtype = "bfloat16"
  exact = {"xla_allow_excess_precision": False}
  bf16 = _two_bf16_steps(config, False, monkeypatch, exact)
  fp32 = _two_bf16_steps(config, True, monkeypatch, exact)
  for got, want in zip(jax.tree.leaves(bf16), jax.tree.leaves(fp32)):
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
