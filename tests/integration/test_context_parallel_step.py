"""The step with context parallelism (parallel.cp > 1) against the single-device reference.

Every cp mesh the issue names (at most 8 CPU devices: cp 2 and 4 alone, cp2 x dp2 x tp2,
cp2 x pp2 x tp2, cp4 x tp2), for the window patterns L (halo exchange only), G (ring
attention only) and LG (one dual-chunk layout for both), with and without packed documents:
the loss and every gradient within 1e-5 relative of megajax.reference_step's single-device
step, and the params after 3 LAMB steps too (tests/support/reference.py). The window is 3
(the 16-position rows cut into 2 * cp chunks of 2 at cp = 4: the halo reaches a whole chunk
back, the most the layout allows). Then the bytes, from the compiled step: a local layer's do
not grow with s.
"""

import pytest

from megajax.launch.bench.cp import step_permute_bytes
from tests.support.reference import assert_matches_reference, parallel_config, pipeline_config


def cp_config(dp=1, pp=1, cp=2, tp=1, pattern="LG", packed=False, microbatches=1):
  """pp > 1: 1F1B over `microbatches`, the stage's backward from kept residuals at m = 2, its
  forward rerun at m = 1 (parallel.pipeline_recompute, the CPU default)."""
  if pp > 1:
    config = pipeline_config((dp, pp, tp), "1f1b", microbatches=2 * microbatches, layers=2 * pp, mode="none", rows=16)
    config.parallel.pipeline_recompute = microbatches == 1
  else:
    config = parallel_config(dp, tp, "parallel", "none", microbatches)
  config.parallel.cp = cp
  config.model.window, config.model.window_pattern = 3, pattern
  if packed:
    config.data.source, config.data.document_masking = "tokens", True
  return config


# (dp, pp, cp, tp), window pattern, packed, microbatches: each mesh takes patterns and packing
# so that every pattern runs packed and unpacked, and every mesh at least two patterns. In a
# pipeline the exchanges are all-gathers (no ppermute inside a stage's branch): both the
# stage's backwards (residuals kept, forward rerun) run them.
CASES = [
    ((1, 1, 2, 1), "L", False, 1), ((1, 1, 2, 1), "G", True, 2), ((1, 1, 2, 1), "LG", False, 1),
    ((1, 1, 4, 1), "LG", True, 1), ((1, 1, 4, 1), "G", False, 1), ((1, 1, 4, 1), "L", True, 2),
    ((2, 1, 2, 2), "LG", False, 2), ((2, 1, 2, 2), "L", True, 1),
    ((1, 2, 2, 2), "LG", False, 1), ((1, 2, 2, 2), "G", True, 2), ((1, 2, 2, 2), "L", True, 1),
    ((1, 1, 4, 2), "LG", True, 1), ((1, 1, 4, 2), "G", False, 1),
]


@pytest.mark.parametrize("mesh,pattern,packed,microbatches", CASES,
                         ids=[f"{'x'.join(map(str, m))}-{p}{'-packed' if k else ''}-m{mb}" for m, p, k, mb in CASES])
def test_context_parallel_matches_the_reference(mesh, pattern, packed, microbatches):
  dp, pp, cp, tp = mesh
  assert_matches_reference(cp_config(dp, pp, cp, tp, pattern, packed, microbatches), packed=packed)


def test_a_local_layers_permute_bytes_do_not_grow_with_the_sequence():
  """The compiled training step of a local-only model at cp = 4: per layer, the collective-
  permute bytes at s = 2,048 and 8,192 are the same and are the halos' (two chunks' w-1 keys
  and values, forward and back); no all-gather of anything (dp = tp = 1)."""
  short, long = step_permute_bytes(2048, "L"), step_permute_bytes(8192, "L")
  assert short == long, (short, long)
  permuted, expected, gathers = long
  assert permuted == expected and gathers == 0, long


def test_a_global_layers_ring_moves_its_share_of_the_rows_keys_and_values():
  """A global-only model at cp = 4: (cp-1)/cp of the row's K and V each way per layer, no all-gather."""
  permuted, expected, gathers = step_permute_bytes(2048, "G")
  assert permuted == expected and gathers == 0, (permuted, expected, gathers)
