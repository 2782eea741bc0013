"""The Pallas attention kernels and the 3D step that calls them lower for CUDA on this CPU
machine: jax.export for the `cuda` platform runs the Triton and Mosaic GPU lowerings (what the
interpreter cannot check: layouts, Triton's block ops), on whatever jax line CI installs. A
kernel that does not lower on a jax version pyproject.toml allows fails here."""

import itertools

import jax
import jax.numpy as jnp
import pytest

from megajax.layers.kernels import attention_hopper as hopper
from megajax.layers.kernels import pallas_attention
from megajax.model import GPT, ModelConfig
from megajax.parallel import ParallelStep, make_mesh
from tests.support.kernels import CUDNN_CALLS, MOSAIC_CALL as MOSAIC, TRITON_CALL as TRITON, export_for_cuda

BLOCK = hopper.BLOCK
WINDOWS = (None, BLOCK // 2, BLOCK, 3 * BLOCK + 8)     # none, below, equal to and above a block


def shapes(s, d, documents):
  """bf16 q [1, s, 4, d], k and v with 2 KV heads (GQA), segment ids or None."""
  q = jax.ShapeDtypeStruct((1, s, 4, d), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, s, 2, d), jnp.bfloat16)
  return q, kv, jax.ShapeDtypeStruct((1, s), jnp.int32) if documents else None


@pytest.mark.parametrize("d,window,documents", list(itertools.product((64, 128, 256), WINDOWS, (False, True))))
def test_hopper_forward_lowers_for_every_head_dim_and_window(d, window, documents):
  """The Mosaic GPU forward alone, every head dim it takes, windows around its block, with and
  without packed documents (their starts read per row)."""
  q, kv, doc_start = shapes(3 * hopper.ROWS_PER_PROGRAM, d, documents)

  def forward(q, k, v, *doc_start):
    return hopper.hopper_attention_forward(q, k, v, window, doc_start=doc_start[0] if doc_start else None)
  module = export_for_cuda(forward, q, kv, kv, *([doc_start] if documents else []))
  assert module.count(MOSAIC) == 1


