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
backward (memory.fbd_residual_bytes): jax.vjp keeps more than the memory model counts.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from megajax.config import default_config
from megajax.launch.bench.timing import median_seconds
from megajax.launch.bench.train import CompiledStep
from megajax.model import GPT, ModelConfig, init_params
from megajax.parallel.deviceless import bytes_per_device
from megajax.parallel.fbd import FbdStep
from megajax.parallel.planner import memory
from megajax.parallel.planner.fits import plan_of
from megajax.reference_step import fresh_train_state

SIZES = {"cpu": dict(hidden=256, layers=4, heads=8, seq=128, batch=16, microbatches=4),
         "tiny": dict(hidden=32, layers=2, heads=4, seq=16, batch=8, microbatches=2)}
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
    self.serialized = serialized
    f_devices, f_dp, f_tp, b_dp, b_tp = split
    devices = jax.devices()
    model = GPT(ModelConfig.from_config(config.model))
    params = init_params(model, jax.random.key(0))
    self.step = FbdStep.build(config, model, devices[:f_devices], devices[f_devices:f_devices + b_dp * b_tp],
                              f_dp, f_tp, b_dp, b_tp, params)
    self.state = self.step.place_state(jax.jit(fresh_train_state, static_argnums=1)(params, self.step.optimizer))
    self.batch = batch
    self.traffic = self.step.traffic(self.state, batch)

  def run(self) -> dict:
    self.state, metrics = self.step.train_step(self.state, self.batch, serialized=self.serialized)
    return jax.block_until_ready(metrics)


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
  for remat in ("none", "dots", "full"):
    c = _config(size)
    c.model.remat = remat
    sent = _Fbd(c, SPLITS["FBD 4+4"], batch).traffic["residual_bytes"]
    plan = dataclasses.replace(plan_of(c, "cpu"), micro_batch=c.train.batch_size // c.train.microbatches)
    counted = memory.fbd_residual_bytes(ModelConfig.from_config(c.model), plan)
    print(f"{remat:>8}{sent / 2**20:>10.2f}{counted / 2**20:>10.2f}{sent / counted:>8.2f}")
  print("planner: no MegaFBD plans yet (its search, the transfer's time and mixed clusters are issue 36's next)")
