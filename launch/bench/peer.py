r"""`python -m megajax.launch.bench peer [--rounds=12] [--peer_size=cpu|tiny] [--peer_meshes=8x1x1,...]
[--compile_for=h100-80g]`: megajax's 3D step against the step a JAX user writes, side by side.

The peers: `jax.jit(value_and_grad + optax)` over the same Flax model (the single-device
reference step, megajax.reference_step, whose math the 3D step is tested equal to), its
parameters and optimizer state placed with sharding annotations and left to XLA's SPMD
partitioner (GSPMD), the batch split over dp:

  jit DP            every parameter whole on every device
  jit FSDP          each parameter split over dp (ZeRO-3 style) on the dimension megajax's
                    ZeRO splits (megajax.parallel.sharding: the first that dp divides; on the
                    largest one, GSPMD moved 2.7x the bytes, 3.96 vs 1.49 GB a device at dp=8,
                    and ran at 0.75 of jit DP)
  jit Megatron-TP   each parameter split over tp on its tensor-parallel logical axis (heads,
                    kv_heads, mlp, vocab: megajax.parallel.sharding.TENSOR_PARALLEL_AXES),
                    whole over dp
  jit TP+FSDP       both: tp as above, then dp as ZeRO splits the tp shard

The meshes (CASES): dp=8 against jit DP and FSDP; dp=2 x tp=4 against jit Megatron-TP and
TP+FSDP; dp=2 x pp=2 x tp=2 (interleaved 1F1B, 2 chunks per stage, m=4) against jit DP, FSDP
and Megatron-TP on 8 devices; pp=2 v=2 on 2 devices against megajax's own dp=2 and jit DP on them.
Each case's contenders are compiled first, from the same initial parameters, then timed step
by step, interleaved (A B C, A B C, ... with the order rotated each round), each on its own
state and the same batch (the synthetic source's first). Printed per contender: the
median tokens/s over the rounds, its ratio to the best peer, its first losses (they must
agree: the same model, data and optimizer), and from its compiled program per device: the
matmul GFLOP one step executes (observe.hlo.executed_dot_flops: loop bodies times their trip
counts, the pipeline's slots by how often its tables pick them), XLA's GFLOP and GB accessed
(cost_analysis, which counts a loop body once: low for the pipeline's tick loop), the MB its
copies, transposes and concatenations write a step (observe.hlo.executed_relayout_bytes: data
moved for no FLOP, loops counted as for the matmuls) and every collective by kind and group size
(a group of 1 would be a collective the mesh does not need).

Model and optimizer for every contender: fp32, AdamW (megajax.optim), global-norm clipping,
z-loss; `cpu`: hidden 512, 4 layers, 256 tokens, batch 16: large enough that a step's matmuls,
not its dispatch, take the time on CPU; `tiny` (the CI smoke test): hidden 64, 32 tokens.

`--compile_for=h100-80g` (or h200-141g): no contender runs; each is compiled by XLA's GPU
compiler for as many described GPUs as its mesh has (megajax.parallel.deviceless), in bf16
with cuDNN attention as a GPU run would, and the table gives per device XLA's bytes
(memory_analysis), every collective by kind and group size, and per kind and mesh axis how
many asynchronous collectives the latency-hiding scheduler left with compute between their
start and done. What a GPU compile proves and cannot (speed): docs/deviceless.md.
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
from megajax.observe.hlo import (collectives_by_group_size, executed_dot_flops, executed_relayout_bytes,
                                 pipeline_branch_weights, xla_cost)
from megajax.observe.schedule import overlap_counts
from megajax.optim import make_optimizer
from megajax.parallel import deviceless, sharding
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

  @property
  def meshes(self) -> dict:
    """Each contender's name -> its mesh, megajax's included."""
    return dict(self.peers, megajax=self.mesh)


# Every mesh against the plain-jit step a user would pick for its devices; the pipeline
# against the best of 8 devices' and, on 2 devices, against megajax's own dp=2.
CASES = (
    Case((8, 1, 1), (("jit DP", (8, 1, 1)), ("jit FSDP", (8, 1, 1)))),
    Case((2, 1, 4), (("jit Megatron-TP", (2, 1, 4)), ("jit TP+FSDP", (2, 1, 4)))),
    Case((2, 2, 2), (("jit DP", (8, 1, 1)), ("jit FSDP", (8, 1, 1)), ("jit Megatron-TP", (2, 1, 4)))),
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
  copied_bytes: float   # bytes its copies, transposes and concatenations write per device and step
  times: list = dataclasses.field(default_factory=list)
  losses: list = dataclasses.field(default_factory=list)

  def run_once(self) -> float:
    start = time.perf_counter()
    self.state, metrics = self.step(self.state, self.batch)
    loss = float(metrics["loss"])          # waits for the step
    elapsed = time.perf_counter() - start
    self.losses.append(loss)
    return elapsed


def _jit_step(peer: str, config, parallel_step, params_like):
  """(`peer`'s jitted step on parallel_step's mesh, its optimizer, the state's shardings, the
  batch's): the reference step with the peer's sharding annotations, left to GSPMD."""
  mesh, model = parallel_step.mesh, parallel_step.model
  layouts = peer_layouts(peer, model, params_like, mesh.shape[DP], mesh.shape[TP])
  optimizer = make_optimizer(config.optimizer, config.train.steps)
  specs = sharding.param_specs(layouts, params_like)
  state_specs = TrainState(step=P(), params=specs, opt_state=sharding.optimizer_specs(optimizer, params_like, specs))
  state_shardings = sharding.named(mesh, state_specs)
  rows = NamedSharding(mesh, P(DP))
  step = jax.jit(make_reference_step(model, optimizer, config), in_shardings=(state_shardings, rows),
                 out_shardings=(state_shardings, NamedSharding(mesh, P())), donate_argnums=0)
  return step, optimizer, state_shardings, rows


def _jit_contender(peer: str, config, parallel_step, params, batch_np) -> Contender:
  step, optimizer, state_shardings, rows = _jit_step(peer, config, parallel_step, params)
  state = jax.device_put(fresh_train_state(params, optimizer), state_shardings)
  batch = {k: jax.device_put(v, rows) for k, v in batch_np.items()}
  compiled = step.lower(state, batch).compile()
  text = compiled.as_text()
  return Contender(peer, compiled, state, batch, text, xla_cost(compiled), executed_dot_flops(text),
                   sum(executed_relayout_bytes(text).values()))


def _megajax_contender(name: str, parallel_step, batch_np) -> Contender:
  state = parallel_step.init_state(jax.random.key(0))
  batch = parallel_step.put_batch(batch_np)
  compiled = parallel_step.train_step().lower(state, batch).compile()
  text = compiled.as_text()
  weights = pipeline_branch_weights(parallel_step.pipeline)
  return Contender(name, compiled, state, batch, text, xla_cost(compiled), executed_dot_flops(text, weights),
                   sum(executed_relayout_bytes(text, weights).values()))


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


def case_heading(case: Case, config) -> str:
  """The mesh (and the pipeline's schedule) and the model's shape, the first words of a table."""
  dp, pp, tp = case.mesh
  m, p = config.model, config.parallel
  pipeline = (f" ({p.schedule}, v={p.virtual_stages}, m={config.train.microbatches})" if pp > 1 else "")
  return (f"mesh dp={dp} pp={pp} tp={tp}{pipeline}: hidden {m.hidden_dim}, {m.num_layers} layers, {m.seq_len} "
          f"tokens, batch {config.train.batch_size}")


def collectives_column(text: str, devices: int) -> str:
  """A compiled program's collectives by kind and group size: "all-gather x8: 15, ..."."""
  counts = sorted(collectives_by_group_size(text, devices).items())
  return ", ".join(f"{kind} x{group}: {n}" for (kind, group), n in counts)


def comparison_table(case: Case, size: str, contenders: list[Contender]) -> str:
  config = peer_config(case.mesh, size)
  tokens = config.train.batch_size * config.model.seq_len
  rate = {c.name: tokens / statistics.median(c.times) for c in contenders}
  best_peer = max((c.name for c in contenders if c.name != "megajax"), key=rate.get)
  lines = [f"{case_heading(case, config)}, fp32, AdamW; {len(contenders[0].times)} interleaved rounds; "
           f"ratio = tokens/s over the best peer's ({best_peer})",
           f"  {'contender':<16} {'mesh':>6} {'tokens/s':>9} {'ratio':>6} {'matmul':>7} {'GFLOP':>7} {'GB':>7} {'copy MB':>8}  "
           f"first losses{'':<18} collectives per device (kind x group size: count)"]
  for c in contenders:
    # losses[0] is the untimed first step's: every contender starts from the same state.
    losses = " ".join(f"{x:.6f}" for x in c.losses[:LOSSES_SHOWN])
    collectives = collectives_column(c.text, math.prod(case.mesh))
    lines.append(f"  {c.name:<16} {mesh_name(case.meshes[c.name]):>6} {rate[c.name]:>9.0f} "
                 f"{rate[c.name] / rate[best_peer]:>6.2f} {c.matmul_flops / 1e9:>7.2f} {c.cost['flops'] / 1e9:>7.2f} "
                 f"{c.cost['bytes'] / 1e9:>7.3f} {c.copied_bytes / 1e6:>8.1f}  "
                 f"{losses:<30} {collectives or '-'}")
  first = [c.losses[0] for c in contenders]
  spread = (max(first) - min(first)) / abs(first[0])
  lines.append(f"  first losses agree to {spread:.1e} (relative)")
  return "\n".join(lines)


# --- The same contenders compiled for described GPUs (no GPU: megajax.parallel.deviceless).

@dataclasses.dataclass
class GpuContender:
  name: str
  mesh: object                # the jax Mesh it was compiled over (its axes name the collectives' groups)
  compiled: object            # runs nowhere
  compile_seconds: float


def gpu_peer_config(mesh: tuple[int, int, int], size: str = "cpu"):
  """peer_config with what a GPU run would use: bf16 matmuls, cuDNN's fused attention (the
  Flax reference's and megajax's alike); megajax's own GPU defaults resolve on the platform
  (collective matmul, the pipeline's backward from kept residuals)."""
  c = peer_config(mesh, size)
  c.model.compute_dtype, c.model.attention_impl = "bfloat16", "cudnn"
  validate(c)
  return c


def _gpu_contender(name: str, mesh, size: str, target: str) -> GpuContender:
  config = gpu_peer_config(mesh, size)
  if name.startswith("megajax"):
    result = deviceless.compile_for_gpu(config, target)
    return GpuContender(name, result.step.mesh, result.compiled, result.compile_seconds)
  with deviceless.cudnn_as(target):
    parallel_step = deviceless.parallel_step_for_gpu(config, target)
    params = jax.eval_shape(lambda: init_params(parallel_step.model, jax.random.key(0)))
    step, optimizer, state_shardings, _ = _jit_step(name, config, parallel_step, params)
    state = jax.tree.map(lambda x, placed: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placed),
                         jax.eval_shape(lambda p: fresh_train_state(p, optimizer), params), state_shardings)
    # The batch as megajax's step takes it: rows split over dp, as the peer's step takes it too.
    compiled, seconds = deviceless.compile_lowered(step.lower(state, parallel_step.abstract_batch()))
  return GpuContender(name, parallel_step.mesh, compiled, seconds)


def gpu_table(case: Case, size: str, target: str) -> str:
  """The case's contenders compiled for described GPUs: per device XLA's bytes
  (memory_analysis), every collective by kind and group size, and how many of each kind (and
  mesh axis) the latency-hiding scheduler left with compute between start and done."""
  config = gpu_peer_config(case.mesh, size)
  contenders = [_gpu_contender(name, mesh, size, target) for name, mesh in case.peers]
  contenders.append(_gpu_contender("megajax", case.mesh, size, target))
  lines = [f"{case_heading(case, config)}, bf16 matmuls, cuDNN attention, AdamW; compiled for "
           f"{math.prod(case.mesh)} described {target} (nothing runs: no tokens/s)",
           f"  {'contender':<16} {'mesh':>6} {'compile s':>9} {'MiB':>8}  collectives per device (kind x group size: "
           f"count); async ones with compute between start and done / all (kind, mesh axis)"]
  for c in contenders:
    text = c.compiled.as_text()
    collectives = collectives_column(text, math.prod(case.mesh)) or "-"
    overlap = ", ".join(f"{kind} {axis} {done}/{total}" for (kind, axis), (done, total)
                        in sorted(overlap_counts(text, c.mesh).items()))
    lines.append(f"  {c.name:<16} {mesh_name(case.meshes[c.name]):>6} {c.compile_seconds:>9.1f} "
                 f"{deviceless.bytes_per_device(c.compiled) / 2**20:>8.1f}  {collectives}; {overlap or '-'}")
  return "\n".join(lines)


def peer(rounds: int, size: str = "cpu", meshes: str = "", compile_for: str = "") -> None:
  """meshes: "8x1x1,2x2x2" runs those of CASES (megajax's mesh), "" all. compile_for: a
  deviceless GPU target (megajax.parallel.deviceless.GPU_TARGETS): the contenders compiled for
  it instead of run here."""
  wanted = [m for m in meshes.split(",") if m]
  known = [mesh_name(case.mesh) for case in CASES]
  if any(m not in known for m in wanted):
    raise SystemExit(f"bench peer: --peer_meshes={meshes}: each one of {','.join(known)}")
  if compile_for and compile_for not in deviceless.GPU_TARGETS:
    raise SystemExit(f"bench peer: --compile_for={compile_for}: one of {', '.join(deviceless.GPU_TARGETS)}")
  cases = [case for case in CASES if not wanted or mesh_name(case.mesh) in wanted]
  if compile_for:
    print(f"bench peer: megajax's 3D step vs jax.jit + GSPMD over the same model, compiled for {compile_for} "
          f"GPUs on this machine (XLA's GPU compiler, deviceless)")
    for case in cases:
      print(gpu_table(case, size, compile_for), flush=True)
    return
  print(f"bench peer: megajax's 3D step vs jax.jit + GSPMD over the same model ({jax.devices()[0].platform}, "
        f"{len(jax.devices())} devices)")
  for case in cases:
    print(comparison_table(case, size, compare(case, rounds, size)), flush=True)
