"""megajax.observe.hlo: executed FLOPs read from the compiled text, every computation weighed
by how often one run executes it (XLA's cost_analysis counts a loop body once); the replica
groups of collectives in every form XLA writes them."""

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

from megajax.flops import training_flops_per_token
from megajax.model import ModelConfig
from megajax.observe.hlo import (computation_runs, executed_dot_flops, executed_relayout_bytes, pipeline_branch_weights,
                                 replica_groups)
from megajax.parallel.pipeline import Tables, simulate
from tests.support.reference import parallel_config, parallel_step_for, pipeline_config


def _compiled_text(fn, *args):
  return jax.jit(fn).lower(*args).compile().as_text()


def test_a_matmul_counts_two_m_n_k():
  m, k, n = 24, 40, 56
  a, b = jnp.ones((m, k)), jnp.ones((k, n))
  assert executed_dot_flops(_compiled_text(jnp.matmul, a, b)) == 2 * m * n * k


def test_a_scan_of_matmuls_counts_each_iteration():
  n, steps = 32, 10
  def chain(x, w):
    return lax.scan(lambda x, _: (jnp.tanh(x @ w), None), x, None, length=steps)[0]
  x, w = jnp.ones((n, n)), jnp.ones((n, n))
  assert executed_dot_flops(_compiled_text(chain, x, w)) == steps * 2 * n ** 3


def test_a_switch_counts_its_branches_by_the_given_weights():
  n = 32
  def step(i, x, w):
    with jax.named_scope("my slot"):
      return lax.switch(i, [lambda x, w: x, lambda x, w: x @ w, lambda x, w: (x @ w) @ w], x, w)
  text = _compiled_text(step, jnp.int32(0), jnp.ones((n, n)), jnp.ones((n, n)))
  matmul = 2 * n ** 3
  weights = {"my slot": [0.5, 0.25, 0.25]}
  assert executed_dot_flops(text, weights) == (0.25 * 1 + 0.25 * 2) * matmul
  assert executed_dot_flops(text) == 3 * matmul                       # unweighted: every branch once
  assert executed_dot_flops(text, {"other scope": [0, 0, 0]}) == 3 * matmul


def test_the_pipeline_weights_run_each_chunk_once_per_microbatch():
  """Per stage the branch weights times the ticks are the chunk programs' runs: over the stages
  m forwards (the last chunk's forward idles: its backward runs it) and m backwards per chunk."""
  p, v, m = 2, 2, 4
  c = ModelConfig.from_config(pipeline_config((1, p, 1), "interleaved_1f1b", v, microbatches=m).model)
  tables = Tables.build(simulate("interleaved_1f1b", p, v, m), c)
  weights = pipeline_branch_weights(tables)
  forward, backward = (np.array(w) * tables.ticks * p for w in weights.values())
  chunks_of = lambda program: sum(1 for g in range(p * v) if (g == 0) == program.first
                                  and (g == p * v - 1) == program.last and program.windows == (c.layer_window(g),))
  for i, program in enumerate(tables.programs):
    assert backward[i + 1] == pytest.approx(m * chunks_of(program))
    assert forward[i + 1] == pytest.approx(0 if program.last else m * chunks_of(program))
  assert sum(weights["pp forward slot"]) == pytest.approx(1) and sum(weights["pp backward slot"]) == pytest.approx(1)


def test_computation_runs_multiply_through_nested_loops():
  def nested(x):
    inner = lambda x, _: (jnp.sin(x) @ x, None)
    outer = lambda x, _: (lax.scan(inner, x, None, length=3)[0], None)
    return lax.scan(outer, x, None, length=5)[0]
  text = _compiled_text(nested, jnp.ones((8, 8)))
  assert max(computation_runs(text).values()) >= 15
  assert executed_dot_flops(text) == 15 * 2 * 8 ** 3


def test_relayout_bytes_count_what_copies_and_concatenations_write_per_run():
  """A concatenation written out counts its result (4 bytes an f32), once per loop trip; one
  fused into its consumer, or elementwise work, writes nothing of its own; a transpose
  materialized (XLA:CPU: a copy to the new layout) counts as that copy."""
  a, b = jnp.ones((64, 32)), jnp.ones((32, 32))
  assert executed_relayout_bytes(_compiled_text(lambda a, b: jnp.concatenate([a, b]), a, b)) == {"concatenate": 96 * 32 * 4}
  assert not executed_relayout_bytes(_compiled_text(lambda a: a * 2 + 1, a))
  assert not executed_relayout_bytes(_compiled_text(lambda a, b: (jnp.concatenate([a, b]) * 3).sum(), a, b))
  assert sum(executed_relayout_bytes(_compiled_text(lambda a: (a * 2).T, a)).values()) == 64 * 32 * 4
  def loop(x, w):
    body = lambda x, _: (jnp.concatenate([jnp.sin(x[:, :16]), jnp.cos(x[:, 16:])], axis=1) @ w, None)
    return lax.scan(body, x, None, length=5)[0]
  assert executed_relayout_bytes(_compiled_text(loop, a, b))["concatenate"] == 5 * 64 * 32 * 4


def test_the_single_device_step_executes_the_model_flops():
  """One device, global attention: the gradient program's executed matmul FLOPs are
  megajax.flops' model FLOPs (3x the forward's matmuls, the logits counted, the embedding a
  gather). With a window the count is higher: XLA's attention computes every key, masked."""
  config = parallel_config(microbatches=2)
  config.model.window_pattern = "G"
  parallel_step = parallel_step_for(config)
  state, batch = parallel_step.abstract_inputs()
  text = parallel_step.summed_gradients().lower(state.params, batch).compile().as_text()
  tokens = config.train.batch_size * config.model.seq_len
  model = training_flops_per_token(ModelConfig.from_config(config.model)) * tokens
  assert executed_dot_flops(text) == pytest.approx(model, rel=1e-6)


@pytest.mark.parametrize("groups_text,want", [
    ("replica_groups={{0,1},{2,3}}", {frozenset({0, 1}), frozenset({2, 3})}),
    ("replica_groups=[2,2]<=[2,2]T(1,0)", {frozenset({0, 2}), frozenset({1, 3})}),
    # XLA:GPU's mesh form (after Shardy): devices laid out [a=2, b=2], grouped along b, then a.
    ("replica_groups=mesh['a'=2,'b'=2] {'b'}", {frozenset({0, 1}), frozenset({2, 3})}),
    ("replica_groups=mesh['a'=2,'b'=2] {'a'}", {frozenset({0, 2}), frozenset({1, 3})}),
    ("replica_groups=mesh['a'=2,'b'=1,'c'=2] {'a','c'}", {frozenset({0, 1, 2, 3})}),
])
def test_replica_groups_in_every_form_xla_writes(groups_text, want):
  line = f"%all-reduce-start = f32[2]{{0}} all-reduce-start(%x), channel_id=1, {groups_text}, use_global_device_ids=true"
  assert replica_groups(line) == want
