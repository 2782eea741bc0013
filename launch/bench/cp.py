"""`python -m megajax.launch.bench cp`: context parallelism's attention (parallel/context_parallel.py),
the layer's core alone (the cp mesh axis is not in the training step yet: issue 42).

1. Bytes, from the compiled program (value and gradients, cp = 4, fp32): a sliding-window
   layer's collective-permute bytes per device at s = 2,048 and 8,192 (the halo's, O(w)),
   a global layer's ring at the same lengths ((cp-1)/cp of the row's K/V), all-gathers.
2. Memory, compiled for described H100s (bf16, w = 1,025, the Pallas kernel; the attention
   core alone, not a model's activations): XLA's temporaries per device at cp = 1, 2, 4 for
   s = 16,384 and 65,536.
3. Time per token on this CPU, forward + backward, local layer (XLA's attention for the own
   keys: dense, so its work per token grows with the shard's length): s, 2s, 4s with cp = 1,
   2, 4 (the shard's length fixed) against cp = 1 at each length. The CPU's devices share its
   cores: a row's time is the work of all of them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np

from megajax.launch.bench.timing import median_seconds
from megajax.layers.kernels import lowering_for
from megajax.observe.hlo import collective_counts
from megajax.parallel import deviceless
from megajax.parallel.context_parallel import CP, halo_attention, ring_attention

SHARDED = P(None, CP)
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64


def _loss(attention, mesh, check_vma: bool = True):
  sharded = jax.shard_map(attention, mesh=mesh, in_specs=(SHARDED,) * 3, out_specs=SHARDED, check_vma=check_vma)
  return lambda q, k, v: jnp.sum(sharded(q, k, v).astype(jnp.float32))


def _shapes(b: int, s: int, dtype, mesh=None, heads=HEADS, kv_heads=KV_HEADS, d=HEAD_DIM):
  sharding = NamedSharding(mesh, SHARDED) if mesh is not None else None
  return [jax.ShapeDtypeStruct((b, s, n, d), dtype, sharding=sharding) for n in (heads, kv_heads, kv_heads)]


def _cpu_mesh(cp: int) -> Mesh:
  return Mesh(np.array(jax.devices()[:cp]), (CP,))


def permute_bytes(window: int = 129, cp: int = 4) -> None:
  print(f"\n== bytes per device, compiled (value and gradients, cp = {cp}, fp32, b 1, {KV_HEADS} KV heads of "
        f"{HEAD_DIM}): a local layer (w = {window}) and a global one")
  print(f"{'layer':8} {'s':>6} {'permute bytes':>14} {'expected':>10} {'all-gathers':>12}")
  mesh = _cpu_mesh(cp)
  for name, attention in (("local", lambda q, k, v: halo_attention(q, k, v, window)),
                          ("global", lambda q, k, v: ring_attention(q, k, v))):
    for s in (2048, 8192):
      text = jax.jit(jax.grad(_loss(attention, mesh), argnums=(0, 1, 2))).lower(
          *_shapes(1, s, jnp.float32)).compile().as_text()
      counts = collective_counts(text, mesh, nbytes=True)
      permuted = sum(n for key, n in counts.items() if key[0] == "collective-permute")
      gathers = sum(n for key, n in counts.items() if key[0] == "all-gather")
      kv_bytes = KV_HEADS * HEAD_DIM * 4
      expected = 2 * 2 * (window - 1) * kv_bytes if name == "local" else 2 * 2 * (cp - 1) * (s // cp) * kv_bytes
      print(f"{name:8} {s:>6} {permuted:>14,} {expected:>10,} {gathers:>12}")


def memory_on_h100(lengths=(16384, 65536), window: int = 1025) -> None:
  print(f"\n== memory per device, compiled for described H100s (bf16, w = {window}, 8 heads of 128, value and "
        "gradients, the Pallas kernel): XLA's temporaries of the attention core")
  try:
    devices = deviceless.gpu_devices("h100-80g", 4)
  except deviceless.DevicelessUnavailable as error:
    print(f"  skipped: {error}")
    return
  for s in lengths:
    base = None
    for cp in (1, 2, 4):
      mesh = Mesh(np.array(devices[:cp]), (CP,))
      loss = _loss(lambda q, k, v: halo_attention(q, k, v, window, impl="pallas"), mesh, check_vma=False)
      with lowering_for("cuda"):
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*_shapes(1, s, jnp.bfloat16, mesh, 8, 8, 128))
      temp = deviceless.compile_lowered(lowered)[0].memory_analysis().temp_size_in_bytes
      base = base or temp
      print(f"  s = {s:>6}, cp = {cp}: {temp / 2**20:8.1f} MiB   ({temp / base:.2f} x cp = 1)")


def time_per_token(repeats: int, s: int = 1024, window: int = 129) -> None:
  print(f"\n== time per token on this CPU, value and gradients, local layer (w = {window}, XLA attention), "
        f"b 1, {HEADS} heads: the shard's length fixed (cp scaled with s) against cp = 1")
  print(f"{'s':>6} {'cp':>3} {'us/token':>9} {'cp=1 us/token':>14} {'cp=1 / cp':>10}")
  first = None
  for scale in (1, 2, 4):
    length = s * scale
    row = {}
    for cp in sorted({1, scale}):
      fn = jax.jit(jax.grad(_loss(lambda q, k, v: halo_attention(q, k, v, window), _cpu_mesh(cp)), argnums=(0, 1, 2)))
      args = [jax.random.normal(jax.random.key(i), shape.shape) for i, shape in enumerate(_shapes(1, length, jnp.float32))]
      row[cp] = median_seconds(fn, *args, repeats=repeats) / length * 1e6
    first = first or row[scale]
    print(f"{length:>6} {scale:>3} {row[scale]:>9.2f} {row[1]:>14.2f} {row[1] / row[scale]:>10.2f}"
          f"   (cp = {scale}: {row[scale] / first:.2f} x the first row)")


def cp(repeats: int, quick: bool = False) -> None:
  """quick: the smoke test's (memory at s = 16,384 only, time per token from s = 256)."""
  permute_bytes()
  memory_on_h100((16384,) if quick else (16384, 65536))
  time_per_token(repeats, s=256 if quick else 1024)
