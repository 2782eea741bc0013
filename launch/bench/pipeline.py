r"""`python -m megajax.launch.bench pipeline [--stages=4] [--repeats=20]`: the pipeline executor.

  memory    XLA's temp bytes of the gradient computation (compiled.memory_analysis()) for
            m = 4p and 16p microbatches: our 1F1B executor vs GPipe by autodiff (the
            baseline a JAX user would pick, megajax.parallel.pipeline.baseline).
  lamb      bubble fraction and absolute bubble ticks of four 1x steps vs one 4x step
            (MegaScale 3.1: LAMB allows the 4x batch).
  lockstep  the executor's compromises, timed: a chunk's forward, its backward with the
            forward recomputed (ours; without it, residuals kept, one forward less), and
            the step time they give under our lockstep ticks vs an asynchronous runtime.
"""

import functools

import jax
import jax.numpy as jnp

from megajax.config import default_config
from megajax.sections import section
from megajax.launch.bench.timing import median_seconds
from megajax.model import GPT, ModelConfig, init_params
from megajax.parallel import fused, make_mesh
from megajax.parallel.pipeline.baseline import gpipe_autodiff_gradients
from megajax.parallel.pipeline.schedule import makespans, simulate
from megajax.parallel.tensor_parallel import Overlap, apply_block
from megajax.trainer import build_parallel_step


def _pipeline_config(p: int, microbatches: int, layers: int, virtual_stages: int = 1, schedule: str = "1f1b"):
  c = default_config()
  c.model.num_layers, c.model.hidden_dim, c.model.num_heads, c.model.seq_len = layers, 128, 8, 128
  c.model.window, c.model.window_pattern, c.model.compute_dtype = 64, "L", "float32"
  c.train.microbatches, c.train.batch_size = microbatches, 2 * microbatches   # 2 sequences per microbatch
  c.parallel.pp, c.parallel.virtual_stages, c.parallel.schedule = p, virtual_stages, schedule
  c.parallel.tp_overlap = "none"
  return c


def _gradient_temp_bytes(config, baseline: bool) -> tuple[int, int]:
  """(temp bytes of the compiled (params, batch) -> summed gradients program, stash slots)."""
  devices = jax.devices()[:config.parallel.pp]
  parallel_step = build_parallel_step(config, devices)
  fn = functools.partial(gpipe_autodiff_gradients, layouts=parallel_step.layouts, stages=config.parallel.pp,
                         virtual_stages=config.parallel.virtual_stages, microbatches=config.train.microbatches,
                         c=parallel_step.model.config, overlap=parallel_step.overlap, z_loss=0.0,
                         bucket_bytes=section(config, "parallel").dp_bucket_bytes) if baseline else None
  state, batch = parallel_step.abstract_inputs()
  compiled = parallel_step.summed_gradients(fn).lower(state.params, batch).compile()
  return compiled.memory_analysis().temp_size_in_bytes, parallel_step.pipeline.stash_slots


def memory(p: int) -> None:
  print(f"\n== memory: temp bytes of the gradients, 1F1B vs GPipe by autodiff (p={p}, {2 * p} layers, "
        "2 x 128-token sequences per microbatch, fp32)")
  print(f"{'m':>5} {'ours (1F1B)':>14} {'stash slots':>12} {'GPipe autodiff':>16} {'baseline / ours':>16}")
  figures = {}
  for m in (4 * p, 16 * p):
    config = _pipeline_config(p, m, 2 * p)
    ours, slots = _gradient_temp_bytes(config, baseline=False)
    base, _ = _gradient_temp_bytes(config, baseline=True)
    figures[m] = (ours, base)
    print(f"{m:>5} {ours / 2**20:>11.2f} MiB {slots:>12} {base / 2**20:>13.2f} MiB {base / ours:>15.2f}x")
  (o4, b4), (o16, b16) = figures[4 * p], figures[16 * p]
  print(f"m=16p over m=4p: ours {o16 / o4:.3f}x, GPipe by autodiff {b16 / b4:.3f}x")


