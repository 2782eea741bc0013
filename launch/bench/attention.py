"""`python -m megajax.launch.bench attention`: our Pallas sliding-window kernels against the
attention a user would pick (cuDNN through jax.nn.dot_product_attention, and XLA), timed
side by side in one run.

Per (s, w): forward and forward+backward milliseconds (median of --repeats), TFLOP/s
counting only in-window FLOPs (forward 4·d per visible (query, key) pair and head, the
backward 2.5x the forward: FlashAttention-2's convention), and each baseline's time over
ours. Then time(largest s) / time(s / 4) at fixed w. On a GPU: s in {2k, 8k, 32k}, w in
{512, 1024, 4096, None}, head dim 128, bf16, batch x heads filling the device. On a CPU: a
reduced grid with the kernels in interpret mode, which times the interpreter, not a GPU.
On Hopper `pallas` is the Mosaic GPU forward and a `triton` row adds the portable kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from megajax.launch.bench.timing import median_seconds
from megajax.layers import cudnn_attention, xla_attention
from megajax.layers.kernels.attention import default_backend, pallas_attention


def visible_pairs(s: int, window: int | None) -> int:
  """Query-key pairs inside the causal window band."""
  if window is None or window >= s:
    return s * (s + 1) // 2
  return window * (window + 1) // 2 + (s - window) * window


def _grid(on_gpu: bool):
  if on_gpu:
    return dict(lengths=(2048, 8192, 32768), windows=(512, 1024, 4096, None), head_dim=128, dtype=jnp.bfloat16,
                rows=2 ** 20, heads=16, kv_heads=16)   # 32 sequences x 16 heads
  return dict(lengths=(128, 512), windows=(32, None), head_dim=64, dtype=jnp.float32, rows=512, heads=2,
              kv_heads=1)


def attention(repeats: int) -> None:
  platform = jax.devices()[0].platform
  on_gpu = platform == "gpu"
  g = _grid(on_gpu)
  impls = {"pallas": pallas_attention, "xla": xla_attention}
  backend = default_backend(g["dtype"], g["head_dim"])
  if on_gpu:
    impls["cudnn"] = cudnn_attention
  if backend == "mosaic":    # Hopper: the portable kernel side by side with the Hopper forward
    impls["triton"] = functools.partial(pallas_attention, backend="triton")
  print(f"\n== attention on {jax.devices()[0].device_kind} ({platform}), head dim {g['head_dim']}, "
        f"{jnp.dtype(g['dtype']).name}, {g['heads']} heads / {g['kv_heads']} KV heads; "
        f"pallas = backend {backend!r}")
  if not on_gpu:
    print("CPU: reduced grid, Pallas kernels in interpret mode (times the interpreter: no GPU figure); "
          "cudnn needs a GPU")
  header = f"{'s':>6} {'w':>6} {'impl':>7} {'fwd ms':>10} {'fwd+bwd ms':>11} {'TFLOP/s':>9} {'vs pallas':>10}"
  print(header)
  times = {}
  # One batch for every s (sized by the longest), so time(4s) / time(s) shows the growth in s.
  batch = max(1, g["rows"] // max(g["lengths"]))
  for s in g["lengths"]:
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (batch, s, g["heads"], g["head_dim"]), g["dtype"])
    k = jax.random.normal(keys[1], (batch, s, g["kv_heads"], g["head_dim"]), g["dtype"])
    v = jax.random.normal(keys[2], (batch, s, g["kv_heads"], g["head_dim"]), g["dtype"])
    cotangent = jax.random.normal(keys[3], q.shape, g["dtype"])
    for window in g["windows"]:
      flops = 4 * g["head_dim"] * g["heads"] * batch * visible_pairs(s, window)
      for name, fn in impls.items():
        forward = jax.jit(lambda q, k, v, fn=fn, window=window: fn(q, k, v, window))
        both = jax.jit(jax.grad(lambda q, k, v, fn=fn, window=window: jnp.sum(
            (fn(q, k, v, window) * cotangent).astype(jnp.float32)), argnums=(0, 1, 2)))
        t_forward = median_seconds(forward, q, k, v, repeats=repeats) * 1e3
        t_both = median_seconds(both, q, k, v, repeats=repeats) * 1e3
        times[s, window, name] = t_both
        tflops = 3.5 * flops / (t_both * 1e-3) / 1e12
        ratio = t_both / times[s, window, "pallas"]
        print(f"{s:>6} {str(window):>6} {name:>7} {t_forward:>10.3f} {t_both:>11.3f} {tflops:>9.3f} {ratio:>9.2f}x")
  large, small = g["lengths"][-1], g["lengths"][-1] // 4
  if small in g["lengths"]:
    for window in g["windows"]:
      print(f"pallas fwd+bwd time(s={large}) / time(s={small}) at w={window}: "
            f"{times[large, window, 'pallas'] / times[small, window, 'pallas']:.2f}")
