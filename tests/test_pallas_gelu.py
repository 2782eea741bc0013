"""The fused bias + GeLU Pallas kernels (interpret mode) against the MLP's XLA GeLU."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from megajax.layers.pallas_gelu import fused_bias_gelu
from tests.test_pallas_layer_norm import assert_close


@pytest.mark.parametrize("shape", [(3, 7, 64), (2, 16, 1024), (4, 8, 96)],
                         ids=["padded_rows", "tiled_columns", "whole_row"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_matches_xla_gelu(shape, dtype):
  keys = jax.random.split(jax.random.key(0), 3)
  x = 2 * jax.random.normal(keys[0], shape, dtype)
  bias = 0.5 * jax.random.normal(keys[1], shape[-1:])
  cotangent = jax.random.normal(keys[2], shape)
  ours = lambda x, bias: fused_bias_gelu(x, bias, block_rows=8)
  reference = lambda x, bias: nn.gelu(x + bias.astype(x.dtype), approximate=True)
  got, want = ours(x, bias), reference(x, bias)
  assert got.dtype == want.dtype and got.shape == want.shape
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  assert_close(got, want, tol)
  loss = lambda f, x, bias: jnp.sum(f(x, bias).astype(jnp.float32) * cotangent)
  grads = jax.grad(loss, argnums=(1, 2))
  for got, want in zip(grads(ours, x, bias), grads(reference, x, bias)):
    assert_close(got, want, tol)


def test_operators_benchmark_runs_side_by_side_on_cpu():
  """`python -m megajax.launch.bench operators`: each fused kernel next to XLA, in one run."""
  from tests.conftest import run_module
  result = run_module(["-m", "megajax.launch.bench", "operators", "--repeats=1"], timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "Pallas kernels in interpret mode (times the interpreter: no GPU figure)" in result.stdout
  rows = {tuple(line.split()[:2]) for line in result.stdout.splitlines() if len(line.split()) == 4}
  assert {(op, impl) for op in ("layer_norm", "add_layer_norm", "bias_gelu") for impl in ("pallas", "xla")} <= rows
  for op in ("layer_norm", "add_layer_norm", "bias_gelu"):
    assert f"{op}: xla / ours: forward " in result.stdout
