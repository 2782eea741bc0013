"""Kernels against the XLA code they replace: inputs, values and gradients, the tolerance rule."""

import threading

import jax
import jax.numpy as jnp
import numpy as np

from megajax.layers import xla_attention
from megajax.layers.kernels import pallas_attention


TRITON_CALL, MOSAIC_CALL = "__gpu$xla.gpu.triton", "mosaic_gpu_v2"   # the kernels' custom calls
CUDNN_CALLS = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")   # jax.nn.dot_product_attention's


def export_for_cuda(fn, *args) -> str:
  """The StableHLO module of `fn` exported for CUDA on this machine (the kernels' and cuDNN's
  custom calls allowed): runs the Triton and Mosaic GPU lowerings without a GPU."""
  checks = [jax.export.DisabledSafetyCheck.custom_call(name) for name in (TRITON_CALL, MOSAIC_CALL, *CUDNN_CALLS)]
  jitted = fn if hasattr(fn, "lower") else jax.jit(fn)    # a jitted step keeps its compiler options
  return jax.export.export(jitted, platforms=["cuda"], disabled_checks=checks)(*args).mlir_module()


def tolerance(dtype) -> float:
  """Max error over the largest entry: fp32 1e-5 on CPU (the interpreter's dots are exact
  fp32), 3e-3 on a GPU (Triton's and XLA's default fp32 dots use TF32); 16-bit 2e-2."""
  if jnp.dtype(dtype) != jnp.float32:
    return 2e-2
  return 3e-3 if jax.devices()[0].platform == "gpu" else 1e-5


def inputs(b, s, heads, kv_heads, d, dtype, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(keys[0], (b, s, heads, d), dtype)
  k = jax.random.normal(keys[1], (b, s, kv_heads, d), dtype)
  v = jax.random.normal(keys[2], (b, s, kv_heads, d), dtype)
  cotangent = jax.random.normal(keys[3], (b, s, heads, d), jnp.float32)
  return q, k, v, cotangent


def value_and_grads(attention, q, k, v, cotangent):
  """(out, dq, dk, dv) of sum(attention(q, k, v) * cotangent), from one forward: the vjp's
  (the cotangent in the output's dtype, as the gradient of an fp32 cast passes it back)."""
  def run(q, k, v):
    out, pullback = jax.vjp(attention, q, k, v)
    return (out, *pullback(cotangent.astype(out.dtype)))
  return jax.jit(run)(q, k, v)


def assert_close(got, want, tol):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  # Relative to the largest entry (at least 1: with one token dq is exactly 0 in both).
  scale = max(float(np.max(np.abs(want))), 1.0)
  assert np.max(np.abs(got - want)) <= tol * scale, np.max(np.abs(got - want)) / scale


def check(b, s, heads, kv_heads, d, window, dtype, block=16, seed=0, segment_ids=None, backend=None,
          backward="triton"):
  """pallas_attention against xla_attention: out, dq, dk, dv (segment_ids: [b, s] packed documents)."""
  q, k, v, cotangent = inputs(b, s, heads, kv_heads, d, dtype, seed)
  ours = value_and_grads(lambda q, k, v: pallas_attention(q, k, v, window, segment_ids, block_q=block, block_k=block,
                                                          backend=backend, backward=backward), q, k, v, cotangent)
  reference = value_and_grads(lambda q, k, v: xla_attention(q, k, v, window, segment_ids), q, k, v, cotangent)
  tol = tolerance(dtype)
  for name, got, want in zip(("out", "dq", "dk", "dv"), ours, reference):
    assert got.shape == want.shape and got.dtype == want.dtype, name
    assert_close(got, want, tol)


def compile_interpreter_threads_once(monkeypatch) -> None:
  """Pallas's GPU interpreter runs a kernel's warpgroups as threads (thread_map), and every
  thread of every grid step traces, lowers and compiles its body anew (jax 0.10's `_run_jaxpr`
  jits a fresh closure per call; the threads of a step compile the same program side by side,
  and later steps read it back from the persistent cache). Here the body is compiled once
  per (jaxpr, argument types) and shared by the threads and the steps: what runs, and in
  which threads, is unchanged (the 13 Hopper tests alone: 33.7 -> 21.4 s). Where the
  interpreter's internals differ (another jax), nothing is replaced."""
  try:
    from jax._src.pallas.mosaic.interpret import thread_map
  except ImportError:
    return
  if not callable(getattr(thread_map, "_run_jaxpr", None)):
    return
  compiled, lock = {}, threading.Lock()

  def run_jaxpr(jaxpr, consts, *args):
    # A Jaxpr hashes by identity, and the key keeps it alive.
    key = (jaxpr, tuple((np.shape(x), jnp.result_type(x)) for x in (*consts, *args)))
    with lock:    # one thread compiles; the others wait for it rather than compile the same
      if key not in compiled:
        body = lambda consts, *args: jax.core.eval_jaxpr(jaxpr, consts, *args)
        compiled[key] = jax.jit(body).lower(consts, *args).compile()
    compiled[key](consts, *args)

  monkeypatch.setattr(thread_map, "_run_jaxpr", run_jaxpr)
