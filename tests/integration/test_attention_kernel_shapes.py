"""The Pallas sliding-window attention kernels (interpret mode on CPU) against xla_attention.

Forward output and dq, dk, dv: fp32 within 1e-5, bf16 within 2e-2 (of the largest entry),
over sequence lengths that are and are not block multiples, windows smaller than a block,
larger than the sequence and None, grouped KV heads, head dims 64, 128 and 256, plus a small
hypothesis sweep (the portable kernels with packed documents: tests/unit/test_document_masking.py).
Then the Hopper (Mosaic GPU) forward in Pallas's GPU interpreter, which simulates the
warpgroups, shared memory, TMA copies and mbarriers (it fails on a barrier phase a warpgroup
never observed), so those tests check the kernel's synchronization as well as its values,
with and without packed documents; its backward is the portable kernels', reading the Hopper
forward's logsumexp. Then the opt-in Hopper backward (dq, dk/dv) the same way, and both
Hopper kernels under the interpreter's race detector.
"""

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from megajax.layers import xla_attention
from megajax.layers.kernels import attention_hopper as hopper
from megajax.layers.kernels import attention_hopper_backward as hopper_backward
from megajax.layers.kernels.attention import _forward
from megajax.layers.kernels.band import document_bounds
from tests.support.kernels import assert_close, check, compile_interpreter_threads_once, inputs


@pytest.mark.parametrize("s", [64, 50], ids=["block_multiple", "padded"])
@pytest.mark.parametrize("window", [5, 24, None, 100], ids=["w<block", "w=24", "causal", "w>s"])
def test_matches_xla_fp32(s, window):
  check(2, s, 4, 2, 64, window, jnp.float32)


@pytest.mark.parametrize("heads,kv_heads,d", [(2, 2, 128), (4, 1, 64), (2, 1, 256)], ids=["mha_d128", "gqa4_d64", "gqa2_d256"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_heads_and_dtypes(heads, kv_heads, d, dtype):
  check(1, 40, heads, kv_heads, d, 16, dtype)


@hypothesis.settings(max_examples=8, deadline=None, derandomize=True)
@hypothesis.given(s=st.integers(1, 70), window=st.one_of(st.none(), st.integers(1, 80)),
                  groups=st.sampled_from([(1, 1), (2, 1), (4, 2)]), block=st.sampled_from([8, 16]))
def test_shape_sweep(s, window, groups, block):
  check(1, s, *groups, 64, window, jnp.float32, block=block, seed=s)


# --- The Hopper forward.

@pytest.mark.parametrize("s,heads,kv_heads,d,window", [
    (256, 2, 1, 64, None),     # causal, two programs, grouped KV heads
    (200, 1, 1, 128, 16),      # padded to 256, window smaller than a block
    (384, 2, 2, 64, 100),      # window across block edges: skipped, masked and full blocks
])
def test_hopper_forward_and_gradients_match_xla(s, heads, kv_heads, d, window):
  check(1, s, heads, kv_heads, d, window, jnp.bfloat16, block=64, backend="mosaic")


@pytest.mark.parametrize("lengths,heads,kv_heads,window", [
    ([70, 60, 1, 69, 56], 2, 1, None),   # documents across the warpgroups' and programs' edges
    ([130, 2, 124], 2, 2, 100),          # window across a boundary, a two-token document
    ([64, 64, 72], 1, 1, 16),            # boundaries at the warpgroups' edges, padded to 256
])
def test_hopper_forward_with_documents_matches_xla(lengths, heads, kv_heads, window):
  """Packed documents: the raised band starts (warpgroups skipping what only the sibling
  needs) and the per-row document-start mask, forward and (portable) gradients."""
  segment_ids = jnp.asarray(np.repeat(np.arange(1, len(lengths) + 1), lengths), jnp.int32)[None]
  check(1, sum(lengths), heads, kv_heads, 64, window, jnp.bfloat16, block=64, segment_ids=segment_ids,
        backend="mosaic")


def test_hopper_logsumexp_is_the_portable_kernels():
  """The backward reads the forward's logsumexp: both back ends must write the same one."""
  q, k, v, _ = inputs(1, 256, 2, 1, 64, jnp.bfloat16)
  _, lse_hopper = hopper.hopper_attention_forward(q, k, v, 80, interpret=True)
  _, lse_portable = _forward(q, k, v, None, 80, 64, 64, True, "triton")
  assert_close(lse_hopper, lse_portable, 1e-2)


# --- The Hopper backward (opt-in: backward="mosaic").

@pytest.mark.parametrize("s,heads,kv_heads,d,window", [
    (200, 2, 1, 64, 16),       # padded to 256, window below a block, GQA
    (256, 2, 2, 128, 64),      # window equal to a block
    (192, 4, 2, 256, None),    # causal, one-slot ring (head dim 256), GQA
])
def test_hopper_backward_matches_xla(s, heads, kv_heads, d, window):
  """dq, dk, dv from the Mosaic GPU backward kernels in the GPU interpreter, behind the
  portable forward (whose logsumexp it reads, as the Hopper forward's)."""
  check(1, s, heads, kv_heads, d, window, jnp.bfloat16, block=64, backward="mosaic")


@pytest.mark.parametrize("lengths,window", [(None, 100), ([70, 60, 1, 69, 56], None)], ids=["window", "documents"])
def test_hopper_forward_with_the_schedule_barrier(lengths, window):
  """ForwardOptions(schedule_barrier=True): the compute warpgroups take turns through one more
  barrier (skipped blocks take their turns too), under the race detector; the same output."""
  from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races
  s = 384 if lengths is None else 256
  q, k, v, _ = inputs(1, s, 2, 1, 64, jnp.bfloat16)
  segment_ids, doc_start = None, None
  if lengths is not None:
    segment_ids = jnp.asarray(np.repeat(np.arange(1, len(lengths) + 2), lengths + [s - sum(lengths)]), jnp.int32)[None]
    doc_start = document_bounds(segment_ids)[0]
  out, _ = hopper.hopper_attention_forward(q, k, v, window, doc_start, interpret=True, detect_races=True,
                                           options=hopper.ForwardOptions(schedule_barrier=True))
  assert not get_races().races_found
  assert_close(out, xla_attention(q, k, v, window, segment_ids), 2e-2)


def test_hopper_kernels_have_no_races():
  """The Hopper forward and backward under the interpreter's race detector (TMA copies,
  wgmma reads and register-to-shared stores checked against the barriers' ordering): a
  window across block edges, GQA, two programs per head."""
  from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races
  q, k, v, cotangent = inputs(1, 256, 2, 1, 64, jnp.bfloat16)
  out, lse = hopper.hopper_attention_forward(q, k, v, 100, interpret=True, detect_races=True)
  grads = hopper_backward.hopper_attention_backward(q, k, v, out, lse, cotangent.astype(jnp.bfloat16), 100,
                                                    interpret=True, detect_races=True)
  jax.block_until_ready(grads)
  assert not get_races().races_found


@pytest.fixture(autouse=True)
def interpreter_threads_compiled_once(monkeypatch):
  compile_interpreter_threads_once(monkeypatch)


@pytest.fixture(autouse=True)
def fresh_gpu_interpreter():
  """The GPU interpreter keeps per-process state that a failed kernel leaves dirty (its docs:
  reset after an exception); reset after each test so one failure cannot hang the next."""
  yield
  from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import reset_gpu_interpret_mode_state
  reset_gpu_interpret_mode_state()
