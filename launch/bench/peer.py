r"""`python -m megajax.launch.bench peer [--rounds=12] [--peer_size=cpu|tiny]`: megajax's 3D step
against the step a JAX user writes, side by side on the same devices.

The peers: `jax.jit(value_and_grad + optax)` over the same Flax model (the single-device
reference step, megajax.reference_step, whose math the 3D step is tested equal to), its
parameters and optimizer state placed with sharding annotations and left to XLA's SPMD
partitioner (GSPMD), the batch split over dp:

  jit DP            every parameter whole on every device
  jit FSDP          each parameter split over dp on its largest dimension (ZeRO-3 style)
  jit Megatron-TP   each parameter split over tp on its tensor-parallel logical axis (heads,
                    kv_heads, mlp, vocab: megajax.parallel.sharding.TENSOR_PARALLEL_AXES),
                    whole over dp
  jit TP+FSDP       both: tp as above, then dp on the largest remaining dimension

Each mesh runs the peers that use it and megajax's step; all are compiled first, from the same
initial parameters, then timed step by step, interleaved (A B C, A B C, ... with the order
rotated each round), each on its own state and the same batch. Printed per contender: the
median tokens/s over the rounds, its ratio to the best peer, its first losses (they must
agree: the same model, data and optimizer), and from its compiled program per device: GFLOP
and GB accessed (XLA's cost_analysis) and every collective by kind and group size (a group of
1 is a collective the mesh does not need).

Model and optimizer for every contender: fp32, AdamW (megajax.optim), global-norm clipping,
z-loss; `cpu`: hidden 512, 4 layers, 256 tokens, batch 16: large enough that a step's matmuls,
not its dispatch, take the time on CPU; `tiny` (the CI smoke test): hidden 64, 2 layers.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from megajax.config import default_config, validate
from megajax.model import init_params
from megajax.observe.hlo import collectives_by_group_size
from megajax.optim import make_optimizer
from megajax.parallel import sharding
from megajax.parallel.mesh import DP, TP
from megajax.reference_step import TrainState, fresh_train_state, make_reference_step
from megajax.trainer import build_parallel_step

# (dp, tp) -> the peers that use such a mesh.
MESHES = {(8, 1): ("jit DP", "jit FSDP"), (2, 4): ("jit Megatron-TP", "jit TP+FSDP")}
SIZES = {"cpu": dict(hidden_dim=512, num_layers=4, num_heads=8, seq_len=256, batch_size=16),
         "tiny": dict(hidden_dim=64, num_layers=2, num_heads=8, seq_len=32, batch_size=8)}
LOSSES_SHOWN = 3


def peer_config(dp: int, tp: int, size: str = "cpu"):
  s = SIZES[size]
  c = default_config()
  c.model.hidden_dim, c.model.num_layers, c.model.num_heads = s["hidden_dim"], s["num_layers"], s["num_heads"]
  c.model.num_kv_heads = s["num_heads"] // 2
  c.model.seq_len, c.model.window, c.model.window_pattern = s["seq_len"], s["seq_len"] // 2, "LG"
  c.model.compute_dtype = "float32"
  c.train.batch_size, c.train.microbatches, c.train.z_loss = s["batch_size"], 1, 1e-4
  c.optimizer.name, c.optimizer.warmup_steps = "adamw", 2
  c.parallel.dp, c.parallel.pp, c.parallel.tp = dp, 1, tp
  validate(c)
  return c


def peer_layouts(peer: str, model, params_like, dp: int, tp: int):
  """The Layout (megajax.parallel.sharding) of each parameter under `peer`'s annotations."""
  if peer == "jit DP":
    return jax.tree.map(lambda _: sharding.Layout(None, None), params_like)
  split_dp = dp if peer in ("jit FSDP", "jit TP+FSDP") else 1
  split_tp = tp if peer in ("jit Megatron-TP", "jit TP+FSDP") else 1
  return sharding.param_layouts(model, params_like, split_dp, split_tp)


@dataclasses.dataclass
class Contender:
  name: str
  step: object          # compiled: (state, batch) -> (state, metrics), the state donated
  state: TrainState
  batch: dict
  text: str             # its compiled HLO
  cost: dict            # cost_analysis: flops, bytes accessed (per device)
  times: list = dataclasses.field(default_factory=list)
  losses: list = dataclasses.field(default_factory=list)

  def run_once(self) -> float:
    start = time.perf_counter()
    self.state, metrics = self.step(self.state, self.batch)
    loss = float(metrics["loss"])          # waits for the step
    elapsed = time.perf_counter() - start
    self.losses.append(loss)
    return elapsed


def _cost(compiled) -> dict:
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost    # (a list on older jax)
  return {"flops": float(cost.get("flops", 0.0)), "bytes": float(cost.get("bytes accessed", 0.0))}


