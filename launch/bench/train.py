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
CPU), and tokens/s over the baseline's. Remat is `dots`, or `full` for a row whose memory
estimate (parallel.planner.fits) is over the GPU's bytes_limit; a row that runs out of
memory anyway is printed as skipped. `--size=tiny` is a CPU-sized model that checks the
suite end to end (the tests run it); the 1.3B and 3B rows are for a GPU.
"""

from __future__ import annotations

import concurrent.futures
import time

import jax
import numpy as np

from megajax.config import default_config, validate
from megajax.flops import mfu, training_flops_per_token
from megajax.launch.bench.timing import is_out_of_memory, median_seconds
from megajax.parallel import deviceless
from megajax.parallel.planner.fits import device_memory, estimate
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


def fitted(config):
  """The config fitted to the GPU's bytes_limit (fit_to)."""
  have, _ = device_memory(jax.devices()[:1])
  return fit_to(config, have) if jax.devices()[0].platform == "gpu" and have else config


def fit_to(config, limit: float):
  """The config with remat full where dots' saved matmul outputs would not fit `limit` bytes
  (the memory estimate of parallel.planner.fits), and then, while it still would not, twice
  the microbatches (the same batch in smaller pieces: the 3B LAMB 4x row at s = 8192)."""
  if estimate(config, "gpu").total > limit:
    config.model.remat = "full"
  t = config.train
  while estimate(config, "gpu").total > limit and t.batch_size % (2 * t.microbatches) == 0:
    t.microbatches *= 2
  return config


def compile_step(config, devices):
  """(the config's ParallelStep on `devices`, its train step compiled from abstract inputs):
  nothing is allocated, so several rows compile side by side (compile_together)."""
  parallel_step = build_parallel_step(config, devices)
  return parallel_step, parallel_step.train_step().lower(*parallel_step.abstract_inputs()).compile()


class CompiledStep:
  """The config's compiled train step on `devices`, a synthetic batch of random tokens, and
  the state it threads from call to call: `run()` is one step, waited for. `compiled`: what
  compile_step returned for the same config and devices, else it compiles here."""

  def __init__(self, config, devices, compiled=None):
    self.parallel_step, self.compiled = compiled or compile_step(config, devices)
    self.mesh = self.parallel_step.mesh
    shape = (config.train.batch_size, config.model.seq_len)
    tokens = np.random.default_rng(0).integers(0, config.model.vocab_size, shape, dtype=np.int32)
    self.batch = self.parallel_step.put_batch({"inputs": tokens, "targets": tokens, "loss_mask": np.ones(shape, np.float32)})
    self.state = self.parallel_step.init_state(jax.random.key(0))
    self.tokens_per_step = shape[0] * shape[1]

  def run(self) -> dict:
    self.state, metrics = self.compiled(self.state, self.batch)
    return jax.block_until_ready(metrics)


def measure(config, repeats: int, compiled=None) -> dict:
  """Median step time of the compiled step on one device, and what it makes."""
  device = jax.devices()[0]
  step = CompiledStep(config, [device], compiled)
  seconds = median_seconds(step.run, repeats=repeats)      # after one untimed step
  tokens_per_sec = step.tokens_per_step / seconds
  tflops = tokens_per_sec * training_flops_per_token(step.parallel_step.model.config) / 1e12
  return {"step_s": seconds, "tokens_per_sec": tokens_per_sec, "tflops": tflops,
          "mfu": mfu(tflops, device.device_kind), "loss": float(step.run()["loss"])}


def _compile_rows(configs: list, devices) -> list:
  """Every row's step compiled at once, a thread each (XLA compiles outside the GIL: a GPU
  host's cores take the rows side by side; the first lease compiled 1.3B rows one after
  another, ~100 s each); a row that fails to compile gets its exception in its place."""
  def one(config):
    try:
      return compile_step(config, devices)
    except Exception as e:      # raised again, or recorded, when its row is measured
      return e
  with concurrent.futures.ThreadPoolExecutor(len(configs)) as pool:
    return list(pool.map(one, configs))


