"""The planner with context parallelism (parallel.cp): the search proposes it for long rows,
the memory model holds a device's share of the rows and the ring's and halo's buffers, the
step time its sends and the gradients' sum over cp."""

import dataclasses

import pytest

from megajax.config import default_config
from megajax.model import ModelConfig
from megajax.parallel.planner import cost_model, explain, hardware, memory, plans
from megajax.parallel.planner.cost_model import MEGASCALE, Plan

H100 = hardware.HARDWARE["h100-80g"]


def seven_b(seq_len: int, pattern: str = "L", window: int = 4096, attention: str = "pallas") -> ModelConfig:
  """A Mistral-7B-class model: 32 layers of 4096, 32 heads over 8 KV heads, SwiGLU of 14336."""
  c = default_config()
  m = c.model
  m.vocab_size, m.seq_len, m.num_layers, m.hidden_dim, m.num_heads, m.num_kv_heads = 32000, seq_len, 32, 4096, 32, 8
  m.mlp_dim, m.mlp, m.norm, m.block, m.use_bias = 14336, "swiglu", "rmsnorm", "serial", False
  m.window, m.window_pattern, m.remat, m.attention_impl = window, pattern, "full", attention
  return ModelConfig.from_config(m)


def test_the_search_splits_long_rows_over_cp():
  """131,072-position rows on 64 H100s: a plan that splits them (cp > 1) is the best or ties it
  (explain.TIE_FRACTION) for local and local-global models alike (tp 8 without cp, its rows split
  by sequence parallelism, is the other way); each cp plan obeys the layout (rows in 2 cp chunks over tp, the
  window one chunk back at most: one shard with no global layer). At 2,048 positions a plan
  splits rows into MIN_CONTEXT_SHARD positions a device at the finest, and a window of 1,024
  with a global layer (chunks of 512 at cp = 2) keeps cp = 1."""
  for pattern, chunks in (("L", 1), ("LLLG", 2)):     # a global layer: the dual-chunk layout
    c = seven_b(131072, pattern)
    best, even = plans.search(c, 64, 8, H100)
    split = next(x for x in best if x.plan.cp > 1)
    assert split.time.total <= (1 + explain.TIE_FRACTION) * best[0].time.total, plans.describe(best[0].plan)
    for x in best:
      p = x.plan
      assert p.gpus == 64 and c.seq_len % (2 * p.cp * p.tp) == 0 and c.window <= c.seq_len // (chunks * p.cp) + 1
    assert "--config.parallel.cp=" in plans.config_overrides(split.plan)
  short = plans.search(seven_b(2048, "L", 1024), 64, 64, H100)[0]
  assert short and {x.plan.cp for x in short} <= {1, 2}     # rows of 1,024 positions a device at least
  assert all(x.plan.cp == 1 for x in plans.search(seven_b(2048, "LG", 1024), 64, 64, H100)[0])   # chunks of 512


def test_a_devices_activations_shrink_with_cp():
  """XLA's attention (unfused) at 16,384 positions: the activations at cp = 4 are under 0.3 of
  cp = 1's (a quarter of the rows, a sixteenth of each score block), the state unchanged."""
  c = dataclasses.replace(seven_b(16384, "LG", 1025, "xla"), num_layers=4)
  one, four = (memory.memory(c, Plan(1, 1, 1, 1, 1, 1, MEGASCALE, cp=cp), "none", fused_attention=False)
               for cp in (1, 4))
  assert four.activations < 0.3 * one.activations and four.state == one.state


def test_cp_costs_the_gradient_sum_and_counts_the_whole_rows_flops():
  """cp > 1 adds the gradient shards' all-reduce over cp (with dp = 1 the only dp-side cost) and
  its sends (cp_comm: exposed ring steps, halos under the own keys' attention); cp = 1 neither.
  The model FLOPs are the whole rows' whatever cp is: MFU x step time x GPUs is the same."""
  c = seven_b(131072, "LLLG")
  one = cost_model.step_time(c, Plan(1, 1, 8, 1, 1, 8, MEGASCALE), H100)
  eight = cost_model.step_time(c, Plan(1, 1, 8, 1, 1, 8, MEGASCALE, cp=8), H100)
  assert one.cp_comm == 0 == one.dp_comm and eight.cp_comm >= 0
  counts = cost_model.param_counts(cost_model.apply_switches(c, MEGASCALE), Plan(1, 1, 8, 1, 1, 8, MEGASCALE, cp=8))
  busbw = hardware.link_busbw(64, H100)     # tp x cp spans 8 nodes: the NICs
  assert eight.dp_comm == hardware.collective_seconds(counts.shard * 4, 8, busbw, "all_reduce")
  assert eight.mfu * eight.total * 64 == pytest.approx(one.mfu * one.total * 8, rel=1e-9)
  assert eight.total < one.total       # a device's share of the rows: an eighth of the matmuls
