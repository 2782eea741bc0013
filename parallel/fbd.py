"""MegaFBD (MegatronApp section 4): the forward and the backward of training on separate device
groups, each with its own data x tensor parallel degrees, inside one process.

  forward group    holds the weights (sent once per step by the backward group); per
                   microbatch runs the model's forward and keeps what its backward needs
                   (`jax.vjp`'s residuals: the activations under the model's remat policy, the
                   weights the matmuls read), and sends those residuals on, but for the weights
                   (the backward group has them: the same values, its master copy)
  backward group   holds the master weights and the optimizer state; per microbatch runs the
                   backward from the residuals it receives, sums the gradients over the step's
                   microbatches, then applies the optimizer (the reference step's update,
                   megajax.reference_step.apply_gradients) and sends the new weights forward

Each group is a mesh (dp, 1, tp) of its own devices; its programs are jitted with the
parameters placed as Megatron's tensor parallelism splits them (megajax.parallel.sharding's
layouts, over that group's tp) and the batch split over its dp, and XLA's SPMD partitioner
inserts the group's collectives. A residual moves between the groups with `jax.device_put` onto
the receiving mesh, under the same partition spec where its dimensions divide, else whole: the
two groups' tp may differ. The two programs run on disjoint devices and are dispatched
asynchronously, so the forward of microbatch i + 1 runs while the backward of microbatch i does
(the send between them is ordered by the data it carries: nothing waits for the other group's
next program, no deadlock).

This increment is the step alone (FbdStep.train_step), tested equal to the single-device
reference; the trainer's config section, checkpoints, the bench and the planner's mixed
clusters are issue 36's next increments.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import ml_collections
import numpy as np
import optax

from megajax.model import GPT
from megajax.optim import learning_rate_schedule, make_optimizer
from megajax.parallel import sharding
from megajax.parallel.deviceless import bytes_per_device
from megajax.parallel.mesh import AXIS_TYPES, DP, MESH_AXES
from megajax.reference_step import TrainState, apply_gradients, make_loss_sums_fn, split_microbatches


def group_mesh(devices, dp: int, tp: int) -> Mesh:
  """A device group's mesh: (dp, 1, tp) over `devices` (dp * tp of them)."""
  if len(devices) != dp * tp:
    raise ValueError(f"a group of {len(devices)} device(s) cannot be dp={dp} x tp={tp}")
  return Mesh(np.asarray(devices).reshape(dp, 1, tp), MESH_AXES, axis_types=AXIS_TYPES)


def _on(mesh: Mesh, array: jax.Array) -> NamedSharding:
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


