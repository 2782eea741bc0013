"""`python -m megajax.launch.bench operators`: the fused-operator Pallas kernels against XLA's
own fusion of the same ops, timed side by side in one run (MegaScale 3.3's fused LayerNorm
and GeLU, and the Llama family's RMSNorm and SwiGLU; the kernel issue keeps a kernel as the
model's default only where it wins here).

  layer_norm      y = LN(x)                    ours: fused_layer_norm       XLA: the model's Flax LayerNorm
  add_layer_norm  z = x + r, y = LN(z)         ours: one kernel             XLA: add then LayerNorm
  rms_norm        y = RMSNorm(x)               ours: fused_rms_norm         XLA: the model's Flax RMSNorm
  add_rms_norm    z = x + r, y = RMSNorm(z)    ours: one kernel             XLA: add then RMSNorm
  bias_gelu       y = gelu(x + b) (tanh)       ours: fused_bias_gelu        XLA: nn.gelu(x + b)
  swiglu          y = silu(g) * u              ours: fused_swiglu           XLA: the model's SwiGLU

Forward and forward+backward milliseconds (median of --repeats), and XLA's time over ours
(> 1: the kernel wins). On a GPU: 32k tokens, hidden 4096 (MLP 16384), bf16. On a CPU: a
reduced shape with the kernels in interpret mode, which times the interpreter, not a GPU.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from megajax.launch.bench.timing import median_seconds
from megajax.layers import layer_norm, rms_norm, swiglu
from megajax.layers.kernels.gelu import fused_bias_gelu
from megajax.layers.kernels.layer_norm import fused_layer_norm, fused_rms_norm
from megajax.layers.kernels.swiglu import fused_swiglu


def _cases(tokens: int, hidden: int, mlp: int, dtype):
  keys = jax.random.split(jax.random.key(0), 7)
  x, residual = (jax.random.normal(k, (tokens, hidden), dtype) for k in keys[:2])
  scale, bias = 1 + 0.1 * jax.random.normal(keys[2], (hidden,)), 0.1 * jax.random.normal(keys[3], (hidden,))
  h, mlp_bias = jax.random.normal(keys[4], (tokens, mlp), dtype), 0.1 * jax.random.normal(keys[5], (mlp,))
  up = jax.random.normal(keys[6], (tokens, mlp), dtype)
  norm, rms = layer_norm(1e-5, dtype, jnp.float32, "norm"), rms_norm(1e-5, dtype, jnp.float32, "norm")
  xla_norm = lambda x, scale, bias: norm.apply({"params": {"scale": scale, "bias": bias}}, x)
  xla_rms = lambda x, scale: rms.apply({"params": {"scale": scale}}, x)

  def xla_add_norm(x, residual, scale, bias):
    z = x + residual
    return z, xla_norm(z, scale, bias)

  def xla_add_rms(x, residual, scale):
    z = x + residual
    return z, xla_rms(z, scale)

  return {
      "layer_norm": ((x, scale, bias), fused_layer_norm, xla_norm),
      "add_layer_norm": ((x, residual, scale, bias),
                         lambda x, r, scale, bias: fused_layer_norm(x, scale, bias, r), xla_add_norm),
      "rms_norm": ((x, scale), fused_rms_norm, xla_rms),
      "add_rms_norm": ((x, residual, scale), lambda x, r, scale: fused_rms_norm(x, scale, r), xla_add_rms),
      "bias_gelu": ((h, mlp_bias), fused_bias_gelu, lambda x, b: nn.gelu(x + b.astype(x.dtype), approximate=True)),
      "swiglu": ((h, up), fused_swiglu, swiglu),
  }


def _loss(fn):
  return lambda *args: sum(jnp.sum(out.astype(jnp.float32)) for out in jax.tree.leaves(fn(*args)))


def operators(repeats: int) -> None:
  platform = jax.devices()[0].platform
  on_gpu = platform == "gpu"
  tokens, hidden, mlp, dtype = (32768, 4096, 16384, jnp.bfloat16) if on_gpu else (512, 256, 1024, jnp.float32)
  print(f"\n== fused operators on {jax.devices()[0].device_kind} ({platform}): {tokens} tokens, hidden {hidden}, "
        f"MLP {mlp}, {jnp.dtype(dtype).name}")
  if not on_gpu:
    print("CPU: reduced shape, Pallas kernels in interpret mode (times the interpreter: no GPU figure)")
  print(f"{'op':>15} {'impl':>6} {'fwd ms':>10} {'fwd+bwd ms':>11}")
  for name, (args, ours, xla) in _cases(tokens, hidden, mlp, dtype).items():
    times = {}
    for impl, fn in (("pallas", ours), ("xla", xla)):
      gradients = jax.jit(jax.grad(_loss(fn), argnums=tuple(range(len(args)))))
      times[impl] = (median_seconds(jax.jit(fn), *args, repeats=repeats) * 1e3,
                     median_seconds(gradients, *args, repeats=repeats) * 1e3)
      print(f"{name:>15} {impl:>6} {times[impl][0]:>10.3f} {times[impl][1]:>11.3f}")
    print(f"{name}: xla / ours: forward {times['xla'][0] / times['pallas'][0]:.2f}x, "
          f"forward+backward {times['xla'][1] / times['pallas'][1]:.2f}x")
