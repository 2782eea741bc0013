"""MegaFBD (MegatronApp section 4): the forward and the backward of training on separate device
groups, each with its own data x tensor parallel degrees, inside one process.

  forward group    receives the weights in the compute dtype once per step; per microbatch
                   runs the model's forward and keeps what its backward needs (`jax.vjp`'s
                   residuals: the activations under the model's remat policy, the weights the
                   matmuls read), and sends those residuals on, but for the weights (the
                   backward group holds the very same arrays: it sent them)
  backward group   holds the fp32 master weights and the optimizer state, ZeRO-split over its
                   dp; per microbatch runs the backward from the residuals it receives and adds
                   the gradients, reduce-scattered over its dp, to the step's sum; then the
                   optimizer (the reference step's update, megajax.reference_step.apply_gradients,
                   skipped on a non-finite loss or norm as the 3D step skips it) and the new
                   weights, cast, to the forward group

Each group is a mesh (dp, 1, tp) of its own devices; its programs are jitted with the
parameters placed as Megatron's tensor parallelism splits them over that group's tp
(megajax.parallel.sharding's layouts; the backward group's state also 1/dp, ZeRO), the batch's
rows split over its dp, and XLA's SPMD partitioner inserts the group's collectives. A residual
moves between the groups with `jax.device_put` onto the receiving mesh, under the same partition
spec where its dimensions divide, else whole: the two groups' tp may differ. The programs of the
two groups run on disjoint devices and are dispatched asynchronously, so the forward of
microbatch i + 1 runs while the backward of microbatch i does (each send is ordered by the data it
carries: nothing waits for the other group's next program, no deadlock).

The trainer runs FbdStep as it runs the 3D step (parallel.fbd.enabled; the same state, so a
checkpoint moves between the two): `FbdStep.from_config`, `put_batch`, `init_state`,
`compiled_train_step`, `compiled_eval_step` (held-out loss on the forward group).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import ml_collections
import numpy as np
import optax

from megajax.config import ConfigError
from megajax.model import GPT, count_params, init_params
from megajax.optim import learning_rate_schedule, make_optimizer
from megajax.parallel import sharding, zero
from megajax.parallel.deviceless import bytes_per_device
from megajax.parallel.mesh import AXIS_TYPES, DP, MESH_AXES
from megajax.reference_step import TrainState, apply_gradients, fresh_train_state, make_loss_sums_fn
from megajax.sections import RunConfig
from megajax.sections import TrainSection


def group_mesh(devices, dp: int, tp: int) -> Mesh:
  """A device group's mesh: (dp, 1, 1, tp) over `devices` (dp * tp of them): no pipeline, no cp."""
  if len(devices) != dp * tp:
    raise ValueError(f"a group of {len(devices)} device(s) cannot be dp={dp} x tp={tp}")
  return Mesh(np.asarray(devices).reshape(dp, 1, 1, tp), MESH_AXES, axis_types=AXIS_TYPES)


def _on(mesh: Mesh, array) -> NamedSharding:
  """`array`'s partition spec on `mesh` where each split dimension divides there, else whole."""
  spec = getattr(array.sharding, "spec", P())
  for dim, axes in enumerate(spec):
    names = axes if isinstance(axes, tuple) else (axes,) if axes else ()
    ways = int(np.prod([mesh.shape[a] for a in names])) if names else 1
    if array.shape[dim] % ways:
      return NamedSharding(mesh, P())
  return NamedSharding(mesh, spec)


def send(tree, mesh: Mesh):
  """`tree`'s arrays onto `mesh`'s devices (device to device; asynchronous like any dispatch)."""
  leaves, treedef = jax.tree.flatten(tree)
  return jax.tree.unflatten(treedef, jax.device_put(leaves, [_on(mesh, leaf) for leaf in leaves]))