@dataclasses.dataclass
class FbdStep:
  """The decoupled step: `train_step(state, batch) -> (state, metrics)` with the state on the
  backward group, a batch of global arrays (any placement)."""
  config: ml_collections.ConfigDict
  model: GPT
  forward_mesh: Mesh
  backward_mesh: Mesh
  optimizer: optax.GradientTransformation
  param_specs: Any             # Megatron-TP partition specs of the parameters (each group's tp)
  state_specs: TrainState

  @classmethod
  def build(cls, config: ml_collections.ConfigDict, model: GPT, forward_devices, backward_devices,
            forward_dp: int, forward_tp: int, backward_dp: int, backward_tp: int, params_like) -> "FbdStep":
    forward_mesh = group_mesh(forward_devices, forward_dp, forward_tp)
    backward_mesh = group_mesh(backward_devices, backward_dp, backward_tp)
    optimizer = make_optimizer(config)
    # The specs name the tp axis; each group's mesh gives it its own size (1: whole).
    layouts = sharding.param_layouts(model, params_like, 1, max(forward_tp, backward_tp))
    specs = sharding.param_specs(layouts, params_like)
    state_specs = TrainState(step=P(), params=specs, opt_state=sharding.optimizer_specs(optimizer, params_like, specs))
    return cls(config, model, forward_mesh, backward_mesh, optimizer, specs, state_specs)

  def __post_init__(self):
    loss_sums = make_loss_sums_fn(self.model, self.config.train.z_loss)
    f, b = self.forward_mesh, self.backward_mesh
    whole_b = NamedSharding(b, P())

    def forward(params, microbatch):
      """(the loss's sums, the residuals the backward group needs): jax.vjp's pullback is a
      pytree of arrays; those that are the weights themselves are not sent (the backward group
      holds the same values: the master weights it sent): their places are kept (at trace time,
      with the pullback's structure) for `backward` to fill in."""
      _, pullback, stats = jax.vjp(lambda p: loss_sums(p, microbatch), params, has_aux=True)
      leaves, structure = jax.tree.flatten(pullback)
      weights = {id(w): i for i, w in enumerate(jax.tree.leaves(params))}
      self._residual_layout = (structure, tuple(weights.get(id(leaf)) for leaf in leaves))
      return stats, [leaf for leaf in leaves if id(leaf) not in weights]

    def backward(residuals, params, summed):
      structure, places = self._residual_layout
      weights, sent = jax.tree.leaves(params), iter(residuals)
      pullback = jax.tree.unflatten(structure, [next(sent) if i is None else weights[i] for i in places])
      (grads,) = pullback(jnp.ones((), jnp.float32))
      return jax.tree.map(jnp.add, summed, grads)

    self._forward = jax.jit(forward, in_shardings=(sharding.named(f, self.param_specs), NamedSharding(f, P(DP))))
    self._backward = jax.jit(backward, out_shardings=sharding.named(b, self.param_specs), donate_argnums=2)
    schedule = learning_rate_schedule(self.config)
    state_shardings = sharding.named(b, self.state_specs)
    self._update = jax.jit(lambda state, grads, stats: apply_gradients(self.optimizer, schedule, state, grads, stats),
                           in_shardings=(state_shardings, sharding.named(b, self.param_specs), whole_b),
                           out_shardings=(state_shardings, whole_b, sharding.named(b, self.param_specs)),
                           donate_argnums=(0, 1))
    self._zeros = jax.jit(lambda params: jax.tree.map(jnp.zeros_like, params),
                          out_shardings=sharding.named(b, self.param_specs))
    self.state_shardings = state_shardings

  def place_state(self, state: TrainState) -> TrainState:
    """`state` onto the backward group, its parameters split as the specs say."""
    return jax.device_put(state, self.state_shardings)

  def traffic(self, state: TrainState, batch: dict) -> dict:
    """What moves between the groups, in global bytes: one microbatch's residuals forward ->
    backward, the weights backward -> forward once per step; and the peak bytes a device of each
    group holds, by XLA's memory analysis of its programs (the forward; the backward and the
    update, the larger)."""
    f, b = self.forward_mesh, self.backward_mesh
    placed = lambda tree, shardings: jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
    abstract = lambda arrays: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), arrays)
    params = placed(state.params, sharding.named(f, self.param_specs))
    rows = self.config.train.batch_size // self.config.train.microbatches
    microbatch = {k: jax.ShapeDtypeStruct((rows, *v.shape[1:]), v.dtype, sharding=NamedSharding(f, P(DP)))
                  for k, v in batch.items()}
    forward = self._forward.lower(params, microbatch).compile()
    stats, residuals = jax.eval_shape(self._forward, params, microbatch)
    received = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=_on(b, x)),
                            placed(residuals, forward.output_shardings[1]))
    summed = abstract(state.params)
    backward = self._backward.lower(received, summed, summed).compile()
    update = self._update.lower(abstract(state), summed, placed(stats, jax.tree.map(lambda _: NamedSharding(b, P()),
                                                                                    stats))).compile()
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
    return {"residual_bytes": nbytes(residuals), "weight_bytes": nbytes(state.params),
            "forward_peak_bytes": bytes_per_device(forward),
            "backward_peak_bytes": max(bytes_per_device(backward), bytes_per_device(update))}

  def train_step(self, state: TrainState, batch: dict, with_gradients: bool = False, serialized: bool = False):
    """One step: the weights forward once, then per microbatch its forward on the forward group
    and its backward on the backward group, dispatched in turn (the groups overlap), the update
    on the backward group. serialized=True waits for each program before the next is dispatched:
    the groups never overlap (what bench fbd compares the step with)."""
    wait = jax.block_until_ready if serialized else lambda x: x
    c = self.config
    params = jax.device_put(state.params, sharding.named(self.forward_mesh, self.param_specs))
    microbatches = split_microbatches(batch, c.train.microbatches)
    summed = self._zeros(state.params)
    stats_total = None
    for i in range(c.train.microbatches):
      microbatch = jax.device_put(jax.tree.map(lambda x: x[i], microbatches),
                                  NamedSharding(self.forward_mesh, P(DP)))
      stats, residuals = wait(self._forward(params, microbatch))
      summed = wait(self._backward(send(residuals, self.backward_mesh), state.params, summed))
      stats = send(stats, self.backward_mesh)
      stats_total = stats if stats_total is None else jax.tree.map(jnp.add, stats_total, stats)
    new_state, metrics, grads = self._update(state, summed, stats_total)
    return (new_state, metrics, grads) if with_gradients else (new_state, metrics)
