"""The real training step compiled for H100s on this CPU machine (megajax.parallel.deviceless):
XLA's GPU compiler end to end (SPMD partitioning, fusion, Triton kernels, the latency-hiding
scheduler, buffer assignment, PTX and cubin), read where a GPU would only show it in a
profile: which collectives overlap compute, and how many bytes a device needs.

A model wide enough that XLA's scheduler weighs the collectives against real kernels (hidden
512, 256 tokens), two layers a chunk. Each program is compiled once per worker (~15-20 s on
2 busy cores) and read by the checks that need it."""

import collections
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np
import pytest

from megajax.config import default_config
from megajax.layers.kernels import lowering_for, pallas_attention
from megajax.observe.schedule import async_collectives, loop_copies, overlap_counts, synchronous_collectives
from megajax.parallel import deviceless
from megajax.parallel.context_parallel import CP, halo_attention, ring_attention
from megajax.parallel.planner import (calibration, memory_gpu_fit, memory_gpu_pipeline_fit, memory_measured_gpu,
                                      memory_measured_gpu_pipeline)
from tests.support.kernels import CUDNN_CALLS, TRITON_CALL

MESHES = {   # (dp, pp, tp, virtual stages, microbatches)
    "dp2-tp4": (2, 1, 4, 1, 2),
    "2x2x2-v2": (2, 2, 2, 2, 4),
}


def gpu_config(mesh: str, impl: str):
  dp, pp, tp, v, microbatches = MESHES[mesh]
  c = default_config()
  c.parallel.dp, c.parallel.pp, c.parallel.tp, c.parallel.virtual_stages = dp, pp, tp, v
  c.model.num_layers, c.model.hidden_dim, c.model.num_heads = 2 * pp * v, 512, 4
  c.model.seq_len, c.model.window, c.model.vocab_size = 256, 64, 1024
  c.model.compute_dtype, c.model.attention_impl = "bfloat16", impl
  c.train.batch_size, c.train.microbatches = dp * microbatches, microbatches
  return c


@functools.cache
def compiled(mesh: str, impl: str, program: str = "train") -> deviceless.CompiledForGpu:
  return deviceless.compile_for_gpu(gpu_config(mesh, impl), "h100-80g", program)


def overlap_table(result) -> str:
  """(kind, axis): overlapped / all, one line (what the closing note reports)."""
  counts = overlap_counts(result.text, result.step.mesh)
  return ", ".join(f"{kind} {axis} {done}/{total}" for (kind, axis), (done, total) in sorted(counts.items()))


@pytest.mark.parametrize("impl", ["pallas", "cudnn"])
@pytest.mark.parametrize("mesh", list(MESHES))
def test_the_step_compiles_for_h100s_with_its_kernels_and_fits(mesh, impl):
  """The 3D step for 8 described H100s: every layer's attention is compiled kernels (the Pallas
  forward, dq and dk/dv as Triton kernels, or cuDNN's fused attention), and XLA's bytes per
  device hold the state and fit the device."""
  result = compiled(mesh, impl)
  text = result.text
  if impl == "pallas":
    layers_per_device = result.step.model.config.num_layers // MESHES[mesh][1]
    assert text.count(TRITON_CALL) >= 3 * layers_per_device
  else:
    assert all(f'custom_call_target="{name}"' in text for name in CUDNN_CALLS) and TRITON_CALL not in text
  memory = result.compiled.memory_analysis()
  state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(result.step.abstract_inputs()[0])) \
      // jax.tree.leaves(result.step.abstract_inputs()[0])[0].sharding.mesh.size
  assert memory.argument_size_in_bytes >= state_bytes
  assert memory.alias_size_in_bytes > 0          # the donated state is updated in place
  if MESHES[mesh][1] == 1:    # the non-finite skip is a select, not a branch holding the gradients twice more
    assert "conditional(" not in text
  assert 0 < result.bytes_per_device() < deviceless.GPU_TARGETS["h100-80g"].memory_bytes
  print(f"{mesh} {impl}: compiled in {result.compile_seconds:.1f} s, {result.bytes_per_device() / 2**20:.1f} MiB "
        f"a device; overlapped/all: {overlap_table(result)}")