def to_compute_dtype(params, dtype):
  """The weights as the forward reads them: the leaves whose every use casts them to the compute
  dtype first (zero.gathers_in_compute_dtype: the blocks' linears, the head) cast, the rest
  (embedding, norms) fp32. Half the bytes to send; the gradients w.r.t. them, made fp32 again,
  are the reference's (the transpose of a cast is the cast back)."""
  def cast(path, leaf):
    keys = tuple(getattr(k, "key", str(k)) for k in path)
    return leaf.astype(dtype) if zero.gathers_in_compute_dtype(keys) else leaf
  return jax.tree_util.tree_map_with_path(cast, params)


def _abstract(tree, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


@dataclasses.dataclass
class FbdStep:
  """The decoupled step: `train_step()(state, batch) -> (state, metrics)` with the state on the
  backward group and the batch on the forward group (put_batch). It keeps the run's train
  section and what it derives from the rest, not the config."""
  train: TrainSection
  packs_documents: bool        # batches carry positions and segment_ids (data.packs_documents)
  learning_rate: Any           # optax's update count -> the learning rate
  model: GPT
  forward_mesh: Mesh
  backward_mesh: Mesh
  optimizer: optax.GradientTransformation
  forward_specs: Any           # the weights on the forward group: split over its tp
  weight_specs: Any            # the weights in the compute dtype on the backward group: its tp, whole over dp
  state_specs: TrainState      # the state on the backward group: its tp, and ZeRO over its dp
  pipeline = None              # (the trainer's view of a step: no pipeline)

  @classmethod
  def from_config(cls, config: RunConfig | ml_collections.ConfigDict, model: GPT, devices) -> "FbdStep":
    """parallel.fbd's groups over `devices`: the first forward_dp * forward_tp of them forward,
    the rest (parallel.dp * parallel.tp) backward. ConfigError (one line) where it cannot run."""
    run = RunConfig.of(config)
    p, f = run.parallel, run.parallel.fbd
    devices = list(devices)
    if jax.process_count() > 1:
      raise ConfigError("parallel.fbd.enabled", True,
                        f"MegaFBD runs in one process, this job has {jax.process_count()}: its groups exchange "
                        "residuals and weights with jax.device_put, which megajax uses between one process's devices "
                        "only", "run it on one host (one process), or set parallel.fbd.enabled=False")
    if len(devices) != p.device_count:
      raise ConfigError("parallel.fbd", f"forward {f.forward_dp}x{f.forward_tp} + backward {p.dp}x{p.tp}",
                        f"the two groups need {p.device_count} devices, the job has {len(devices)}",
                        "choose forward_dp * forward_tp + parallel.dp * parallel.tp = "
                        f"{len(devices)} (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count="
                        f"{p.device_count})")
    split = f.forward_dp * f.forward_tp
    return cls.build(run, model, devices[:split], devices[split:], f.forward_dp, f.forward_tp, p.dp, p.tp)

  @classmethod
  def build(cls, config: RunConfig | ml_collections.ConfigDict, model: GPT, forward_devices, backward_devices,
            forward_dp: int, forward_tp: int, backward_dp: int, backward_tp: int) -> "FbdStep":
    run = RunConfig.of(config)
    forward_mesh = group_mesh(forward_devices, forward_dp, forward_tp)
    backward_mesh = group_mesh(backward_devices, backward_dp, backward_tp)
    params_like = jax.eval_shape(lambda: init_params(model, jax.random.key(0)))
    # jit over global arrays: a leaf's norm is its whole tensor's (the layouts of one device, no
    # collective); the 3D step's optimizer, so that the two states (and checkpoints) are alike.
    optimizer = make_optimizer(run.optimizer, run.train.steps,
                               sharding.tensor_norms(sharding.param_layouts(model, params_like, 1, 1)))
    specs = lambda dp, tp: sharding.param_specs(sharding.param_layouts(model, params_like, dp, tp), params_like)
    master = specs(backward_dp, backward_tp)
    state_specs = TrainState(step=P(), params=master,
                             opt_state=sharding.optimizer_specs(optimizer, params_like, master))
    return cls(run.train, run.data.packs_documents, learning_rate_schedule(run.optimizer, run.train.steps), model,
               forward_mesh, backward_mesh, optimizer, specs(1, forward_tp), specs(1, backward_tp),
               state_specs)

  def __post_init__(self):
    f, b = self.forward_mesh, self.backward_mesh
    loss_sums = make_loss_sums_fn(self.model, self.train.z_loss)
    eval_sums = make_loss_sums_fn(self.model, 0.0)
    whole_b = NamedSharding(b, P())
    self.batch_sharding = NamedSharding(f, P(None, DP))    # [microbatches, rows, ...]: rows over dp
    self.state_shardings = sharding.named(b, self.state_specs)
    master = sharding.named(b, self.state_specs.params)
    self._forward_weights = sharding.named(f, self.forward_specs)
    self._backward_weights = sharding.named(b, self.weight_specs)

    def forward(weights, batch, i):
      """(the loss's sums, the residuals the backward needs) of microbatch i: jax.vjp's pullback
      is a pytree of arrays; those that are the weights themselves are not sent (the backward
      group holds them): their places are kept (at trace time) for `backward` to fill in."""
      microbatch = jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, i, keepdims=False), batch)
      _, pullback, stats = jax.vjp(lambda w: loss_sums(w, microbatch), weights, has_aux=True)
      leaves, structure = jax.tree.flatten(pullback)
      held = {id(w): k for k, w in enumerate(jax.tree.leaves(weights))}
      self._residual_layout = (structure, tuple(held.get(id(leaf)) for leaf in leaves))
      return stats, [leaf for leaf in leaves if id(leaf) not in held]

    def backward(residuals, weights, summed):
      structure, places = self._residual_layout
      held, sent = jax.tree.leaves(weights), iter(residuals)
      pullback = jax.tree.unflatten(structure, [next(sent) if k is None else held[k] for k in places])
      (grads,) = pullback(jnp.ones((), jnp.float32))
      return jax.tree.map(lambda s, g: s + g.astype(s.dtype), summed, grads)

    def update(state, summed, microbatch_stats):
      stats = functools.reduce(lambda a, b: jax.tree.map(jnp.add, a, b), microbatch_stats)   # in microbatch order
      new_state, metrics, grads = apply_gradients(self.optimizer, self.learning_rate, state, summed, stats)
      # The 3D step's rule: a non-finite loss, norm or learning rate leaves the state as it was.
      finite = (jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
                & jnp.isfinite(metrics["learning_rate"]))
      new_state = jax.tree.map(functools.partial(jnp.where, finite), new_state, state)
      return new_state, {**metrics, "skipped": 1 - finite.astype(jnp.int32)}, grads

    def evaluate(weights, batch):
      def one(sums, microbatch):
        _, stats = eval_sums(weights, microbatch)
        return {k: sums[k] + stats[k] for k in sums}, None
      zero = jnp.zeros((), jnp.float32)
      sums, _ = lax.scan(one, {"nll_sum": zero, "tokens": zero}, batch)
      return {"eval_loss_sum": sums["nll_sum"], "eval_tokens": sums["tokens"]}

    dtype = self.model.config.compute_dtype
    self._weights = jax.jit(lambda params: to_compute_dtype(params, dtype), out_shardings=self._backward_weights)
    self._forward = jax.jit(forward, in_shardings=(self._forward_weights, self.batch_sharding, None))
    self._backward = jax.jit(backward, out_shardings=master, donate_argnums=2)
    self._update = jax.jit(update, in_shardings=(self.state_shardings, master, whole_b),
                           out_shardings=(self.state_shardings, whole_b, master), donate_argnums=(0, 1))
    self._zeros = jax.jit(lambda params: jax.tree.map(jnp.zeros_like, params), out_shardings=master)
    self._eval = jax.jit(evaluate, in_shardings=(self._forward_weights, self.batch_sharding),
                         out_shardings=NamedSharding(f, P()))

  # --- What the trainer reads of a step (megajax.parallel.ParallelStep's names).

  @property
  def mesh(self) -> Mesh:
    """The backward group's: where the state lives (checkpoints, restores, heartbeat)."""
    return self.backward_mesh

  @property
  def devices(self) -> list:
    """Every device of the step, forward group first (what MFU divides by)."""
    return [*self.forward_mesh.devices.flat, *self.backward_mesh.devices.flat]

  def init_state(self, rng: jax.Array) -> TrainState:
    return self.init_program()(rng)

  def init_program(self):
    return jax.jit(lambda rng: fresh_train_state(init_params(self.model, rng), self.optimizer),
                   out_shardings=self.state_shardings)

  def place_state(self, state: TrainState) -> TrainState:
    """`state` onto the backward group, as the specs split it."""
    return jax.device_put(state, self.state_shardings)

  def from_model_params(self, params: dict) -> dict:
    return params        # the state's parameters are the model's pytree (no pipeline layout)

  def model_params(self, params: dict) -> dict:
    return params

  def abstract_inputs(self) -> tuple[TrainState, dict]:
    return self._abstract_state, self.abstract_batch()

  @functools.cached_property
  def _abstract_state(self) -> TrainState:
    return _abstract(jax.eval_shape(self.init_state, jax.random.key(0)), self.state_shardings)

  def describe(self) -> list[str]:
    """The start-up log's record: the model and the two groups."""
    m, f, b = self.model.config, self.forward_mesh.shape, self.backward_mesh.shape
    return [f"model: {m.block} block, {m.num_layers} layers, {count_params(self._abstract_state.params) / 1e6:.2f}M "
            f"parameters; MegaFBD: forward on {f['dp'] * f['tp']} devices (dp={f['dp']} tp={f['tp']}), backward and "
            f"optimizer on {b['dp'] * b['tp']} (dp={b['dp']} tp={b['tp']})"]

  def abstract_batch(self) -> dict:
    """A batch as put_batch places it: [microbatches, rows, seq] on the forward group."""
    t = self.train
    shape = (t.microbatches, t.batch_size // t.microbatches, self.model.config.seq_len)
    keys = {"inputs": jnp.int32, "targets": jnp.int32, "loss_mask": jnp.float32}
    if self.packs_documents:
      keys.update(positions=jnp.int32, segment_ids=jnp.int32)
    return {k: jax.ShapeDtypeStruct(shape, dtype, sharding=self.batch_sharding) for k, dtype in keys.items()}

  def put_batch(self, local_batch: dict) -> dict:
    """A global batch (numpy, one process) onto the forward group, split into its microbatches
    (row m*b + r is microbatch m's row r, as the reference splits), each one's rows over dp."""
    microbatches = self.train.microbatches
    return {k: jax.device_put(np.asarray(v).reshape(microbatches, -1, *np.shape(v)[1:]), self.batch_sharding)
            for k, v in local_batch.items()}

  # --- The step.

  def train_step(self, with_gradients: bool = False, serialized: bool = False):
    """(state, batch) -> (state, metrics[, gradients]), jitted programs compiled at first use.
    serialized=True waits for each program before the next is dispatched: the groups never
    overlap (what bench fbd compares the step with)."""
    programs = (self._weights, self._forward, self._backward, self._update, self._zeros)
    return functools.partial(self._step, programs, with_gradients=with_gradients, serialized=serialized)

  def compiled_train_step(self):
    """train_step(), its programs compiled now (ahead of the first step, as the trainer does)."""
    return functools.partial(self._step, self._programs[:5])

  def _step(self, programs, state: TrainState, batch: dict, with_gradients: bool = False, serialized: bool = False):
    """One step: the weights cast and sent forward once, then per microbatch its forward on the
    forward group and its backward on the backward group, dispatched in turn (the groups
    overlap), the update on the backward group."""
    cast, forward, backward, update, zeros = programs
    wait = jax.block_until_ready if serialized else lambda x: x
    weights = wait(cast(state.params))
    sent = jax.device_put(weights, self._forward_weights)
    summed = zeros(state.params)
    stats = []                       # each microbatch's loss sums, summed by the update's program
    for i in range(self.train.microbatches):
      microbatch_stats, residuals = wait(forward(sent, batch, np.int32(i)))
      summed = wait(backward(send(residuals, self.backward_mesh), weights, summed))
      stats.append(send(microbatch_stats, self.backward_mesh))
    new_state, metrics, grads = update(state, summed, stats)
    return (new_state, metrics, grads) if with_gradients else (new_state, metrics)

  def eval_step(self):
    """(params, batch) -> {"eval_loss_sum", "eval_tokens"} on the forward group: the held-out
    batch's summed cross-entropy and token count. The weights are sent once per params."""
    return self._evaluator(self._weights, self._eval)

  def compiled_eval_step(self):
    cast, *_, evaluate = self._programs
    return self._evaluator(cast, evaluate)

  def _evaluator(self, cast, evaluate):
    last = {}         # the params last sent (kept alive: `is` compares them) and their weights there

    def eval_fn(params, batch):
      first = jax.tree.leaves(params)[0]
      if last.get("params") is not first:
        last.update(params=first, weights=jax.device_put(cast(params), self._forward_weights))
      return evaluate(last["weights"], batch)
    return eval_fn

  @functools.cached_property
  def _programs(self):
    """(cast, forward, backward, update, zeros, eval), compiled here."""
    return tuple(self.compile_programs().values())

  def compile_programs(self, compile_lowered=lambda lowered: lowered.compile()) -> dict:
    """Every program of the step compiled from abstract inputs by `compile_lowered` (e.g.
    deviceless.compile_lowered's for described GPUs): {"cast", "forward", "backward", "update",
    "zeros", "eval"}. The backward's inputs are the residuals as the compiled forward lays them out."""
    state, batch = self.abstract_inputs()
    index = jax.ShapeDtypeStruct((), jnp.int32)
    weights = _abstract(jax.eval_shape(self._weights, state.params), self._backward_weights)
    sent = _abstract(weights, self._forward_weights)
    forward = compile_lowered(self._forward.lower(sent, batch, index))
    stats, residuals = jax.eval_shape(self._forward, sent, batch, index)
    received = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=_on(self.backward_mesh, s)),
                            residuals, _abstract(residuals, forward.output_shardings[1]))
    whole = _abstract(stats, jax.tree.map(lambda _: NamedSharding(self.backward_mesh, P()), stats))
    return {"cast": compile_lowered(self._weights.lower(state.params)), "forward": forward,
            "backward": compile_lowered(self._backward.lower(received, weights, state.params)),
            "update": compile_lowered(self._update.lower(state, state.params,
                                                         [whole] * self.train.microbatches)),
            "zeros": compile_lowered(self._zeros.lower(state.params)),
            "eval": compile_lowered(self._eval.lower(sent, batch))}

  def traffic(self) -> dict:
    """What moves between the groups, in global bytes: one microbatch's residuals forward ->
    backward, the weights (compute dtype) backward -> forward once per step; and the peak bytes
    a device of each group holds, by XLA's memory analysis of its programs."""
    cast, forward, backward, update, zeros, _ = self._programs
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
    return {"residual_bytes": nbytes(forward.out_info[1]), "weight_bytes": nbytes(cast.out_info),
            "forward_peak_bytes": bytes_per_device(forward),
            "backward_peak_bytes": max(bytes_per_device(p) for p in (cast, backward, update, zeros))}
