r"""`python -m megajax.launch.bench peer [--rounds=12] [--peer_size=cpu|tiny] [--peer_meshes=8x1x1,...]`:
megajax's 3D step against the step a JAX user writes, side by side on the same devices.

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

The meshes (CASES): dp=8 against jit DP and FSDP; dp=2 x tp=4 against jit Megatron-TP and
TP+FSDP; dp=2 x pp=2 x tp=2 (interleaved 1F1B, 2 chunks per stage, m=4) against the best of
those on 8 devices; pp=2 v=2 on 2 devices against megajax's own dp=2 and jit DP on them.
Each case's contenders are compiled first, from the same initial parameters, then timed step
by step, interleaved (A B C, A B C, ... with the order rotated each round), each on its own
state and the same batch (the synthetic source's first). Printed per contender: the
median tokens/s over the rounds, its ratio to the best peer, its first losses (they must
agree: the same model, data and optimizer), and from its compiled program per device: the
matmul GFLOP one step executes (observe.hlo.executed_dot_flops: loop bodies times their trip
counts, the pipeline's slots by how often its tables pick them), XLA's GFLOP and GB accessed
(cost_analysis, which counts a loop body once: low for the pipeline's tick loop) and every
collective by kind and group size (a group of 1 would be a collective the mesh does not need).

Model and optimizer for every contender: fp32, AdamW (megajax.optim), global-norm clipping,
z-loss; `cpu`: hidden 512, 4 layers, 256 tokens, batch 16: large enough that a step's matmuls,
not its dispatch, take the time on CPU; `tiny` (the CI smoke test): hidden 64, 32 tokens.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from megajax import data
from megajax.config import default_config, validate
from megajax.model import init_params
from megajax.observe.hlo import collectives_by_group_size, executed_dot_flops, pipeline_branch_weights, xla_cost
from megajax.optim import make_optimizer
from megajax.parallel import sharding
from megajax.parallel.mesh import DP, TP
from megajax.reference_step import TrainState, fresh_train_state, make_reference_step
from megajax.trainer import build_model, build_parallel_step

SIZES = {"cpu": dict(hidden_dim=512, num_layers=4, num_heads=8, seq_len=256, batch_size=16),
         "tiny": dict(hidden_dim=64, num_layers=4, num_heads=8, seq_len=32, batch_size=16)}
LOSSES_SHOWN = 3


@dataclasses.dataclass(frozen=True)
class Case:
  """megajax's step on `mesh` (dp, pp, tp) against `peers`: (name, their mesh), on as many
  devices. A jit peer's mesh is (dp, 1, tp); "megajax ..." is megajax's step on that mesh."""
  mesh: tuple[int, int, int]
  peers: tuple[tuple[str, tuple[int, int, int]], ...]


# Every mesh against the plain-jit step a user would pick for its devices; the pipeline
# against the best of 8 devices' and, on 2 devices, against megajax's own dp=2.
CASES = (
    Case((8, 1, 1), (("jit DP", (8, 1, 1)), ("jit FSDP", (8, 1, 1)))),
    Case((2, 1, 4), (("jit Megatron-TP", (2, 1, 4)), ("jit TP+FSDP", (2, 1, 4)))),
    Case((2, 2, 2), (("jit DP", (8, 1, 1)), ("jit Megatron-TP", (2, 1, 4)))),
    Case((1, 2, 1), (("megajax dp=2", (2, 1, 1)), ("jit DP", (2, 1, 1)))),
)


def peer_config(mesh: tuple[int, int, int], size: str = "cpu"):
  """The benchmark's model on `mesh`; pp > 1: interleaved 1F1B, 2 chunks per stage, m = 2p."""
  dp, pp, tp = mesh
  s = SIZES[size]
  c = default_config()
  c.model.hidden_dim, c.model.num_layers, c.model.num_heads = s["hidden_dim"], s["num_layers"], s["num_heads"]
  c.model.num_kv_heads = s["num_heads"] // 2
  c.model.seq_len, c.model.window, c.model.window_pattern = s["seq_len"], s["seq_len"] // 2, "LG"
  c.model.compute_dtype = "float32"
  c.train.batch_size, c.train.microbatches, c.train.z_loss = s["batch_size"], 1, 1e-4
  c.optimizer.name, c.optimizer.warmup_steps = "adamw", 2
  c.parallel.dp, c.parallel.pp, c.parallel.tp = dp, pp, tp
  if pp > 1:
    c.parallel.virtual_stages, c.parallel.schedule, c.train.microbatches = 2, "interleaved_1f1b", 2 * pp
  validate(c)
  return c


def mesh_name(mesh) -> str:
  return "x".join(map(str, mesh))


def peer_layouts(peer: str, model, params_like, dp: int, tp: int):
  """The Layout (megajax.parallel.sharding) of each parameter under `peer`'s annotations (jit
  DP: split over neither)."""
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
  matmul_flops: float   # the matmul FLOPs one step executes per device (loops times their trips)
  times: list = dataclasses.field(default_factory=list)
  losses: list = dataclasses.field(default_factory=list)

  def run_once(self) -> float:
    start = time.perf_counter()
    self.state, metrics = self.step(self.state, self.batch)
    loss = float(metrics["loss"])          # waits for the step
    elapsed = time.perf_counter() - start
    self.losses.append(loss)
    return elapsed


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
  text = compiled.as_text()
  return Contender(peer, compiled, state, batch, text, xla_cost(compiled), executed_dot_flops(text))


