"""`python -m megajax.launch.bench cp`: context parallelism (parallel.cp) in the training step.

1. Bytes, from the compiled training step of a tiny model (cp = 4, dp = pp = tp = 1, fp32, one
   row): the collective-permute bytes per device per layer of a local-only (L) model at
   s = 2,048 and 8,192 (the halo's, O(w)), of a global-only (G) one (the ring's: (cp-1)/cp of
   the row's K/V each way), against what the layout says they must be; all-gathers.
2. Memory, XLA's temporaries per device of that step compiled on this CPU (s = 16,384,
   w = 1,025, fp32; XLA's attention, dense within a shard) at cp = 1, 2, 4, for L, G and LG;
   and, compiled for described H100s (bf16, w = 1,025, the Pallas kernel), a local-only
   model's attention core alone (contiguous shards) at cp = 1, 2, 4 for s = 16,384 and 65,536.
3. Time per token on this CPU, the training step, local-only and global-only: s, 2s, 4s with
   cp = 1, 2, 4 (the shard's length fixed) against cp = 1 at each length. The CPU's devices
   share its cores: a row's time is the work of all of them.
4. (Not --quick) configs/long_context.py:7b compiled for 32 described H100s: bytes a device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np

from megajax.config import default_config, load_config
from megajax.launch.bench.timing import median_seconds
from megajax.layers.kernels import lowering_for
from megajax.observe.hlo import collective_counts
from megajax.parallel import deviceless
from megajax.parallel.planner import fits
from megajax.parallel.context_parallel import CP, halo_attention
from megajax.trainer import build_parallel_step

SHARDED = P(None, CP)
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64


def _loss(attention, mesh, check_vma: bool = True):
  sharded = jax.shard_map(attention, mesh=mesh, in_specs=(SHARDED,) * 3, out_specs=SHARDED, check_vma=check_vma)
  return lambda q, k, v: jnp.sum(sharded(q, k, v).astype(jnp.float32))


def _shapes(b: int, s: int, dtype, mesh=None, heads=HEADS, kv_heads=KV_HEADS, d=HEAD_DIM):
  sharding = NamedSharding(mesh, SHARDED) if mesh is not None else None
  return [jax.ShapeDtypeStruct((b, s, n, d), dtype, sharding=sharding) for n in (heads, kv_heads, kv_heads)]


def tiny_config(seq_len: int, pattern: str, cp: int, window: int = 129):
  """A tiny model (2 layers, 4 heads of 16, fp32) training one row of `seq_len` at cp."""
  c = default_config()
  c.model.num_layers, c.model.hidden_dim, c.model.num_heads, c.model.vocab_size = 2, 64, 4, 256
  c.model.seq_len, c.model.window, c.model.window_pattern = seq_len, window, pattern
  c.model.compute_dtype = "float32"
  c.train.batch_size = 1
  c.parallel.cp = cp
  return c


def step_for(config):
  return build_parallel_step(config, jax.devices()[:config.parallel.cp])


def step_permute_bytes(seq_len: int, pattern: str, cp: int = 4, window: int = 129) -> tuple[int, int, int]:
  """(collective-permute bytes per device and layer, what the layout says they must be,
  all-gathers) of the compiled training step of tiny_config."""
  config = tiny_config(seq_len, pattern, cp, window)
  step = step_for(config)
  text = step.train_step().lower(*step.abstract_inputs()).compile().as_text()
  counts = collective_counts(text, step.mesh, nbytes=True)
  layers, kv = config.model.num_layers, config.model.hidden_dim * 4    # fp32 K (or V) bytes per position
  permuted = sum(n for key, n in counts.items() if key[0] == "collective-permute") // layers
  gathers = sum(n for key, n in counts.items() if key[0] == "all-gather")
  # Forward and back: a local-only model's one halo (contiguous shards) of K and V, w-1
  # positions; a global layer's K and V of s/cp positions at each of cp-1 ring steps.
  expected = 2 * 2 * (window - 1) * kv if pattern == "L" else 2 * 2 * (cp - 1) * (seq_len // cp) * kv
  return permuted, expected, gathers


def permute_bytes(cp: int = 4, window: int = 129) -> None:
  print(f"\n== bytes per device and layer, the compiled training step (cp = {cp}, fp32, one row, tiny model: "
        f"4 heads of 16): local-only (w = {window}) and global-only models")
  print(f"{'layer':8} {'s':>6} {'permute bytes':>14} {'expected':>10} {'all-gathers':>12}")
  for pattern, name in (("L", "local"), ("G", "global")):
    for seq_len in (2048, 8192):
      permuted, expected, gathers = step_permute_bytes(seq_len, pattern, cp, window)
      print(f"{name:8} {seq_len:>6} {permuted:>14,} {expected:>10,} {gathers:>12}")


def step_memory(seq_len: int = 16384, patterns=("L", "G", "LG"), cps=(1, 2, 4), window: int = 1025) -> None:
  print(f"\n== memory per device, the training step compiled on this CPU (s = {seq_len}, w = {window}, fp32, "
        "tiny model, XLA's attention): XLA's temporaries")
  for pattern in patterns:
    base = None
    for cp in cps:
      step = step_for(tiny_config(seq_len, pattern, cp, window))
      temp = step.compiled_train_step().memory_analysis().temp_size_in_bytes
      base = base or temp
      print(f"  {pattern:2} cp = {cp}: {temp / 2**20:9.1f} MiB   ({temp / base:.3f} x cp = 1)")


def memory_on_h100(lengths=(16384, 65536), window: int = 1025, cps=(1, 2, 4)) -> None:
  print(f"\n== memory per device, compiled for described H100s (bf16, w = {window}, 8 heads of 128, value and "
        "gradients, the Pallas kernel): XLA's temporaries of a local-only model's attention core (contiguous shards)")
  try:
    devices = deviceless.gpu_devices("h100-80g", 4)
  except deviceless.DevicelessUnavailable as error:
    print(f"  skipped: {error}")
    return
  for s in lengths:
    base = None
    for cp in cps:
      mesh = Mesh(np.array(devices[:cp]), (CP,))
      loss = _loss(lambda q, k, v: halo_attention(q, k, v, window, impl="pallas"), mesh, check_vma=False)
      with lowering_for("cuda"):
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*_shapes(1, s, jnp.bfloat16, mesh, 8, 8, 128))
      temp = deviceless.compile_lowered(lowered)[0].memory_analysis().temp_size_in_bytes
      base = base or temp
      print(f"  s = {s:>6}, cp = {cp}: {temp / 2**20:8.1f} MiB   ({temp / base:.2f} x cp = 1)")


def time_per_token(repeats: int, s: int = 1024, window: int = 129, patterns=("L", "G")) -> None:
  print(f"\n== time per token on this CPU, the training step (tiny model, one row, w = {window}, XLA attention): "
        "the shard's length fixed (cp scaled with s) against cp = 1")
  print(f"{'model':6} {'s':>6} {'cp':>3} {'us/token':>9} {'cp=1 us/token':>14} {'cp=1 / cp':>10}")
  for pattern in patterns:
    first = None
    for scale in (1, 2, 4):
      length = s * scale
      row = {}
      for cp in sorted({1, scale}):
        step = step_for(tiny_config(length, pattern, cp, window))
        state = step.init_state(jax.random.key(0))
        rng = np.random.default_rng(0)
        batch = step.put_batch({"inputs": rng.integers(0, 256, (1, length), dtype=np.int32),
                                "targets": rng.integers(0, 256, (1, length), dtype=np.int32),
                                "loss_mask": np.ones((1, length), np.float32)})
        train = step.train_step()
        holder = [state]

        def one_step():
          holder[0], metrics = train(holder[0], batch)
          return metrics["loss"]
        row[cp] = median_seconds(one_step, repeats=repeats) / length * 1e6
      first = first or row[scale]
      print(f"{pattern:6} {length:>6} {scale:>3} {row[scale]:>9.2f} {row[1]:>14.2f} {row[1] / row[scale]:>10.2f}"
            f"   (cp = {scale}: {row[scale] / first:.2f} x the first row)")


def seven_b_on_h100() -> None:
  """configs/long_context.py:7b (Mistral-7B's shape, rows of 131,072 over cp 8 x tp 4) compiled
  for 32 described H100s: XLA's bytes a device against the 80 GB and the planner's estimate."""
  config = load_config("configs/long_context.py:7b")
  print("\n== configs/long_context.py:7b (Mistral-7B's shape, s = 131,072, cp = 8 x tp = 4, remat full, Pallas) "
        "compiled for 32 described H100s")
  try:
    result = deviceless.compile_for_gpu(config, "h100-80g")
  except deviceless.DevicelessUnavailable as error:
    print(f"  skipped: {error}")
    return
  xla, limit = result.bytes_per_device(), deviceless.GPU_TARGETS["h100-80g"].memory_bytes
  print(f"  {xla / 2**30:.2f} GiB a device of {limit / 2**30:.0f} GiB ({'fits' if xla < limit else 'DOES NOT FIT'}); "
        f"the planner's estimate {fits.estimate(config, 'gpu').total / 2**30:.2f} GiB; compiled in "
        f"{result.compile_seconds:.0f} s")


def cp(repeats: int, quick: bool = False) -> None:
  """quick: the smoke test's (memory at s = 16,384 for LG, and the H100 attention core, at cp 1
  and 4 only; time per token from s = 256, local-only)."""
  permute_bytes()
  if quick:
    step_memory(patterns=("LG",), cps=(1, 4))
  else:
    step_memory()
  memory_on_h100((16384,), cps=(1, 4)) if quick else memory_on_h100()
  time_per_token(repeats, s=256 if quick else 1024, patterns=("L",) if quick else ("L", "G"))
  if not quick:     # about 6 minutes of XLA's GPU compiler
    seven_b_on_h100()