@pytest.mark.parametrize("backend,d,window,documents", [
    ("triton", 64, None, False), ("triton", 128, BLOCK // 2, True), ("triton", 256, 3 * BLOCK + 8, False),
    ("mosaic", 64, BLOCK, True), ("mosaic", 128, None, False), ("mosaic", 256, BLOCK // 2, False)])
def test_attention_forward_and_gradients_lower_for_cuda(backend, d, window, documents):
  """pallas_attention's forward and dq, dk/dv kernels (the backward is Triton's on both back
  ends) at an odd length (padded to whole blocks), GQA; every head dim, window and back end
  covered by some case."""
  q, kv, segment_ids = shapes(200, d, documents)

  def grads(q, k, v, *segment_ids):
    attention = lambda q, k, v: pallas_attention(q, k, v, window, segment_ids[0] if segment_ids else None,
                                                 interpret=False, backend=backend)
    return jax.grad(lambda *qkv: jnp.sum(attention(*qkv).astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)
  module = export_for_cuda(grads, q, kv, kv, *([segment_ids] if documents else []))
  assert module.count(MOSAIC) == (backend == "mosaic")
  assert module.count(TRITON) == 2 + (backend == "triton")     # dq, dk/dv (+ the forward)


@pytest.mark.parametrize("forward,d,window", [
    ("mosaic", 64, None), ("mosaic", 128, BLOCK // 2), ("triton", 128, BLOCK), ("mosaic", 256, 3 * BLOCK + 8)])
def test_hopper_backward_lowers_for_cuda(forward, d, window):
  """backward="mosaic": the dq and dk/dv Mosaic GPU kernels (two-slot ring at d <= 128, one
  at 256 for shared memory) at an odd length, GQA, windows around the block, behind either
  forward."""
  q, kv, _ = shapes(200, d, False)

  def grads(q, k, v):
    attention = lambda q, k, v: pallas_attention(q, k, v, window, interpret=False, backend=forward, backward="mosaic")
    return jax.grad(lambda *qkv: jnp.sum(attention(*qkv).astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)
  module = export_for_cuda(grads, q, kv, kv)
  assert module.count(MOSAIC) == 2 + (forward == "mosaic")
  assert module.count(TRITON) == (forward == "triton")


FORWARD_OPTIONS = [hopper.ForwardOptions(**{name: True}) for name in (
    "accumulate_in_place", "p_in_registers", "transpose_k_in_kernel", "schedule_barrier")] + [
    hopper.ForwardOptions(True, True, True, True)]


@pytest.mark.parametrize("options", FORWARD_OPTIONS, ids=["in_place", "p_registers", "k_in_kernel", "schedule",
                                                          "all"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_hopper_forward_options_lower_for_cuda(options, d):
  """Each opt-in speed-up of the Hopper forward, and all four together (documents too), lower
  for every head dim: the interpreter cannot run three of them, so lowering is their CI check."""
  documents = options == FORWARD_OPTIONS[-1]
  q, kv, doc_start = shapes(3 * hopper.ROWS_PER_PROGRAM, d, documents)

  def forward(q, k, v, *doc_start):
    return hopper.hopper_attention_forward(q, k, v, BLOCK + 8, doc_start=doc_start[0] if doc_start else None,
                                           options=options)
  assert export_for_cuda(forward, q, kv, kv, *([doc_start] if documents else [])).count(MOSAIC) == 1


MESHES = {   # (dp, pp, tp, v, microbatches)
    "1x1x1": (1, 1, 1, 1, 1),
    "dp2-tp4": (2, 1, 4, 1, 2),
    "2x2x2 interleaved": (2, 2, 2, 2, 4),
}


def answer_cudnn_queries_as_hopper(monkeypatch):
  """jax.nn.dot_product_attention asks the installed cuDNN and GPU at trace time ("cuDNN is
  not detected" on CPU): answered as on an H100 with cuDNN 9.10, so the step traces the cuDNN
  custom calls it would on one (what cuDNN compiles them to is the GPU check's)."""
  from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention_lowering
  monkeypatch.setattr(cudnn_attention_lowering, "check_cudnn_version", lambda: 91000)
  monkeypatch.setattr(cudnn_attention_lowering, "check_compute_capability", lambda capability: True)
  monkeypatch.setattr(cudnn_attention_lowering, "is_cuda_compute_capability_equal", lambda capability: False)


@pytest.mark.parametrize("impl", ["pallas", "cudnn"])
@pytest.mark.parametrize("mesh", list(MESHES))
def test_the_3d_train_step_lowers_for_cuda(tiny_config, mesh, impl, monkeypatch):
  """The whole jitted 3D step (shard_map, ZeRO, tensor/sequence parallelism, the interleaved
  pipeline) with model.attention_impl=pallas or cudnn, built on this machine's CPU devices for
  the "cuda" platform and exported: every layer's attention is the compiled kernels (forward,
  dq, dk/dv), none interpreted, or cuDNN's fused attention forward and backward."""
  dp, pp, tp, v, microbatches = MESHES[mesh]
  c = tiny_config
  c.parallel.dp, c.parallel.pp, c.parallel.tp, c.parallel.virtual_stages = dp, pp, tp, v
  c.model.num_layers, c.model.hidden_dim, c.model.num_heads = 2 * pp * v, 64, 4
  c.model.seq_len, c.model.window, c.model.compute_dtype = 80, 24, "bfloat16"
  c.model.attention_impl = impl
  c.train.batch_size, c.train.microbatches = 2 * dp * microbatches, microbatches
  if impl == "cudnn":
    answer_cudnn_queries_as_hopper(monkeypatch)
  model = GPT(ModelConfig.from_config(c.model))
  step = ParallelStep.build(c, model, make_mesh(c.parallel, jax.devices()[:dp * pp * tp]), platform="cuda")
  module = export_for_cuda(step.train_step(), *step.abstract_inputs())
  if impl == "pallas":
    assert module.count(TRITON) >= 3          # a layer's forward, dq and dk/dv kernels at least
  else:
    assert module.count(CUDNN_CALLS[0]) >= 1 and module.count(CUDNN_CALLS[1]) >= 1
    assert TRITON not in module and MOSAIC not in module
  assert "interpret" not in module