def _megajax_contender(name: str, parallel_step, batch_np) -> Contender:
  state = parallel_step.init_state(jax.random.key(0))
  batch = parallel_step.put_batch(batch_np)
  compiled = parallel_step.train_step().lower(state, batch).compile()
  text = compiled.as_text()
  return Contender(name, compiled, state, batch, text, xla_cost(compiled),
                   executed_dot_flops(text, pipeline_branch_weights(parallel_step.pipeline)))


def _contender(name: str, mesh, size: str, params, batch) -> Contender:
  config = peer_config(mesh, size)
  parallel_step = build_parallel_step(config, jax.devices()[:math.prod(mesh)])
  if name.startswith("megajax"):
    return _megajax_contender(name, parallel_step, batch)
  return _jit_contender(name, config, parallel_step, params, batch)


def compare(case: Case, rounds: int, size: str) -> list[Contender]:
  """The case's peers and megajax, compiled, then timed in `rounds` interleaved rounds."""
  config = peer_config(case.mesh, size)
  with jax.default_device(jax.devices()[0]):   # the same initial values as megajax's sharded init
    params = jax.device_get(jax.jit(lambda key: init_params(build_model(config), key))(jax.random.key(0)))
  batch = next(data.make_iterator(config, 0, 1))   # the synthetic source's first global batch
  contenders = [_contender(name, mesh, size, params, batch) for name, mesh in case.peers]
  contenders.append(_contender("megajax", case.mesh, size, params, batch))
  for contender in contenders:          # one untimed step each: first-run allocations, caches
    contender.run_once()
  for r in range(rounds):
    order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
    for contender in order:
      contender.times.append(contender.run_once())
  return contenders


def report(case: Case, size: str, contenders: list[Contender]) -> str:
  config = peer_config(case.mesh, size)
  tokens = config.train.batch_size * config.model.seq_len
  rate = {c.name: tokens / statistics.median(c.times) for c in contenders}
  best_peer = max((c.name for c in contenders if c.name != "megajax"), key=rate.get)
  meshes = dict(case.peers, megajax=case.mesh)
  dp, pp, tp = case.mesh
  m, p = config.model, config.parallel
  pipeline = (f" ({p.schedule}, v={p.virtual_stages}, m={config.train.microbatches})" if pp > 1 else "")
  lines = [f"mesh dp={dp} pp={pp} tp={tp}{pipeline}: hidden {m.hidden_dim}, {m.num_layers} layers, {m.seq_len} "
           f"tokens, batch {config.train.batch_size}, fp32, AdamW; {len(contenders[0].times)} interleaved rounds; "
           f"ratio = tokens/s over the best peer's ({best_peer})",
           f"  {'contender':<16} {'mesh':>6} {'tokens/s':>9} {'ratio':>6} {'matmul':>7} {'GFLOP':>7} {'GB':>7}  "
           f"first losses{'':<18} collectives per device (kind x group size: count)"]
  for c in contenders:
    # losses[0] is the untimed first step's: every contender starts from the same state.
    losses = " ".join(f"{x:.6f}" for x in c.losses[:LOSSES_SHOWN])
    counts = sorted(collectives_by_group_size(c.text, math.prod(case.mesh)).items())
    collectives = ", ".join(f"{kind} x{group}: {n}" for (kind, group), n in counts)
    lines.append(f"  {c.name:<16} {mesh_name(meshes[c.name]):>6} {rate[c.name]:>9.0f} "
                 f"{rate[c.name] / rate[best_peer]:>6.2f} {c.matmul_flops / 1e9:>7.2f} {c.cost['flops'] / 1e9:>7.2f} "
                 f"{c.cost['bytes'] / 1e9:>7.3f}  "
                 f"{losses:<30} {collectives or '-'}")
  first = [c.losses[0] for c in contenders]
  spread = (max(first) - min(first)) / abs(first[0])
  lines.append(f"  first losses agree to {spread:.1e} (relative)")
  return "\n".join(lines)


def peer(rounds: int, size: str = "cpu", meshes: str = "") -> None:
  """meshes: "8x1x1,2x2x2" runs those of CASES (megajax's mesh), "" all."""
  wanted = [m for m in meshes.split(",") if m]
  known = [mesh_name(case.mesh) for case in CASES]
  if any(m not in known for m in wanted):
    raise SystemExit(f"bench peer: --peer_meshes={meshes}: each one of {','.join(known)}")
  print(f"bench peer: megajax's 3D step vs jax.jit + GSPMD over the same model ({jax.devices()[0].platform}, "
        f"{len(jax.devices())} devices)")
  for case in CASES:
    if not wanted or mesh_name(case.mesh) in wanted:
      print(report(case, size, compare(case, rounds, size)), flush=True)