def train_suite(size: str, seq: int, window: int, repeats: int, compile_together: bool = False) -> list[dict]:
  """Every row measured; a row the device cannot hold is recorded with XLA's error, not fatal.
  `compile_together`: the rows' steps compiled side by side first, then timed one by one."""
  on_gpu = jax.devices()[0].platform == "gpu"
  configs = [fitted(row_config(size, seq, window, row, on_gpu)) for row in range(len(ROWS))]
  started = time.perf_counter()
  compiled = _compile_rows(configs, jax.devices()[:1]) if compile_together else [None] * len(ROWS)
  if compile_together:
    print(f"  {len(ROWS)} rows compiled side by side in {time.perf_counter() - started:.1f} s", flush=True)
  results = []
  for name, config, step in zip(ROWS, configs, compiled):
    try:
      if isinstance(step, Exception):
        raise step
      results.append({"row": name, "batch": config.train.batch_size, "remat": config.model.remat,
                      **measure(config, repeats, step)})
    except Exception as e:
      if not is_out_of_memory(e):
        raise
      results.append({"row": name, "batch": config.train.batch_size, "error": str(e).splitlines()[0][:300]})
    done = results[-1]     # each row as it ends: a run cut short still shows what it measured
    print(f"  {name}: " + (f"skipped ({done['error'][:80]})" if "error" in done else
                           f"{done['step_s'] * 1e3:.1f} ms/step, {done['tflops']:.1f} TFLOP/s, remat {done['remat']}"),
          flush=True)
  return results


# What `bench gpu` runs the suite with (WORKSPACE.md, "On a GPU machine without network"): the
# 3B rows need more than XLA's default 75% of the device.
GPU_MEMORY_FRACTION = 0.92


def fit_on_gpu(size: str, seq: int, window: int, target: str) -> list[dict]:
  """Each row of the suite compiled for one described GPU of `target` on this machine
  (megajax.parallel.deviceless): the remat the GPU run would pick (`fitted`'s rule, at
  GPU_MEMORY_FRACTION of the device), XLA's bytes beside the planner's, and whether they fit."""
  gpu = deviceless.GPU_TARGETS[target]
  limit = GPU_MEMORY_FRACTION * gpu.memory_bytes
  window = window or seq // 4
  print(f"MFU suite compiled for one {gpu.device_kind} without a GPU: {size} model, sequence {seq}, SWA window "
        f"{window}; fits: XLA's bytes within {GPU_MEMORY_FRACTION:.0%} of {gpu.memory_bytes / 2**30:.1f} GiB", flush=True)
  print(f"{'row':14}{'batch':>7}{'micro':>6}{'remat':>7}{'XLA GiB':>10}{'planner GiB':>13}{'fits':>6}{'compile s':>11}")
  results = []
  for row, name in enumerate(ROWS):
    config = fit_to(row_config(size, seq, window, row, on_gpu=True), limit)
    compiled = deviceless.compile_for_gpu(config, target)
    xla, planner = compiled.bytes_per_device(), estimate(config, "gpu").total
    results.append({"row": name, "batch": config.train.batch_size, "microbatches": config.train.microbatches,
                    "remat": config.model.remat, "xla_bytes": xla,
                    "planner_bytes": planner, "fits": xla <= limit, "compile_s": compiled.compile_seconds})
    print(f"{name:14}{config.train.batch_size:>7}{config.train.microbatches:>6}{config.model.remat:>7}"
          f"{xla / 2**30:>10.2f}{planner / 2**30:>13.2f}"
          f"{'yes' if xla <= limit else 'NO':>6}{compiled.compile_seconds:>11.1f}", flush=True)
  return results


def train(size: str, seq: int, window: int, repeats: int, compile_together: bool = False) -> list[dict]:
  device = jax.devices()[0]
  window = window or seq // 4
  print(f"MFU suite: {size} model, sequence {seq}, bf16, one {device.device_kind} ({device.platform}); "
        f"SWA window {window}; median of {repeats} steps", flush=True)
  results = train_suite(size, seq, window, repeats, compile_together)
  measured = [r for r in results if "error" not in r]
  base = results[0] if "error" not in results[0] else None
  print(f"{'row':14}{'batch':>7}{'remat':>7}{'step ms':>10}{'tokens/s':>12}{'TFLOP/s':>10}{'MFU':>8}{'x baseline':>12}")
  for r in results:
    if "error" in r:
      print(f"{r['row']:14}{r['batch']:>7}  skipped: {r['error'][:150]}")
      continue
    mfu_text = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
    gain = f"{r['tokens_per_sec'] / base['tokens_per_sec']:.3f}" if base else "-"
    print(f"{r['row']:14}{r['batch']:>7}{r['remat']:>7}{r['step_s'] * 1e3:>10.1f}{r['tokens_per_sec']:>12.0f}{r['tflops']:>10.3f}"
          f"{mfu_text:>8}{gain:>12}")
  if device.platform != "gpu":
    print("not a GPU: + Pallas ran XLA's attention (the Pallas kernels run only interpreted on CPU) and the "
          "baseline XLA's, not cuDNN's")
  if measured and measured[0]["mfu"] is None:
    print("MFU n/a: no bf16 peak known for this device (GPU figures come only from a GPU run)")
  return results
