"""`python -m megajax.launch.bench observe`: what observability costs a training step.

One process, the default config's model on every local device (CPU: 8 devices, mesh dp=2
tp=4; one GPU: 1 device). Measured side by side in one run against the bare compiled step
(the loop a user would write without any of it):
  always-on   the trainer's per-step bookkeeping that is always on: heartbeat update,
              metrics.jsonl / TensorBoard record with the job's goodput so far (the trainer
              computes it at logged steps only: here at every step, the worst case), the goodput
              clock's laps and its step write, the trace sampler's check. (The named scopes
              are compile-time metadata: the program they compile to is measured as "bare".)
  traced      one step under jax.profiler with its trace written (start, step, stop, the
              operations table), and that cost spread over observe.trace_every steps.
"""

from __future__ import annotations

import tempfile

import jax

from megajax.config import default_config
from megajax.launch.bench.timing import median_seconds
from megajax.launch.bench.train import CompiledStep
from megajax.observe.goodput import GoodputClock
from megajax.observe.metrics import MetricsWriter
from megajax.observe.traces import StepTracer
from megajax.trainer.heartbeat import Heartbeat


def _config(devices: int):
  c = default_config()
  c.model.num_layers, c.model.compute_dtype = 2, "float32"
  c.parallel.pp, c.parallel.virtual_stages = 1, 1
  c.parallel.dp, c.parallel.tp = (2, 4) if devices >= 8 else (1, 1)
  c.parallel.tp_overlap = "none"
  c.observe.trace_every = 100
  return c


def observe(repeats: int) -> None:
  config = _config(len(jax.devices()))
  p = config.parallel
  step = CompiledStep(config, jax.devices()[:p.dp * p.pp * p.tp])
  mesh, one_step = step.mesh, step.run

  with tempfile.TemporaryDirectory() as workdir:
    tracer = StepTracer(config.observe, mesh, workdir)
    tracer.describe(step.compiled)
    writer = MetricsWriter(workdir, 10 ** 6, progress=False)
    heartbeat = Heartbeat(workdir, 0, [], interval=1.0)
    clock = GoodputClock()
    clock.open(workdir, interval=1.0)
    bare = median_seconds(one_step, repeats=repeats)            # after one untimed step
    metrics = jax.device_get(one_step())
    record = {k: float(v) for k, v in metrics.items()}
    counter = iter(range(1, 10 ** 9))

    def bookkeeping():
      n = next(counter)
      clock.lap("steps")
      heartbeat.update(phase=f"step {n}", step=n, loss=record["loss"], step_time_s=bare)
      clock.lap("data_wait")
      writer.write(n, {**record, **clock.live_scalars()})
      tracer.wants(n)
      clock.lap("steps")
      clock.finished(n)

    always_on = median_seconds(bookkeeping, repeats=repeats * 20)

    def goodput_only():
      n = next(counter)
      clock.lap("steps")
      clock.lap("data_wait")
      clock.lap("steps")
      clock.finished(n)
      return clock.live_scalars()

    goodput = median_seconds(goodput_only, repeats=repeats * 20)

    def traced_step():
      tracer.start(next(counter))
      one_step()
      tracer.stop()

    # The untimed first run: the profiler's first start is slower.
    traced = median_seconds(traced_step, repeats=max(3, repeats // 4))
    heartbeat.close(done=True)
    clock.close("finished")
    writer.close()

  every = config.observe.trace_every
  print(f"devices: {mesh.size} x {mesh.devices.flat[0].device_kind}, mesh dp={p.dp} pp={p.pp} tp={p.tp}; "
        f"medians of {repeats} steps")
  print(f"{'':34}{'ms':>10}{'x bare step':>14}")
  print(f"{'bare compiled step':34}{bare * 1e3:10.2f}{1.0:14.3f}")
  print(f"{'always-on bookkeeping per step':34}{always_on * 1e3:10.3f}{always_on / bare:14.4f}"
        f"   (overhead {100 * always_on / bare:.2f}% of a step)")
  print(f"{'  of which the goodput clock':34}{goodput * 1e3:10.3f}{goodput / bare:14.4f}"
        "   (its laps, the step write, the job's ledger so far; writing its 6 scalars is the record's)")
  print(f"{'traced step (profiler + write)':34}{traced * 1e3:10.2f}{traced / bare:14.3f}")
  print(f"{f'tracing, 1 step in {every}':34}{(traced - bare) / every * 1e3:10.3f}"
        f"{(traced - bare) / every / bare:14.4f}   (overhead {100 * (traced - bare) / every / bare:.2f}% "
        f"of a step)")