def lamb(p: int) -> None:
  v, m = 2, 2 * p
  print(f"\n== LAMB 4x batch (MegaScale 3.1): interleaved 1F1B p={p} v={v}, microbatches m={m} per 1x step")
  one, big = simulate("interleaved_1f1b", p, v, m), simulate("interleaved_1f1b", p, v, 4 * m)
  print(f"{'':24} {'ticks':>7} {'bubble ticks':>13} {'bubble / ideal':>15}")
  print(f"{'four 1x steps':24} {4 * one.ticks:>7} {4 * one.bubble_ticks:>13} {one.bubble_fraction:>15.4f}")
  print(f"{'one 4x step':24} {big.ticks:>7} {big.bubble_ticks:>13} {big.bubble_fraction:>15.4f}")
  print(f"bubble ticks cut by {1 - big.bubble_ticks / (4 * one.bubble_ticks):.1%}, bubble fraction by "
        f"{1 - big.bubble_fraction / one.bubble_fraction:.1%} (formula (p-1)/(v m): {(p - 1) / (v * m):.4f} -> "
        f"{(p - 1) / (v * 4 * m):.4f}); the paper states 87.5%")


def lockstep(p: int, repeats: int) -> None:

  config = _pipeline_config(1, 1, 2)
  config.parallel.pp = 1
  c = ModelConfig.from_config(config.model)
  mesh = make_mesh(config.parallel, jax.devices()[:1])
  layers = [fused.to_compute_form(init_params(GPT(c), jax.random.key(0))[f"layer_{i}"], c) for i in range(2)]
  x = jax.random.normal(jax.random.key(1), (2, c.seq_len, c.hidden_dim), jnp.float32)
  positions = jnp.broadcast_to(jnp.arange(c.seq_len), (2, c.seq_len))
  overlap = Overlap("none", 1)

  def chunk(layers, x):
    for p_ in layers:
      x = apply_block(p_, x, positions, c.window, c, overlap)
    return x

  def mapped(fn):
    # One device: the (size 1) mesh axes only name the collectives; nothing to check.
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=jax.sharding.PartitionSpec(),
                                 out_specs=jax.sharding.PartitionSpec(), check_vma=False))
  forward = mapped(lambda args: chunk(*args))
  # Ours: the backward slot recomputes the forward, then runs the backward. With residuals
  # kept from the forward slot, the backward slot would cost this minus one forward.
  recompute = mapped(lambda args: jax.vjp(chunk, *args)[1](jnp.ones_like(x)))
  t_f = median_seconds(forward, (layers, x), repeats=repeats)
  t_recompute = median_seconds(recompute, (layers, x), repeats=repeats)
  t_residual = t_recompute - t_f
  print(f"\n== lockstep and recompute, timed on this machine ({jax.devices()[0].platform}): one chunk of 2 layers, "
        f"2 x {c.seq_len} tokens, hidden {c.hidden_dim}")
  print(f"forward {t_f * 1e3:.2f} ms; backward with the forward recomputed (ours) {t_recompute * 1e3:.2f} ms; "
        f"without the recompute {t_residual * 1e3:.2f} ms ({t_recompute / t_residual:.2f}x)")
  print(f"{'schedule':28} {'ours: lockstep':>15} {'async runtime':>14} {'async, residuals':>17} "
        f"{'lockstep cost':>14} {'total cost':>11}")
  for name, v, m in (("1f1b", 1, 2 * p), ("interleaved_1f1b", 2, 2 * p), ("gpipe", 1, 2 * p)):
    schedule = simulate(name, p, v, m)     # each stage holds the timed 2 layers, in v chunks
    ours, asynchronous = makespans(schedule, t_f / v, t_recompute / v)
    _, ideal = makespans(schedule, t_f / v, t_residual / v)
    print(f"{f'{name} p={p} v={v} m={m}':28} {ours * 1e3:>12.1f} ms {asynchronous * 1e3:>11.1f} ms "
          f"{ideal * 1e3:>14.1f} ms {ours / asynchronous:>13.3f}x {ours / ideal:>10.3f}x")


def pipeline(stages: int, repeats: int) -> None:
  lamb(stages)
  lockstep(stages, repeats)
  memory(stages)
