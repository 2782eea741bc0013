"""The 3D-parallel step against the single-device reference, on 8 CPU devices (pp = 1).

Every (mesh, block, tp_overlap, accumulation) the step claims: the loss and every gradient
within 1e-5 relative of megajax.reference_step's single-device step, and the params after 3
LAMB steps within 1e-5 (with the default parallel.grad_sync="step"); both gradient syncs
over dp with 4 microbatches; then the model variants (recomputation, tied head, bf16).
"""

import pytest

from megajax.config import GRAD_SYNC_CHOICES, TP_OVERLAP_CHOICES
from tests.support.reference import assert_matches_reference, parallel_config

MESHES = [(8, 1, 1), (1, 1, 8), (2, 1, 4), (4, 1, 2)]
MODES = list(TP_OVERLAP_CHOICES)   # every tp_overlap mode the config accepts


@pytest.mark.parametrize("microbatches", [1, 2], ids=["no_accum", "accum2"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("block", ["parallel", "serial"])
@pytest.mark.parametrize("mesh", MESHES, ids=["x".join(map(str, m)) for m in MESHES])
def test_matches_the_single_device_reference(mesh, block, mode, microbatches):
  dp, _, tp = mesh
  assert_matches_reference(parallel_config(dp, tp, block, mode, microbatches))


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


@pytest.mark.parametrize("mesh,block", [((2, 1, 4), "parallel"), ((4, 1, 2), "serial")], ids=["2x1x4", "4x1x2"])
def test_packed_documents_match_the_reference(mesh, block):
  """Packed rows (segment_ids, positions) through the sharded forward: attention sees the
  full sequence's segment ids on every tp rank; equal to the reference on the same rows."""
  dp, _, tp = mesh
  assert_matches_reference(parallel_config(dp, tp, block, "collective_matmul", 2), packed=True)
