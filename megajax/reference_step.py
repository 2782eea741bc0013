"""The reference step: (state, batch) -> (state, metrics) on one device, with gradient accumulation.

The step boundary carries plain pytrees (params, optax state). Nothing trains with it: the
trainer runs the 3D step (megajax.parallel.ParallelStep: same (state, batch) -> (state,
metrics) shape, on any mesh, 1x1x1 included), and every parallel path is tested equal to
this one. `TrainState`, `accumulate_gradients` and `split_microbatches` are shared by both.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax

from megajax.loss import cross_entropy_sums
from megajax.model import GPT, init_params
from megajax.optim import learning_rate_schedule


class TrainState(NamedTuple):
  step: jax.Array          # int32[], optimizer updates done
  params: Any              # fp32 master parameters, a plain pytree
  opt_state: Any           # optax state


def make_loss_sums_fn(model: GPT, z_loss: float) -> Callable:
  """(params, batch) -> (objective summed over masked tokens, stats with the token count).
  A packed batch also has "positions" and "segment_ids" (megajax.model.GPT)."""
  def loss_sums(params, batch):
    logits = model.apply({"params": params}, batch["inputs"], batch.get("positions"),
                         batch.get("segment_ids"))                        # f32[b, s, vocab]
    return cross_entropy_sums(logits, batch["targets"], batch["loss_mask"], z_loss)
  return loss_sums


def make_loss_fn(model: GPT, z_loss: float = 0.0) -> Callable:
  """The pure loss: (params, batch) -> (mean objective per token, {"loss", "log_z_squared", "tokens"})."""
  loss_sums = make_loss_sums_fn(model, z_loss)

  def loss_fn(params, batch):
    total, stats = loss_sums(params, batch)
    tokens = jnp.maximum(stats["tokens"], 1.0)
    return total / tokens, {"loss": stats["nll_sum"] / tokens, "log_z_squared": stats["z_sum"] / tokens,
                            "tokens": stats["tokens"]}
  return loss_fn


def fresh_train_state(params, optimizer: optax.GradientTransformation) -> TrainState:
  """Step 0: `params` and the optimizer's fresh state for them (traceable: jit it or call it in a jit)."""
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))


def init_train_state(model: GPT, optimizer: optax.GradientTransformation, rng: jax.Array) -> TrainState:
  return jax.jit(fresh_train_state, static_argnums=1)(init_params(model, rng), optimizer)


def split_microbatches(batch: dict, microbatches: int) -> dict:
  """[B, ...] -> [microbatches, B / microbatches, ...]; microbatch m is rows m*b:(m+1)*b."""
  return jax.tree.map(lambda x: x.reshape(microbatches, -1, *x.shape[1:]), batch)


