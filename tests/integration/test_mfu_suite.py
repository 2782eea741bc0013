"""The MFU suite's harness (python -m megajax.launch.bench train) on CPU."""

import numpy as np

from megajax.launch.bench.train import ROWS, measure, row_config, train_suite


def test_mfu_suite_rows_add_one_switch_each_and_run_on_cpu():
  """The MFU suite's harness (megajax.launch.bench.train): each ablation row changes what its
  name says and nothing else, and the rows compile and run on CPU (MFU n/a there)."""
  fields = ("model.block", "model.window", "model.attention_impl", "optimizer.name", "train.batch_size",
            "train.microbatches")

  def values(row, on_gpu=True):
    c = row_config("tiny", 32, 8, row, on_gpu)
    return {f: c[f.split(".")[0]][f.split(".")[1]] for f in fields}

  changed = [{f for f in fields if values(r)[f] != values(r - 1)[f]} for r in range(1, len(ROWS))]
  assert changed == [{"model.block"}, {"model.window"}, {"model.attention_impl"},
                     {"optimizer.name", "train.batch_size", "train.microbatches"}]
  assert values(0)["model.attention_impl"] == "cudnn" and values(3)["model.attention_impl"] == "pallas"
  assert values(4)["train.batch_size"] == 4 * values(0)["train.batch_size"]
  for row in (0, len(ROWS) - 1):
    result = measure(row_config("tiny", 32, 8, row, on_gpu=False), repeats=1)
    assert result["tokens_per_sec"] > 0 and result["mfu"] is None and np.isfinite(result["loss"])


def test_the_rows_compiled_side_by_side_then_run_one_by_one():
  """bench gpu's train part: every row's step compiled at once, a thread each, then timed."""
  rows = train_suite("tiny", 32, 8, repeats=1, compile_together=True)
  assert [r["row"] for r in rows] == list(ROWS)
  assert all(r["tokens_per_sec"] > 0 and np.isfinite(r["loss"]) for r in rows), rows
