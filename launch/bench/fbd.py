"""`python -m megajax.launch.bench fbd [--repeats=20] [--fbd_size=cpu|tiny]`: MegaFBD's decoupled
step against the co-located 3D step, side by side on the 8 CPU devices.

The contenders, the same model, batch and LAMB from the same initial parameters:
  3D step dp2 tp4     megajax's shard_map step on all 8 devices (the co-located baseline)
  FBD 4+4             the forward on 4 devices (dp 2 x tp 2), the backward and the optimizer on
                      the other 4 (dp 2 x tp 2): megajax.parallel.fbd.FbdStep
  FBD 2+6             the forward on 2 (dp 2), the backward on 6 (dp 3 x tp 2)
  FBD 4+4 serial      FBD 4+4 with each program waited for before the next: the groups never
                      overlap (the forward of microbatch i + 1 waits for the backward of i), the
                      measure of what the asynchronous dispatch overlaps
Printed per contender: the median step time over interleaved rounds and its ratio to the 3D
step, the first loss (they must agree), the peak bytes a device holds (XLA's memory analysis:
the 3D step's program; for FBD each group's), and for FBD the bytes sent forward -> backward
per microbatch (jax.vjp's residuals: activations under the remat policy and the weights the
matmuls read, but the weights) and backward -> forward per step (the weights). Then, per remat
policy, the bytes sent a microbatch against the planner's count of what a layer keeps for its
backward (memory.fbd_residual_bytes), and the weights sent a step (fp32 and bf16 compute)
against cost_model.param_counts. Then traces (jax.profiler) of FBD 4+4, FBD 1+1 (one device a
group: programs without collectives) and FBD 1+1 serial: from the device events, the ms each
group runs its program's operations and both at once (the overlap, traced). Last, the planner's
MegaFBD on a mixed cluster (parallel/planner/fbd.py; docs/parallelism.md's worked example).
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import json
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from megajax.config import default_config, load_config
from megajax.launch.bench.timing import median_seconds
from megajax.launch.bench.train import CompiledStep
from megajax.model import GPT, ModelConfig, init_params
from megajax.observe.goodput_ledger import union_length
from megajax.observe.trace_analysis import trace_file
from megajax.parallel.deviceless import bytes_per_device
from megajax.parallel.fbd import FbdStep
from megajax.parallel.planner import cost_model, memory, plans
from megajax.parallel.planner import fbd as planner_fbd
from megajax.parallel.planner.fits import plan_of
from megajax.reference_step import fresh_train_state

SIZES = {"cpu": dict(hidden=256, layers=4, heads=8, seq=128, batch=16, microbatches=4),
         "tiny": dict(hidden=32, layers=2, heads=4, seq=16, batch=8, microbatches=2)}
TRACED_STEPS = 3
ONE_AND_ONE = (1, 1, 1, 1, 1)
PLANNED = {"config": "configs/gpt.py:1p3b", "batch": 128, "forward_hw": "a100-80g", "forward_gpus": 32,
           "backward_hw": "h100-80g", "backward_gpus": 8}    # one device a group: programs without collectives
SPLITS = {"FBD 4+4": (4, 2, 2, 2, 2), "FBD 2+6": (2, 2, 1, 3, 2)}


def _config(size: str):
  s = SIZES[size]
  c = default_config()
  c.model.hidden_dim, c.model.num_layers, c.model.num_heads = s["hidden"], s["layers"], s["heads"]
  c.model.seq_len, c.model.vocab_size, c.model.compute_dtype = s["seq"], 512, "float32"
  c.model.window = s["seq"] // 4
  c.train.batch_size, c.train.microbatches = s["batch"], s["microbatches"]
  c.parallel.dp, c.parallel.pp, c.parallel.virtual_stages, c.parallel.tp = 2, 1, 1, 4
  return c


class _Fbd:
  def __init__(self, config, split, batch, serialized: bool = False):
    f_devices, f_dp, f_tp, b_dp, b_tp = split
    devices = jax.devices()
    model = GPT(ModelConfig.from_config(config.model))
    params = init_params(model, jax.random.key(0))
    self.step = FbdStep.build(config, model, devices[:f_devices], devices[f_devices:f_devices + b_dp * b_tp],
                              f_dp, f_tp, b_dp, b_tp)
    self.state = self.step.place_state(jax.jit(fresh_train_state, static_argnums=1)(params, self.step.optimizer))
    self.batch = self.step.put_batch(batch)
    self.traffic = self.step.traffic()
    # The trainer's programs (compiled ahead, as FbdStep.compiled_train_step gives them).
    self.train_step = functools.partial(self.step.compiled_train_step(), serialized=serialized)

  def run(self) -> dict:
    self.state, metrics = self.train_step(self.state, self.batch)
    return jax.block_until_ready(metrics)


def traced_overlap(contender: _Fbd, steps: int, directory: str) -> dict:
  """`steps` steps of `contender` under jax.profiler; from the trace's device events: the time
  the forward group runs forward operations, the backward group backward ones, and both at once
  (by inclusion-exclusion: each group's busy time less that of their union), in ms."""
  contender.run()
  jax.profiler.start_trace(directory)
  for _ in range(steps):
    contender.run()
  jax.profiler.stop_trace()
  with gzip.open(trace_file(directory)) as f:
    events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "hlo_module" in (e.get("args") or {})]

  def busy(mesh, module: str) -> list[tuple[float, float]]:
    ids = {str(d.id) for d in mesh.devices.flat}
    return [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in events
            if e["args"]["hlo_module"] == module and str(e["args"].get("device_ordinal")) in ids]

  forward, backward = busy(contender.step.forward_mesh, "jit_forward"), busy(contender.step.backward_mesh,
                                                                            "jit_backward")
  forward_us, backward_us = union_length(forward), union_length(backward)
  return {"forward_ms": forward_us / 1e3, "backward_ms": backward_us / 1e3,
          "both_ms": max(0.0, forward_us + backward_us - union_length(forward + backward)) / 1e3}