def _jit_contender(peer: str, config, parallel_step, params, batch_np) -> Contender:
  mesh, model = parallel_step.mesh, parallel_step.model
  layouts = peer_layouts(peer, model, params, mesh.shape[DP], mesh.shape[TP])
  optimizer = make_optimizer(config)
  specs = sharding.param_specs(layouts, params)
  state_specs = TrainState(step=P(), params=specs, opt_state=sharding.optimizer_specs(optimizer, params, specs))
  state_shardings = sharding.named(mesh, state_specs)
  rows = NamedSharding(mesh, P(DP))
  state = jax.device_put(fresh_train_state(params, optimizer), state_shardings)
  batch = {k: jax.device_put(v, rows) for k, v in batch_np.items()}
  step = jax.jit(make_reference_step(model, optimizer, config), in_shardings=(state_shardings, rows),
                 out_shardings=(state_shardings, NamedSharding(mesh, P())), donate_argnums=0)
  compiled = step.lower(state, batch).compile()
  return Contender(peer, compiled, state, batch, compiled.as_text(), _cost(compiled))


def _megajax_contender(parallel_step, batch_np) -> Contender:
  state = parallel_step.init_state(jax.random.key(0))
  batch = parallel_step.put_batch(batch_np)
  compiled = parallel_step.train_step().lower(state, batch).compile()
  return Contender("megajax", compiled, state, batch, compiled.as_text(), _cost(compiled))


def _batch(config) -> dict:
  rng = np.random.default_rng(0)
  shape = (config.train.batch_size, config.model.seq_len)
  tokens = rng.integers(0, config.model.vocab_size, (shape[0], shape[1] + 1)).astype(np.int32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": np.ones(shape, np.float32)}


def compare_on_mesh(dp: int, tp: int, rounds: int, size: str) -> list[Contender]:
  """The mesh's peers and megajax, compiled, then timed in `rounds` interleaved rounds."""
  config = peer_config(dp, tp, size)
  parallel_step = build_parallel_step(config, jax.devices()[:dp * tp])
  with jax.default_device(jax.devices()[0]):   # the same initial values as megajax's sharded init
    params = jax.device_get(jax.jit(lambda key: init_params(parallel_step.model, key))(jax.random.key(0)))
  batch = _batch(config)
  contenders = [_jit_contender(peer, config, parallel_step, params, batch) for peer in MESHES[(dp, tp)]]
  contenders.append(_megajax_contender(parallel_step, batch))
  for contender in contenders:          # one untimed step each: first-run allocations, caches
    contender.run_once()
  for r in range(rounds):
    order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
    for contender in order:
      contender.times.append(contender.run_once())
  return contenders


def report(dp: int, tp: int, size: str, contenders: list[Contender]) -> str:
  config = peer_config(dp, tp, size)
  tokens = config.train.batch_size * config.model.seq_len
  rate = {c.name: tokens / statistics.median(c.times) for c in contenders}
  best_peer = max((c.name for c in contenders if c.name != "megajax"), key=rate.get)
  m = config.model
  lines = [f"mesh dp={dp} pp=1 tp={tp}: hidden {m.hidden_dim}, {m.num_layers} layers, {m.seq_len} tokens, batch "
           f"{config.train.batch_size}, fp32, AdamW; {len(contenders[0].times)} interleaved rounds; ratio = tokens/s "
           f"over the best peer's ({best_peer})",
           f"  {'contender':<16} {'tokens/s':>10} {'ratio':>6} {'GFLOP':>8} {'GB':>7}  first losses{'':<18} "
           "collectives per device (kind x group size: count)"]
  for c in contenders:
    # losses[0] is the untimed first step's: every contender starts from the same state.
    losses = " ".join(f"{x:.6f}" for x in c.losses[:LOSSES_SHOWN])
    collectives = ", ".join(f"{kind} x{size}: {n}" for (kind, size), n in sorted(collectives_by_group_size(c.text, dp * tp).items()))
    lines.append(f"  {c.name:<16} {rate[c.name]:>10.0f} {rate[c.name] / rate[best_peer]:>6.2f} "
                 f"{c.cost['flops'] / 1e9:>8.2f} {c.cost['bytes'] / 1e9:>7.3f}  {losses:<30} {collectives or '-'}")
  first = [c.losses[0] for c in contenders]
  spread = (max(first) - min(first)) / abs(first[0])
  lines.append(f"  first losses agree to {spread:.1e} (relative)")
  return "\n".join(lines)


def peer(rounds: int, size: str = "cpu") -> None:
  print(f"bench peer: megajax's 3D step vs jax.jit + GSPMD over the same model ({jax.devices()[0].platform}, "
        f"{len(jax.devices())} devices)")
  for dp, tp in MESHES:
    contenders = compare_on_mesh(dp, tp, rounds, size)
    print(report(dp, tp, size, contenders), flush=True)
