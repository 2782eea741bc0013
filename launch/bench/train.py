"""`python -m megajax.launch.bench train [--size=1.3b|3b|tiny] [--seq=2048]`: the MFU suite.

One device (the whole step, no parallelism), bf16, one row per switch of a Table-3 style
ablation, each measured in the same run (median of --repeats steps after a warm-up):
  baseline        serial block, full attention by cuDNN (XLA on CPU), AdamW, batch B
  + PTB           parallel transformer block
  + SWA           sliding-window attention (window --window)
  + Pallas        our Pallas sliding-window attention kernels (forward and backward)
  + LAMB 4x       LAMB at batch 4B, as 4 accumulated microbatches of B
Printed per row: step time, tokens/s, model TFLOP/s per device (megajax.flops: the count
the trainer's MFU uses), MFU against the device's bf16 dense peak (n/a where unknown, e.g.
CPU), and tokens/s over the baseline's. `--size=tiny` is a CPU-sized model that checks the
suite end to end (the tests run it); the 1.3B and 3B rows are for a GPU.
"""

from __future__ import annotations

import jax
import numpy as np

from megajax.config import default_config, validate
from megajax.flops import mfu, training_flops_per_token
from megajax.launch.bench.timing import median_seconds
from megajax.trainer import build_parallel_step

SIZES = {   # layers, hidden, heads (head dim 128 for the GPU sizes), batch B per step
    "tiny": dict(num_layers=2, hidden_dim=64, num_heads=4, vocab_size=256, batch=4),
    "1.3b": dict(num_layers=24, hidden_dim=2048, num_heads=16, vocab_size=64000, batch=8),
    "3b": dict(num_layers=32, hidden_dim=2560, num_heads=20, vocab_size=64000, batch=4),
}
ROWS = ("baseline", "+ PTB", "+ SWA", "+ Pallas", "+ LAMB 4x")


def row_config(size: str, seq: int, window: int, row: int, on_gpu: bool):
  """The config of ablation row `row` (0: baseline; each later row adds one switch)."""
  shape = SIZES[size]
  c = default_config()
  c.model.num_layers, c.model.hidden_dim = shape["num_layers"], shape["hidden_dim"]
  c.model.num_heads, c.model.vocab_size, c.model.seq_len = shape["num_heads"], shape["vocab_size"], seq
  c.model.compute_dtype = "bfloat16"
  c.model.remat = "dots" if size != "tiny" else "none"
  c.model.block = "parallel" if row >= 1 else "serial"
  c.model.window = window if row >= 2 else 0
  # On CPU the Pallas kernels only run interpreted, outside the step: the CPU rows use XLA's.
  c.model.attention_impl = ("pallas" if row >= 3 else "cudnn") if on_gpu else "xla"
  c.optimizer.name = "lamb" if row >= 4 else "adamw"
  c.train.batch_size = shape["batch"] * (4 if row >= 4 else 1)
  c.train.microbatches = 4 if row >= 4 else 1
  c.optimizer.warmup_steps = 1
  c.train.steps = 10
  validate(c)
  return c


class CompiledStep:
  """The config's compiled train step on `devices`, a synthetic batch of random tokens, and
  the state it threads from call to call: `run()` is one step, waited for."""

  def __init__(self, config, devices):
    self.parallel_step = build_parallel_step(config, devices)
    self.mesh = self.parallel_step.mesh
    shape = (config.train.batch_size, config.model.seq_len)
    tokens = np.random.default_rng(0).integers(0, config.model.vocab_size, shape, dtype=np.int32)
    self.batch = self.parallel_step.put_batch({"inputs": tokens, "targets": tokens, "loss_mask": np.ones(shape, np.float32)})
    self.state = self.parallel_step.init_state(jax.random.key(0))
    self.compiled = self.parallel_step.train_step().lower(self.state, self.batch).compile()
    self.tokens_per_step = shape[0] * shape[1]

  def run(self) -> dict:
    self.state, metrics = self.compiled(self.state, self.batch)
    return jax.block_until_ready(metrics)


def measure(config, repeats: int) -> dict:
  """Median step time of the compiled step on one device, and what it makes."""
  device = jax.devices()[0]
  step = CompiledStep(config, [device])
  seconds = median_seconds(step.run, repeats=repeats)      # after one untimed step
  tokens_per_sec = step.tokens_per_step / seconds
  tflops = tokens_per_sec * training_flops_per_token(step.parallel_step.model.config) / 1e12
  return {"step_s": seconds, "tokens_per_sec": tokens_per_sec, "tflops": tflops,
          "mfu": mfu(tflops, device.device_kind), "loss": float(step.run()["loss"])}


def train_suite(size: str, seq: int, window: int, repeats: int) -> list[dict]:
  on_gpu = jax.devices()[0].platform == "gpu"
  results = []
  for row, name in enumerate(ROWS):
    results.append({"row": name, **measure(row_config(size, seq, window, row, on_gpu), repeats)})
  return results


def train(size: str, seq: int, window: int, repeats: int) -> None:
  device = jax.devices()[0]
  window = window or seq // 4
  print(f"MFU suite: {size} model, sequence {seq}, bf16, one {device.device_kind} ({device.platform}); "
        f"SWA window {window}; median of {repeats} steps")
  results = train_suite(size, seq, window, repeats)
  base = results[0]
  print(f"{'row':14}{'batch':>7}{'step ms':>10}{'tokens/s':>12}{'TFLOP/s':>10}{'MFU':>8}{'x baseline':>12}")
  for row, r in enumerate(results):
    batch = SIZES[size]["batch"] * (4 if row >= 4 else 1)
    mfu_text = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
    print(f"{r['row']:14}{batch:>7}{r['step_s'] * 1e3:>10.1f}{r['tokens_per_sec']:>12.0f}{r['tflops']:>10.3f}"
          f"{mfu_text:>8}{r['tokens_per_sec'] / base['tokens_per_sec']:>12.3f}")
  if device.platform != "gpu":
    print("not a GPU: + Pallas ran XLA's attention (the Pallas kernels run only interpreted on CPU) and the "
          "baseline XLA's, not cuDNN's")
  if results[0]["mfu"] is None:
    print("MFU n/a: no bf16 peak known for this device (GPU figures come only from a GPU run)")