def fbd(repeats: int, size: str = "cpu") -> None:
  config = _config(size)
  colocated = CompiledStep(config, jax.devices()[:8])
  batch = {k: np.asarray(v) for k, v in jax.device_get(colocated.batch).items()}
  contenders = {"3D step dp2 tp4": colocated, **{name: _Fbd(config, split, batch) for name, split in SPLITS.items()},
                "FBD 4+4 serial": _Fbd(config, SPLITS["FBD 4+4"], batch, serialized=True)}
  losses = {name: float(c.run()["loss"]) for name, c in contenders.items()}     # compiled, warmed
  seconds = {name: [] for name in contenders}
  for round_ in range(repeats):       # interleaved, the order rotated each round
    names = list(contenders)[round_ % len(contenders):] + list(contenders)[:round_ % len(contenders)]
    for name in names:
      seconds[name].append(median_seconds(contenders[name].run, repeats=1, warmed=True))
  base = float(np.median(seconds["3D step dp2 tp4"]))
  s = SIZES[size]
  print(f"bench fbd: {s['layers']} layers, hidden {s['hidden']}, seq {s['seq']}, batch {s['batch']} in "
        f"{s['microbatches']} microbatches, fp32, LAMB; {len(jax.devices())} x {jax.devices()[0].device_kind}; "
        f"medians of {repeats} interleaved rounds")
  print(f"{'':18}{'step ms':>9}{'x 3D step':>11}{'first loss':>12}{'peak MB/device':>26}"
        f"{'fwd->bwd MB/microbatch':>24}{'bwd->fwd MB/step':>18}")
  for name, c in contenders.items():
    ms = float(np.median(seconds[name])) * 1e3
    if isinstance(c, _Fbd):
      t = c.traffic
      peak = f"fwd {t['forward_peak_bytes'] / 2**20:.2f} / bwd {t['backward_peak_bytes'] / 2**20:.2f}"
      moved = f"{t['residual_bytes'] / 2**20:>24.2f}{t['weight_bytes'] / 2**20:>18.2f}"
    else:
      peak, moved = f"{bytes_per_device(c.compiled) / 2**20:.2f}", f"{'-':>24}{'-':>18}"
    print(f"{name:18}{ms:>9.1f}{ms / (base * 1e3):>11.3f}{losses[name]:>12.5f}{peak:>26}{moved}")
  overlapped = float(np.median(seconds["FBD 4+4"])) / float(np.median(seconds["FBD 4+4 serial"]))
  print(f"overlap: FBD 4+4 takes {overlapped:.3f} of its time with each program waited for (FBD 4+4 serial: the "
        "groups never run at once)")
  print("\nforward -> backward MB per microbatch, FBD 4+4, by remat policy: what jax.vjp keeps (sent) against the "
        "planner's count (parallel.planner.memory.fbd_residual_bytes: each layer's kept bytes + the fp32 logits)")
  print(f"{'remat':>8}{'sent':>10}{'planner':>10}{'ratio':>8}")
  # FBD 4+4's traffic for a variant of the config (the contender's own where it is the same config).
  traffic = lambda c: (contenders["FBD 4+4"].traffic if c.to_json() == config.to_json() else
                       _Fbd(c, SPLITS["FBD 4+4"], batch).traffic)
  for remat in ("none", "dots", "full"):
    c = _config(size)
    c.model.remat = remat
    sent = traffic(c)["residual_bytes"]
    plan = dataclasses.replace(plan_of(c, "cpu"), micro_batch=c.train.batch_size // c.train.microbatches)
    counted = memory.fbd_residual_bytes(ModelConfig.from_config(c.model), plan)
    print(f"{remat:>8}{sent / 2**20:>10.2f}{counted / 2**20:>10.2f}{sent / counted:>8.2f}")
  model_config = ModelConfig.from_config(config.model)
  for dtype in ("float32", "bfloat16"):    # the weights a step, in the compute dtype: sent and counted
    c = _config(size)
    c.model.compute_dtype = dtype
    sent = traffic(c)["weight_bytes"]
    counted = cost_model.param_counts(model_config, dataclasses.replace(plan_of(c, "cpu"), dp=1, pp=1, tp=1)
                                      ).gathered_bytes(jnp.dtype(dtype).itemsize, 4)
    print(f"weights backward -> forward a step, compute dtype {dtype}: sent {sent / 2**20:.2f} MB, planner "
          f"{counted / 2**20:.2f} MB (cost_model.param_counts: the linears and head in it, the rest fp32)")
  print(f"\ntraces of {TRACED_STEPS} steps (jax.profiler, device events): the ms each group runs its own program's "
        "operations, and both groups at once")
  traced = {"FBD 4+4": contenders["FBD 4+4"], "FBD 1+1": _Fbd(config, ONE_AND_ONE, batch),
            "FBD 1+1 serial": _Fbd(config, ONE_AND_ONE, batch, serialized=True)}
  print(f"{'':24}{'forward ms':>12}{'backward ms':>13}{'both at once ms':>17}")
  with tempfile.TemporaryDirectory() as directory:
    for name, contender in traced.items():
      t = traced_overlap(contender, TRACED_STEPS, os.path.join(directory, name.replace(" ", "_")))
      print(f"{'trace ' + name:24}{t['forward_ms']:>12.1f}{t['backward_ms']:>13.1f}{t['both_ms']:>17.1f}")
  print("(XLA:CPU runs programs that hold collectives one at a time, whatever their devices: the groups of FBD 4+4 "
        "never compute at once here; FBD 1+1's programs have none, and the forward of microbatch i + 1 runs under "
        "the backward of i. On GPUs each device runs its own streams.)")
  _planned()


def _planned() -> None:
  """The planner's MegaFBD on a mixed cluster (docs/parallelism.md's worked example)."""
  c = ModelConfig.from_config(load_config(PLANNED["config"]).model)
  forward_hw, backward_hw = (cost_model.HARDWARE[PLANNED[k]] for k in ("forward_hw", "backward_hw"))
  print(f"\nplanner, a mixed cluster ({PLANNED['config']}, batch {PLANNED['batch']}: the forward on "
        f"{PLANNED['forward_gpus']} {forward_hw.name}, the backward on {PLANNED['backward_gpus']} {backward_hw.name}; "
        f"megajax-plan --fbd_forward)")
  for remat in ("full", "dots"):
    best = planner_fbd.search(c, forward_hw, PLANNED["forward_gpus"], backward_hw, PLANNED["backward_gpus"],
                              PLANNED["batch"], remat)[0]
    alone = plans.search(c, PLANNED["backward_gpus"], PLANNED["batch"], backward_hw, remat=remat)[0][0]
    t = best.time
    print(f"  remat {remat}: MegaFBD {t.total:.3f} s ({t.bottleneck}-bound: forward {t.forward:.4f}, transfer "
          f"{t.transfer:.4f}, backward {t.backward:.4f} s a microbatch) against the {backward_hw.name} alone "
          f"{alone.time.total:.3f} s: {alone.time.total / t.total:.2f}x")