def accumulate_gradients(loss_sums: Callable, params, batch: dict, microbatches: int,
                         reduce_grads: Callable | None = None, zero_grads=None, probes=None,
                         reduce_sum: Callable | None = None, first_microbatch: Callable | None = None,
                         in_order: Callable | None = None):
  """Summed gradients and stats over microbatches; one microbatch's activations live at a time.

  `reduce_grads` maps each microbatch's gradients to what is summed (ZeRO-2 per microbatch:
  their dp reduce-scatter, so only this device's shard is carried); `zero_grads` is then the
  zero of that shape (default: zeros like `params`). `reduce_sum` maps the sum over every
  microbatch once (the 3D step's grad_sync="step": one dp reduce-scatter per leaf); the last
  microbatch then runs after the scan, not in it, so that each leaf's reduction, in the same
  computation as that backward and depending only on its own leaf, can be scheduled while
  the rest of the backward runs (MegaScale's DP overlap). `first_microbatch` runs the first one
  before the scan, in the computation the step starts with: microbatch -> ((objective,
  stats), gradients, the params every later microbatch uses; the 3D step's ZeRO gathers,
  issued inside its forward: `params` is then None). `probes` (megajax.observe.Probes) when
  the stats carry captured activation statistics: their zeros and how microbatches combine.
  `in_order(microbatch, carry) -> microbatch`: each microbatch after the first made to depend on
  the running sum, bit for bit the same: a microbatch's forward needs nothing the others
  compute, and outside a loop (the last one with `reduce_sum`, a scan of one that XLA inlines)
  XLA ran it before or beside them, holding two or three microbatches' activations at once,
  which is what accumulating was meant to avoid.
  """
  grad_fn = jax.value_and_grad(loss_sums, has_aux=True)
  identity = lambda grads: grads
  last_after_scan = reduce_sum is not None
  reduce_grads, reduce_sum = reduce_grads or identity, reduce_sum or identity
  if microbatches == 1:
    (_, stats), grads, _ = first_microbatch(batch) if first_microbatch is not None else (*grad_fn(params, batch), None)
    return reduce_sum(reduce_grads(grads)), stats

  add_stats = probes.combine if probes is not None else lambda a, b: jax.tree.map(jnp.add, a, b)
  microbatches = split_microbatches(batch, microbatches)
  if first_microbatch is not None:
    (_, first_stats), first_grads, params = first_microbatch(jax.tree.map(lambda x: x[0], microbatches))

  def one_microbatch(carry, microbatch):
    grads_sum, stats_sum = carry
    if in_order is not None:
      microbatch = in_order(microbatch, carry)
    (_, stats), grads = grad_fn(params, microbatch)
    return (jax.tree.map(jnp.add, grads_sum, reduce_grads(grads)), add_stats(stats_sum, stats)), None

  if zero_grads is None:
    zero_grads = jax.tree.map(jnp.zeros_like, params)
  # Typed like the batch: inside a shard_map the stats vary over dp as the batch does.
  zero = jnp.zeros_like(microbatches["loss_mask"][0, 0, 0], jnp.float32)
  zero_stats = {"nll_sum": zero, "z_sum": zero, "tokens": zero}
  if probes is not None and probes.capturing:
    zero_stats["capture"] = probes.zeros()
  carry = (zero_grads, zero_stats)
  if first_microbatch is not None:    # summed from zero in microbatch order, as in the scan
    carry = (jax.tree.map(jnp.add, zero_grads, reduce_grads(first_grads)), add_stats(zero_stats, first_stats))
  in_scan = jax.tree.map(lambda x: x[int(first_microbatch is not None):x.shape[0] - int(last_after_scan)], microbatches)
  if in_scan["inputs"].shape[0]:
    carry, _ = jax.lax.scan(one_microbatch, carry, in_scan)
  if last_after_scan:   # the last microbatch, summed in the same order as in the scan
    carry, _ = one_microbatch(carry, jax.tree.map(lambda x: x[-1], microbatches))
  grads, stats = carry
  return reduce_sum(grads), stats


def make_reference_step(model: GPT, optimizer: optax.GradientTransformation,
                        config: ml_collections.ConfigDict, with_gradients: bool = False) -> Callable:
  """The jitted reference step. The input state is donated: its buffers become the output's.
  with_gradients=True: (state, metrics, gradients) (the mean over the batch's tokens, before
  the optimizer), like ParallelStep.train_step(with_gradients=True)."""
  loss_sums = make_loss_sums_fn(model, config.train.z_loss)
  schedule = learning_rate_schedule(config.optimizer, config.train.steps)
  microbatches = config.train.microbatches

  def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    grads, stats = accumulate_gradients(loss_sums, state.params, batch, microbatches)
    new_state, metrics, grads = apply_gradients(optimizer, schedule, state, grads, stats)
    return (new_state, metrics, grads) if with_gradients else (new_state, metrics)

  return jax.jit(train_step, donate_argnums=0)


def apply_gradients(optimizer: optax.GradientTransformation, schedule: optax.Schedule, state: TrainState, grads,
                    stats: dict) -> tuple[TrainState, dict, Any]:
  """The update from the gradients summed over the batch's tokens: (new state, metrics, the mean
  gradients). The reference's, and MegaFBD's backward group's (megajax.parallel.fbd)."""
  tokens = jnp.maximum(stats["tokens"], 1.0)
  grads = jax.tree.map(lambda g: g / tokens, grads)  # the mean over every token of the global batch
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = {"loss": stats["nll_sum"] / tokens, "log_z_squared": stats["z_sum"] / tokens,
             "grad_norm": optax.tree.norm(grads), "learning_rate": schedule(state.step)}
  return TrainState(state.step + 1, params, opt_state), metrics, grads