@pytest.mark.parametrize("mesh", list(MESHES))
def test_every_collective_is_async_and_the_parallelism_collectives_overlap_compute(mesh):
  """No collective blocks; ZeRO's dp gathers all overlap compute but the first (the first
  layer's, with nothing before it to hide under), its reduce-scatters all do, but with pp > 1
  maybe the last one after the tick scan (the first chunk's rows, whose backward runs last, and
  the shared leaves: what follows is the optimizer, which clips by the norm of every gradient);
  the pipeline's pp sends all do. What XLA's scheduler decides, read from the scheduled module
  (XLA's combiners merge ZeRO's per-operand collectives here: a handful per step)."""
  result = compiled(mesh, "pallas")
  assert synchronous_collectives(result.text) == []
  counts = overlap_counts(result.text, result.step.mesh)
  gathers, gathers_total = counts[("all-gather", "dp")]
  assert gathers >= gathers_total - 1 and gathers_total >= 2
  scatters, scatters_total = counts[("reduce-scatter", "dp")]
  assert scatters >= scatters_total - (MESHES[mesh][1] > 1) and scatters >= 1
  if MESHES[mesh][1] > 1:
    sends, sends_total = counts[("collective-permute", "pp")]
    assert sends == sends_total >= 2


def test_the_collective_matmul_ring_hides_every_hop_under_a_partial_matmul():
  """tp_overlap=collective_matmul (the GPU default) on dp2-tp4: the ppermutes of the tp ring
  have a kernel between their start and their done, all but at most one a layer (the
  scheduler runs one permute of a kind at a time, and the two directions of a hop sometimes
  queue: 1 of 104 here). Fails when XLA's DotMerger merges the ring's per-chunk matmuls back
  into one dot after the last hop (38-45 of 100 hops then overlap nothing:
  ParallelStep.compiler_options turns it off)."""
  result = compiled("dp2-tp4", "pallas")
  assert result.step.overlap.mode == "collective_matmul"
  hops = [c for c in async_collectives(result.text, result.step.mesh)
          if c.kind == "collective-permute" and c.axis == "tp"]
  tp = MESHES["dp2-tp4"][2]
  layers = result.step.model.config.num_layers
  assert len(hops) >= 2 * layers * 2 * (tp - 1)     # two rings a layer's forward, both directions
  exposed = [c.start.name for c in hops if not c.overlapped]
  assert len(exposed) <= layers, exposed
  print(f"dp2-tp4: {len(hops) - len(exposed)} of {len(hops)} ring hops overlap a kernel")


def test_the_eval_step_compiles_for_h100s_with_no_gradient_collective():
  """The held-out eval step on the pipeline's mesh: the forward alone (no reduce-scatter over
  dp: there are no gradients) in less memory than the training step."""
  evaluation = compiled("2x2x2-v2", "pallas", "eval")
  counts = collections.Counter((c.kind, c.axis) for c in async_collectives(evaluation.text, evaluation.step.mesh))
  assert counts[("reduce-scatter", "dp")] == 0 and counts[("all-gather", "dp")] >= 1
  assert evaluation.text.count(TRITON_CALL) >= 1
  assert evaluation.bytes_per_device() < compiled("2x2x2-v2", "pallas").bytes_per_device()


