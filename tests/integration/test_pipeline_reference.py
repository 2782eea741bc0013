"""The pipeline executor (megajax.parallel.pipeline) against the single-device reference.

Every (dp, pp, tp) mesh the issue names, v in {1, 2}, every schedule (GPipe v=2 on the 2-stage meshes),
every m in {p, 2p, 4p} with every schedule (a covering array: CASES):
loss, all gradients and the params after 3 LAMB steps within 1e-5 of megajax.reference_step;
the breadth-first traversal; both gradient syncs over dp (once per step, the default, and per
microbatch); every remat policy inside the pipeline's backward from kept residuals; the serial
block with recomputation and a tied embedding, from residuals and with the chunk's forward
rerun (parallel.pipeline_recompute); the block families (two norms, RMSNorm, SwiGLU). Then
memory: bounded in m for both backwards, unlike GPipe by autodiff, whose gradients are the
executor's.
"""

import jax
import pytest

from megajax.config import GRAD_SYNC_CHOICES
from tests.support.reference import (assert_matches_reference, compiled_gradients, fixed_batch, pipeline_config,
                                     relative_error)

PIPELINE_MESHES = [(1, 2, 1), (1, 4, 1), (1, 8, 1), (2, 2, 2), (1, 2, 4)]
SCHEDULE_CHUNKS = [("gpipe", 1), ("gpipe", 2), ("1f1b", 1), ("interleaved_1f1b", 2)]


# m in {p, 2p, 4p} on one mesh, {p, 2p} on another, m = 2p on the others: a mesh changes the
# collectives, m only the tables, which tests/unit/test_pipeline.py replays for m = p, 2p and 4p.
# A covering array, not the full product: every mesh runs every schedule, every schedule every m
# (4p on the 2-stage mesh, p on dp2-pp2-tp2, 2p on pp2-tp4 and the deep meshes), and each mesh
# each of its m (the last three cases).
# GPipe with two chunks per stage runs on the 2-stage meshes: its deep meshes (the slowest cases,
# 40 s each) add ticks the 1-chunk GPipe and interleaved 1F1B cases on them already run.
FACTORS = {(1, 2, 1): (4,), (2, 2, 2): (1,)}
CASES = [(mesh, schedule, v, factor) for mesh in PIPELINE_MESHES for schedule, v in SCHEDULE_CHUNKS
         for factor in FACTORS.get(mesh, (2,)) if not (schedule == "gpipe" and v == 2 and mesh[1] > 2)]
CASES += [((1, 2, 1), "1f1b", 1, 1), ((1, 2, 1), "interleaved_1f1b", 2, 2), ((2, 2, 2), "interleaved_1f1b", 2, 2)]


@pytest.mark.parametrize("mesh,schedule,virtual_stages,factor", CASES,
                         ids=[f"{'x'.join(map(str, m))}-{s}-v{v}-m={f}p" for m, s, v, f in CASES])
def test_pipeline_matches_the_single_device_reference(mesh, schedule, virtual_stages, factor):
  config = pipeline_config(mesh, schedule, virtual_stages, microbatches=factor * mesh[1])
  assert_matches_reference(config, param_leaf_rtol=3e-5)


def test_breadth_first_traversal_matches_the_reference():
  config = pipeline_config((1, 2, 1), "interleaved_1f1b", 2, microbatches=4, traversal="breadth_first")
  assert_matches_reference(config, param_leaf_rtol=3e-5)


# The default sync on dp2-pp2-tp2 is CASES' 2x2x2 interleaved m=2p case (the same config).
SYNC_CASES = [((2, 2, 2), "microbatch"), ((4, 2, 1), "step"), ((4, 2, 1), "microbatch")]
assert {grad_sync for _, grad_sync in SYNC_CASES} == set(GRAD_SYNC_CHOICES)
assert ((2, 2, 2), "interleaved_1f1b", 2, 2) in CASES and pipeline_config((2, 2, 2)).parallel.grad_sync == "step"


@pytest.mark.parametrize("mesh,grad_sync", SYNC_CASES, ids=[f"{'x'.join(map(str, m))}-{g}" for m, g in SYNC_CASES])
def test_both_gradient_syncs_through_the_pipeline(mesh, grad_sync):
  """The dp reduce-scatter after the tick scan (full local fp32 sums per stage) or after each
  backward (into the shard): the same gradients and steps, embedding and head included."""
  config = pipeline_config(mesh, "interleaved_1f1b", 2, microbatches=4)
  config.parallel.grad_sync = grad_sync
  assert_matches_reference(config, param_leaf_rtol=3e-5)


@pytest.mark.parametrize("layers", [8, 12], ids=["2-pieces", "overlapping-pieces"])
def test_dp_pieces_in_the_edge_ticks_match_the_reference(layers):
  """dp2-pp2-tp2 interleaved v=2: the second chunk's rows gathered and reduce-scattered in the
  tick scan's 2 head and 2 tail ticks, one piece each: 8 layers, 2 rows per chunk, a row
  per piece; 12 layers, 3 rows per chunk, pieces of 2 rows overlapping in one."""
  config = pipeline_config((2, 2, 2), "interleaved_1f1b", 2, microbatches=4, layers=layers)
  assert_matches_reference(config, param_leaf_rtol=3e-5)