@pytest.mark.parametrize("d", [64, 128, 256])
def test_the_portable_attention_kernels_compile_for_sm90_at_every_head_dim(d):
  """pallas_attention's Triton forward and its dq, dk/dv backward kernels compiled to cubin
  for sm_90 (bf16, GQA, a window below the length, an odd length padded to whole blocks): a
  kernel whose tiles do not fit an SM's shared memory fails here as on the GPU."""
  q = jax.ShapeDtypeStruct((1, 200, 4, d), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 200, 2, d), jnp.bfloat16)

  def loss_and_grads(q, k, v):
    attention = lambda q, k, v: pallas_attention(q, k, v, 72, interpret=False, backend="triton")
    return jax.value_and_grad(lambda *qkv: jnp.sum(attention(*qkv).astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)
  executable, seconds = deviceless.compile_function_for_gpu(loss_and_grads, q, kv, kv)
  assert executable.as_text().count(TRITON_CALL) == 3     # the forward, dq, dk/dv
  print(f"head dim {d}: the three kernels compiled in {seconds:.1f} s")


def test_the_pipeline_tick_loop_copies_no_whole_stage_buffer():
  """Inside the 2x2x2 step's tick loops, no copy is larger than one chunk's rows of the
  stage's largest fp32 gradient buffer: an accumulator or residual buffer copied whole per
  tick would be (before the executor added a backward's gradients outside its switch, every
  backward branch copied the stage's whole accumulators: 8 MiB copies, 199 in all)."""
  result = compiled("2x2x2-v2", "pallas")
  dp, v = MESHES["2x2x2-v2"][0], MESHES["2x2x2-v2"][3]
  state, _ = result.step.abstract_inputs()

  def whole_stage_bytes(leaf, layout):    # this device's fp32 buffer of the stage's rows, gathered over dp
    shape = list(leaf.sharding.shard_shape(leaf.shape))
    if layout.dp_dim is not None:
      shape[layout.dp_dim] *= dp
    return 4 * math.prod(shape)
  largest = max(jax.tree.leaves(jax.tree.map(whole_stage_bytes, state.params["layers"], result.step.layouts["layers"])))
  copies = loop_copies(result.text)
  assert copies, "the tick loops were found"
  biggest = max(copies, key=lambda copy: copy[1])
  assert biggest[1] <= largest // v, biggest
  print(f"2x2x2-v2: {len(copies)} copies in the tick loops, the largest {biggest[1] / 2**20:.2f} MiB "
        f"(a whole stage buffer: {largest / 2**20:.0f} MiB)")


def test_the_mfu_suite_rows_compile_for_one_h100_and_are_checked_against_its_memory():
  """bench train --compile_for=h100-80g at the tiny size: every row of the suite compiled for
  one H100 (cuDNN, then Pallas attention; AdamW, then LAMB at 4x the batch), XLA's bytes
  beside the planner's, each fitting."""
  from megajax.launch.bench.train import ROWS, fit_on_gpu
  rows = fit_on_gpu("tiny", 64, 16, "h100-80g")
  assert [r["row"] for r in rows] == list(ROWS)
  assert all(r["fits"] and r["xla_bytes"] > 0 and r["planner_bytes"] > 0 for r in rows)
  assert rows[-1]["batch"] == 4 * rows[0]["batch"]


def test_the_gpu_memory_data_is_xla_gpus_own_and_the_planner_holds_a_held_out_case():
  """memory_measured_gpu.py and memory_measured_gpu_pipeline.py (what memory.XLA_GPU and
  XLA_GPU_PIPELINE are fitted to and checked on) are XLA:GPU's bytes: a held-out case of each
  compiled again here gives them within 1%, and the planner predicts them within 10%."""
  single = next(case for case in memory_gpu_fit.GPU_HELD_OUT if case.name.startswith("h 768, 6 layers"))
  pipeline = next(case for case in memory_gpu_pipeline_fit.GPU_PIPELINE_HELD_OUT if case.name.startswith("dp 2 pp 4 tp 2 v 2"))
  for case, stored in ((single, memory_measured_gpu.HELD_OUT), (pipeline, memory_measured_gpu_pipeline.HELD_OUT)):
    measured = deviceless.compile_for_gpu(memory_gpu_fit.case_config(case), memory_gpu_fit.TARGET).bytes_per_device()
    assert measured == pytest.approx(stored[case.name], rel=0.01)
    assert memory_gpu_fit.predicted_bytes(case) == pytest.approx(measured, rel=calibration.MEMORY_TOLERANCE)
  # A budgeted entry is XLA:GPU's own too: the smallest case compiled for its smaller device again.
  name = min(memory_measured_gpu.BUDGETED, key=lambda name: memory_measured_gpu.BUDGETED[name][1])
  device, held = memory_measured_gpu.BUDGETED[name]
  case = next(case for case in memory_gpu_fit.GPU_HELD_OUT if case.name == name)
  target = deviceless.with_memory(memory_gpu_fit.TARGET, device)
  assert deviceless.compile_for_gpu(memory_gpu_fit.case_config(case), target).bytes_per_device() == pytest.approx(
      held, rel=0.01)


def test_megafbd_groups_compile_for_h100s_with_zero_and_tp_collectives():
  """MegaFBD's programs (megajax.parallel.fbd) for 8 described H100s, the forward on 4 (dp 2 x
  tp 2), the backward on the other 4 (dp 2 x tp 2): the backward reduce-scatters the gradients
  over its dp (ZeRO: each device keeps its shard of the sum), never all-reduces them over dp; the
  forward reduces its activations over tp and gathers no weights; each program fits an H100."""
  from megajax.model import GPT, ModelConfig
  from megajax.observe.hlo import collective_counts
  from megajax.parallel.fbd import FbdStep
  # XLA's attention: cuDNN's, partitioned by XLA's SPMD pass, is a custom partitioning whose
  # Python rule a compile-only client does not register.
  config = gpu_config("dp2-tp4", "xla")
  config.parallel.tp = 2
  devices = deviceless.gpu_devices("h100-80g", 8)
  step = FbdStep.build(config, GPT(ModelConfig.from_config(config.model)), devices[:4], devices[4:], 2, 2, 2, 2)
  programs = step.compile_programs(lambda lowered: deviceless.compile_lowered(lowered)[0])
  backward = collective_counts(programs["backward"].as_text(), step.backward_mesh)
  forward = collective_counts(programs["forward"].as_text(), step.forward_mesh)
  by_axis = lambda counts: {(op, axis) for op, axis, _ in counts}
  assert ("reduce-scatter", "dp") in by_axis(backward), backward
  assert ("all-reduce", "dp") not in by_axis(backward), backward
  # The forward gathers no weights (they arrive whole over dp) and scatters nothing.
  assert ("all-reduce", "tp") in by_axis(forward), forward
  assert not {op for op, _ in by_axis(forward)} & {"all-gather", "reduce-scatter"}, forward
  limit = deviceless.GPU_TARGETS["h100-80g"].memory_bytes
  assert all(deviceless.bytes_per_device(p) < limit for p in programs.values())


def test_context_parallel_halo_runs_under_compute_and_the_own_keys_stay_in_the_kernel():
  """A sliding-window layer's attention over cp = 4 described H100s (bf16, s = 16,384, w = 1,025,
  forward and backward, impl="pallas"): the halo's permutes (K/V forward, their gradients back)
  are asynchronous with kernels under them in XLA's schedule, the shard's own keys are attended
  by the Pallas kernels (a Triton call each way), and no all-gather appears."""
  mesh = Mesh(np.array(deviceless.gpu_devices("h100-80g", 4)), (CP,))
  sharded = P(None, CP)
  # check_vma=False: the Pallas call's outputs carry no varying-axes type on jax 0.10.
  attention = jax.shard_map(lambda q, k, v: halo_attention(q, k, v, 1025, impl="pallas"), mesh=mesh,
                            in_specs=(sharded,) * 3, out_specs=sharded, check_vma=False)
  shapes = [jax.ShapeDtypeStruct((1, 16384, 8, 128), jnp.bfloat16, sharding=NamedSharding(mesh, sharded))] * 3
  with lowering_for("cuda"):
    lowered = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v).astype(jnp.float32)),
                               argnums=(0, 1, 2))).lower(*shapes)
  text = deviceless.compile_lowered(lowered)[0].as_text()
  permutes = [c for c in async_collectives(text, mesh) if c.kind == "collective-permute"]
  assert len(permutes) == 2 and all(c.overlapped and c.axis == CP for c in permutes), permutes
  assert text.count(TRITON_CALL) >= 3, "the own keys' forward, dq and dk/dv kernels"
  assert "all-gather" not in text


def test_context_parallel_ring_sends_run_under_the_blocks():
  """A global layer's ring attention over cp = 4 described H100s (bf16, s = 8,192, GQA 8 over 2
  KV heads, forward and backward): every collective-permute is over cp and asynchronous, and
  all but at most the first hop's two (K and V, which XLA's scheduler sends before any block:
  measured, 8 of 10 overlapped at this size, 8 of 9 at s = 16,384) have kernels under them."""
  mesh = Mesh(np.array(deviceless.gpu_devices("h100-80g", 4)), (CP,))
  sharded = P(None, CP)
  attention = jax.shard_map(lambda q, k, v: ring_attention(q, k, v), mesh=mesh, in_specs=(sharded,) * 3,
                            out_specs=sharded)
  shapes = [jax.ShapeDtypeStruct((1, 8192, heads, 128), jnp.bfloat16, sharding=NamedSharding(mesh, sharded))
            for heads in (8, 2, 2)]
  lowered = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v).astype(jnp.float32)),
                             argnums=(0, 1, 2))).lower(*shapes)
  text = deviceless.compile_lowered(lowered)[0].as_text()
  permutes = [c for c in async_collectives(text, mesh) if c.kind == "collective-permute"]
  assert permutes and all(c.axis == CP for c in permutes), permutes
  assert sum(not c.overlapped for c in permutes) <= 2, permutes
  assert "all-gather" not in text