@pytest.mark.parametrize("remat", ["dots", "full"])
def test_every_remat_policy_inside_the_pipeline(remat):
  """A chunk's backward from the residuals its forward kept: what model.remat saves (dots: the
  projections' outputs; full: the blocks' inputs, each block rerun in its backward exactly as
  without a pipeline; none, every activation, the default: CASES' 2x2x2 interleaved m=2p case)."""
  assert pipeline_config((2, 2, 2)).model.remat == "none"
  config = pipeline_config((2, 2, 2), "interleaved_1f1b", 2, microbatches=4)
  config.model.remat = remat
  assert_matches_reference(config, param_leaf_rtol=3e-5)


@pytest.mark.parametrize("recompute", [False, True], ids=["residuals", "recompute"])
def test_serial_block_remat_and_tied_embeddings_through_the_pipeline(recompute):
  """The serial block, recomputation inside the pipeline's backward (from the kept residuals,
  or with parallel.pipeline_recompute the whole chunk rerun), and a tied embedding whose
  gradient comes from the first stage (lookup) and the last (head)."""
  config = pipeline_config((2, 2, 2), "interleaved_1f1b", 2, microbatches=4)
  config.model.block, config.model.remat, config.model.tie_embeddings = "serial", "dots", True
  config.parallel.pipeline_recompute = recompute
  assert_matches_reference(config, param_leaf_rtol=3e-5)


def test_block_families_through_the_pipeline():
  """GPT-NeoX's two-norm parallel block with RMSNorm, SwiGLU (gate and up beside q, k, v in the
  fused column matmul) and a tied head on a pp2-tp2 1F1B pipeline: the block's input gathered
  chunk by chunk inside the stages' branches (no ring there), both norms after the gather."""
  config = pipeline_config((1, 2, 2), "1f1b", microbatches=4, layers=2, rows=8)
  overrides = (("block", "parallel_two_norms"), ("norm", "rmsnorm"), ("mlp", "swiglu"), ("tie_embeddings", True))
  for field, value in overrides:
    config.model[field] = value
  assert_matches_reference(config, param_leaf_rtol=3e-5)


# --- Memory.

def test_1f1b_temp_memory_is_flat_in_microbatches_while_gpipe_by_autodiff_grows():
  p = 2
  ours = [compiled_gradients((1, p, 1), m)[1].memory_analysis().temp_size_in_bytes for m in (4 * p, 16 * p)]
  base = [compiled_gradients((1, p, 1), m, True)[1].memory_analysis().temp_size_in_bytes for m in (4 * p, 16 * p)]
  assert abs(ours[1] - ours[0]) <= 0.1 * ours[0], ours
  assert base[1] > 2 * base[0], base


def test_gpipe_by_autodiff_baseline_computes_the_same_gradients():
  """The benchmark's baseline is an honest one: its gradients are the executor's."""
  m = 4
  parallel_step, ours = compiled_gradients((1, 2, 1), m)
  _, base = compiled_gradients((1, 2, 1), m, True)
  params = parallel_step.init_state(jax.random.key(0)).params
  batch = parallel_step.put_batch(fixed_batch(m))
  (g_ours, s_ours), (g_base, s_base) = ours(params, batch), base(params, batch)
  assert float(s_ours["nll_sum"]) == pytest.approx(float(s_base["nll_sum"]), rel=1e-6)
  errors = jax.tree.leaves(jax.tree.map(relative_error, g_base, g_ours))
  assert max(errors) < 1e-5


def test_packed_documents_through_the_pipeline():
  """Packed rows on a dp2-pp2-tp2 mesh: every microbatch carries its segment ids and positions
  through the executor's chunk programs.

  The reference accumulates the same 4 microbatches. Against the whole batch at once (the
  other cases' reference), on an AMD Zen 5 host (AVX-512), layer 1's out-projection bias (zero
  at init, so only its 3 updates, each near Adam's eps) ends 4.0e-5 away while its first
  gradient agrees to 3e-7; on an Intel Xeon host (AVX-512) it does so against the accumulated
  reference too (3.94e-5, the same before and after the typed config sections: the programs
  are text-identical). So each leaf is held to 6e-5 (that bias is the worst), the whole model
  and the first gradients to 1e-5."""
  config = pipeline_config((2, 2, 2), "interleaved_1f1b", 2, microbatches=4)
  assert_matches_reference(config, param_leaf_rtol=6e-5, packed=True, accumulated_reference=True)


def test_gpipe_by_autodiff_baseline_reads_packed_documents():
  m = 4
  parallel_step, ours = compiled_gradients((1, 2, 1), m, packed=True)
  _, base = compiled_gradients((1, 2, 1), m, True, packed=True)
  params = parallel_step.init_state(jax.random.key(0)).params
  batch = parallel_step.put_batch(fixed_batch(m, packed=True))
  (g_ours, s_ours), (g_base, s_base) = ours(params, batch), base(params, batch)
  assert float(s_ours["nll_sum"]) == pytest.approx(float(s_base["nll_sum"]), rel=1e-6)
  assert max(jax.tree.leaves(jax.tree.map(relative_error, g_base, g_ours))) < 1e-5
