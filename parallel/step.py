"""The 3D-parallel training step: one jitted shard_map over the (dp, pp, tp) mesh.

Per device, one step is:

  1. ZeRO gather:  fp32 master shards --all-gather(dp)--> this tp rank's parameters, the
                   linears' cast to the compute dtype first (zero.gathers_in_compute_dtype).
                   pp = 1: inside the first microbatch's forward, each issued one layer ahead
                   of its use (zero.layer_ahead_gathers), kept for the later microbatches;
                   pp > 1: all of the stage's at the top of the step, before the tick scan.
  2. Forward/backward per microbatch: with pp = 1 a lax.scan over microbatches of the
                   tensor + sequence parallel model (megajax.parallel.tensor_parallel); with
                   pp > 1 the pipeline schedule's ticks (megajax.parallel.pipeline).
  3. ZeRO scatter: gradients --reduce-scatter(dp)--> this rank's 1/dp shard (never an
                   all-reduce, except for a leaf with no dimension divisible by dp), divided
                   by the global token count. parallel.grad_sync="step": the microbatches'
                   gradients summed locally in fp32, one reduce-scatter per leaf per step,
                   traced with the last microbatch's backward; "microbatch": each
                   microbatch's, summed into the shard.
  4. LAMB on the shards, with whole-tensor norms (psum of squared norms over the axes a
     leaf is split on), so the update equals the single-device optax one.

State crossing the step boundary is a TrainState of global arrays: params and optimizer
state sharded 1/dp (ZeRO) and 1/tp where tensor-parallel. The same step runs every mesh,
1x1x1 included, and is what the trainer runs; the single-device reference step
(megajax.reference_step) is what it is tested against.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
import ml_collections
import numpy as np
import optax

from megajax.config import ConfigError
from megajax.layers.kernels import lowering_for
from megajax.model import GPT, count_params, init_params
from megajax.optim import global_norm, learning_rate_schedule, make_optimizer
from megajax.parallel import pipeline, sharding, zero
from megajax.parallel import collectives
from megajax.parallel.context_parallel import row_order, shard_positions, uses_dual_chunks
from megajax.parallel.mesh import (CP, DP, MESH_AXES, PP, TP, after, batch_sharding, batch_spec, picked, to_varying,
                                   varying_axes)
from megajax.parallel.pipeline import simulate
from megajax.parallel.pipeline.schedule import ascii_paired_timeline, ascii_timeline
from megajax.parallel.pipeline.forward import pipeline_loss_sums
from megajax.parallel.tensor_parallel import Overlap, loss_sums
from megajax.reference_step import TrainState, accumulate_gradients, fresh_train_state, split_microbatches
from megajax.sections import RunConfig
from megajax.sections import ParallelSection, TrainSection

# tp_overlap="xla": plain collectives, and XLA's own windowed-einsum rewrite of them (GPU).
XLA_WINDOWED_EINSUM_OPTIONS = {
    "xla_gpu_threshold_for_windowed_einsum_mib": 0,
    "xla_gpu_multi_streamed_windowed_einsum": True,
}

# tp_overlap="collective_matmul" on a GPU: XLA's DotMerger would merge the ring's per-chunk
# matmuls (dots sharing the weight) into one dot over the concatenated chunks, which waits for
# every hop: the permutes then run back to back with nothing under them (the deviceless H100
# compile shows it: tests/integration/test_gpu_compile.py). Threshold 0: no dot is merged.
COLLECTIVE_MATMUL_OPTIONS = {"xla_gpu_dot_merger_threshold_mb": 0}


def _after_the_others(microbatch: dict, carry) -> dict:
  """A microbatch's tokens, bit for bit, once the running sum of the ones before exists
  (mesh.after: a data dependency, which XLA:CPU keeps where it drops a barrier): its forward
  then starts after their backwards (but the first layer's), and one microbatch's activations
  live at a time. The dependency is one element of every summed gradient leaf, a scalar
  psum'ed over the axes the tokens do not vary over (tp: one 4-byte all-reduce a microbatch) so
  that the tokens keep their type."""
  tokens = microbatch["inputs"]
  # Not the first layer's and the embedding's, the backward's last: the next forward's first
  # layer (its tp ring's first hop) may then run under them, as it did before the order.
  grads = {name: leaf for name, leaf in carry[0].items() if name not in ("embedding", "layer_0")}
  done = picked(grads)
  beyond = tuple(axis for axis in MESH_AXES if axis in varying_axes(done) - varying_axes(tokens))
  if beyond:
    done = collectives.psum(done, beyond)
  return {**microbatch, "inputs": after(tokens, done, tokens[0, 0] < 0)}   # token ids are never negative


@dataclasses.dataclass(frozen=True)
class ParallelStep:
  """The 3D-parallel step of one config on one mesh: each parameter's layout, the optimizer
  that goes with them, the state's specs, and the jitted step (`train_step()`). It keeps the
  sections it reads (the run's parallel and train ones), not the config."""

  parallel: ParallelSection
  train: TrainSection
  packs_documents: bool                     # batches carry positions and segment_ids (data.packs_documents)
  learning_rate: Callable                   # optax's update count -> the learning rate
  mesh: Mesh
  model: GPT
  layouts: object                           # pytree of sharding.Layout, like the params
  optimizer: optax.GradientTransformation   # LAMB / AdamW with whole-tensor norms
  state_specs: TrainState                   # PartitionSpecs of the TrainState
  pipeline: pipeline.Tables | None          # the schedule's tables when pp > 1
  # What the step observes and perturbs (megajax.observe.Probes.of(run.observe, layers)); None: off,
  # and the step traces exactly as without it.
  probes: object = None
  # (batch, step) -> a scalar the step must compute, on every device (a drill: the straggler's
  # extra work, megajax.trainer.drills); None: nothing.
  extra_work: Callable | None = None
  # The platform the step is lowered for: the mesh's, or "cuda" for a step exported
  # (jax.export, platforms=["cuda"]) on a CPU machine: kernels lowered, not interpreted.
  platform: str = "cpu"

  @classmethod
  def build(cls, config: RunConfig | ml_collections.ConfigDict, model: GPT, mesh: Mesh, probes=None,
            extra_work: Callable | None = None, platform: str | None = None) -> "ParallelStep":
    """The step of `config` (a RunConfig, or a ConfigDict resolved here) for `model` on `mesh`."""
    run = RunConfig.of(config)
    platform = platform or mesh.devices.flat[0].platform
    impl = run.model.attention_impl
    if impl == "pallas" and platform == "cpu":
      raise ConfigError("model.attention_impl", impl,
                        "on CPU the Pallas kernels run in interpret mode, which jax 0.10 cannot trace inside "
                        "the step's shard_map (its kernels see no varying-axes types)",
                        "use model.attention_impl=xla on CPU (pallas is for GPUs)")
    if impl == "cudnn" and platform not in ("gpu", "cuda"):
      raise ConfigError("model.attention_impl", impl, f"cuDNN attention needs an NVIDIA GPU, this mesh is {platform}",
                        "use model.attention_impl=xla (or pallas on a GPU)")
    # What observes or drills the step is handed in (this layer imports neither): a config that
    # asks for them must get them, not a step that silently ignores the fields.
    o, slow = run.observe, run.debug.slow_rank
    if o.wants_probes and probes is None:
      field, value = ("observe.capture", o.capture) if o.capture else ("observe.perturb", o.perturb)
      raise ConfigError(field, value, "the 3D step was built without its probes",
                        "build it with megajax.trainer.build_parallel_step(config), or pass "
                        "probes=megajax.observe.Probes.of(observe, num_layers)")
    if slow and extra_work is None:
      raise ConfigError("debug.slow_rank", slow, "the 3D step was built without the straggler drill's work",
                        "build it with megajax.trainer.build_parallel_step(config), or pass "
                        "extra_work=megajax.trainer.drills.straggler_work(debug, model)")
    params_like = jax.eval_shape(lambda: init_params(model, jax.random.key(0)))
    layouts = sharding.param_layouts(model, params_like, mesh.shape[DP], mesh.shape[TP])
    tables = None
    p = run.parallel
    if mesh.shape[PP] > 1:
      schedule = simulate(p.schedule, p.pp, p.virtual_stages, run.train.microbatches, p.traversal)
      tables = pipeline.Tables.build(schedule, model.config, p.pipeline_recompute_on(platform))
      params_like = jax.eval_shape(functools.partial(pipeline.to_pipeline_params, stages=p.pp,
                                                     virtual_stages=p.virtual_stages), params_like)
      layouts = pipeline.pipeline_layouts(layouts)
    optimizer = make_optimizer(run.optimizer, run.train.steps, sharding.tensor_norms(layouts))
    param_specs = sharding.param_specs(layouts, params_like)
    state_specs = TrainState(step=P(), params=param_specs,
                             opt_state=sharding.optimizer_specs(optimizer, params_like, param_specs))
    return cls(p, run.train, run.data.packs_documents, learning_rate_schedule(run.optimizer, run.train.steps), mesh,
               model, layouts, optimizer, state_specs, tables, probes, extra_work, platform)

  @property
  def overlap(self) -> Overlap:
    return Overlap(self.parallel.tp_overlap_on(self.platform), self.parallel.tp_overlap_chunks)

  @property
  def devices(self) -> list:
    """Every device of the step (what MFU divides by)."""
    return list(self.mesh.devices.flat)

  def describe(self) -> list[str]:
    """The start-up log's records: the model and the mesh, and with pp > 1 the pipeline's
    schedule (its bubble, stash and backward) with its timelines."""
    m, (dp, pp, cp, tp) = self.model.config, self.mesh.devices.shape
    lines = [f"model: {m.block} block, {m.num_layers} layers, {count_params(self._abstract_state.params) / 1e6:.2f}M "
             f"parameters; mesh dp={dp} pp={pp} " + (f"cp={cp} " if cp > 1 else "") +
             f"tp={tp}, tp_overlap={self.overlap.mode}"]
    if self.pipeline is not None:
      tables, schedule = self.pipeline, self.pipeline.schedule
      backward = ("each chunk's forward rerun in its backward (parallel.pipeline_recompute)" if tables.recompute else
                  f"backwards from kept residuals, up to {tables.residual_slots} microbatch-chunks' per stage")
      lines.append(f"pipeline: {schedule.name}, {schedule.virtual_stages} virtual stages, {self.parallel.traversal}, "
                   f"{schedule.microbatches} microbatches: bubble {schedule.bubble_fraction:.3f} of ideal (one op per "
                   f"tick), stash of up to {tables.stash_slots} activations per stage, {backward}\n"
                   f"{ascii_timeline(schedule)}\n{ascii_paired_timeline(schedule)}")
    return lines

  @property
  def state_shardings(self):
    return sharding.named(self.mesh, self.state_specs)

  # --- State.

  def init_state(self, rng: jax.Array) -> TrainState:
    """A fresh state, each device initializing only its own shards."""
    return self.init_program()(rng)

  def init_program(self):
    """init_state's jitted program (rng -> TrainState), to `.lower(rng).compile(...)` apart."""
    def init(rng):
      params = self.from_model_params(init_params(self.model, rng))
      return fresh_train_state(params, self.optimizer)
    return jax.jit(init, out_shardings=self.state_shardings)

  def from_model_params(self, params: dict) -> dict:
    """The model's parameter pytree -> the state's (the pipeline layout when pp > 1)."""
    if self.pipeline is None:
      return params
    return pipeline.to_pipeline_params(params, self.parallel.pp, self.parallel.virtual_stages)

  def model_params(self, params: dict) -> dict:
    """The state's parameters (or gradients) -> the model's pytree, whatever the mesh."""
    if self.pipeline is None:
      return params
    return pipeline.to_model_params(params, self.parallel.pp, self.parallel.virtual_stages)

  def abstract_inputs(self) -> tuple[TrainState, dict]:
    """The step's (state, batch) as ShapeDtypeStructs with their shardings: for
    `.lower(...).compile()` and a checkpoint's restore, without materializing anything.
    Packed data (data.packs_documents) adds "positions" and "segment_ids"."""
    return self._abstract_state, self.abstract_batch()

  def abstract_batch(self) -> dict:
    """abstract_inputs' batch alone: a global batch's ShapeDtypeStructs, rows split over dp
    (positions over cp, in the dual-chunk order: put_batch)."""
    shape, rows = (self.train.batch_size, self.model.config.seq_len), batch_sharding(self.mesh)
    batch = {"inputs": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rows),
             "targets": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rows),
             "loss_mask": jax.ShapeDtypeStruct(shape, jnp.float32, sharding=rows)}
    if self.packs_documents:
      batch.update({key: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rows)
                    for key in ("positions", "segment_ids")})
    return batch

  @functools.cached_property
  def _abstract_state(self) -> TrainState:
    # Traced once per ParallelStep: a resume restores onto it, then the step compiles from it.
    state = jax.eval_shape(self.init_state, jax.random.key(0))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), state,
                        self.state_shardings)

  def put_batch(self, local_batch: dict) -> dict:
    """This process's rows of a global batch (numpy) -> global arrays split over dp; with
    cp > 1 and a global layer each row's positions first put in the dual-chunk order
    (context_parallel.row_order), so that an even split over cp gives rank r chunks r and
    2cp-1-r (a model of sliding-window layers only: contiguous shards, the row as it is)."""
    batch_size = self.train.batch_size
    placement = batch_sharding(self.mesh)
    m = self.model.config
    order = row_order(m.seq_len, self.mesh.shape[CP], uses_dual_chunks(m))
    return {k: jax.make_array_from_process_local_data(
                placement, np.asarray(v) if order is None else np.asarray(v)[:, order], (batch_size, *v.shape[1:]))
            for k, v in local_batch.items()}

  def _in_context_shards(self, batch: dict) -> dict:
    """With cp > 1: the batch's rotary positions, where it has none (one document a row), the
    row positions of this rank's shard (a packed batch brings its own, laid out like its
    tokens by put_batch)."""
    if self.mesh.shape[CP] == 1 or "positions" in batch:
      return batch
    return {**batch, "positions": shard_positions(*batch["inputs"].shape, uses_dual_chunks(self.model.config))}

  # --- Inside the shard_map.

  def _summed_gradients(self, params, batch, step=None):
    """ZeRO gather -> forward/backward of every microbatch -> ZeRO reduce-scatter, per device:
    (gradient shards summed over the batch, loss stats summed over the batch)."""
    probes = self.probes
    if probes is not None:    # observe.capture / perturb; keyed by the step and the global rows
      probes = probes.bind(step)
      batch = {**batch, "rows": probes.rows(batch)}
    batch = self._in_context_shards(batch)
    # cp replicates the parameters as dp does: each cp rank's gradients are its positions' share,
    # kept per device (the shards typed varying over cp) and summed over cp once, after the
    # reduce-scatter over dp (1/dp of the bytes an all-reduce of the full gradients would move).
    params = jax.tree.map(lambda leaf: to_varying(leaf, (CP,)), params)
    grads, stats = self._sums_over_positions(params, batch, probes)
    return collectives.psum(grads, CP), stats

  def _sums_over_positions(self, params, batch, probes):
    """_summed_gradients on this device's positions of its rows: gradient shards summed over
    its share of the batch, loss stats over the whole batch."""
    p, t = self.parallel, self.train
    if self.pipeline is not None:
      return pipeline.pipeline_gradients(params, batch, self.layouts, self.pipeline, self.model.config,
                                         self.overlap, t.z_loss, probes, p.grad_sync,
                                         ordered_collectives=self.platform == "cpu", bucket_bytes=p.dp_bucket_bytes)
    # The forward's ops are named .../forward/..., the backward's .../transpose(jvp(forward))/...
    loss = jax.named_scope("forward")(
        functools.partial(loss_sums, c=self.model.config, overlap=self.overlap, z_loss=t.z_loss, probes=probes))
    # ZeRO's gathers run inside the first microbatch's forward, one layer ahead of use
    # (zero.layer_ahead_gathers), each layer in its compute form (megajax.parallel.fused:
    # a fused matmul's kernels gathered as its operand); the later microbatches use what it gathered.
    m = self.model.config
    sinks = zero.gathered_zeros(params, self.layouts, m.compute_dtype, model=m)
    first = zero.first_microbatch_gathering(loss, params, self.layouts, m.compute_dtype, sinks,
                                                ordered=self.platform == "cpu", bucket_bytes=p.dp_bucket_bytes, model=m)
    reduce_scatter = functools.partial(zero.reduce_scatter_grads, layouts=self.layouts,
                                       bucket_bytes=p.dp_bucket_bytes, shards=params, model=m)
    if p.grad_sync == "microbatch":
      # Each microbatch's gradients are reduce-scattered over dp as they come: the scan carries
      # only this device's 1/dp shard, shaped like the master shard (m collectives per leaf).
      # Gradients w.r.t. leaves gathered in the compute dtype come back in it: in the master
      # dtype again before the reduction (the conversion the cast's transpose made before).
      master = zero.gathered_zeros(params, self.layouts, model=m)
      grads, stats = accumulate_gradients(loss, None, batch, t.microbatches, first_microbatch=first,
                                          reduce_grads=lambda g: reduce_scatter(zero.to_master_dtype(g, master)),
                                          zero_grads=jax.tree.map(jnp.zeros_like, params), probes=probes,
                                          in_order=_after_the_others)
    else:
      # grad_sync="step": the scan sums full local gradients (fp32, shaped like the gathered
      # parameters) over the microbatches between the first and the last; the last one's
      # backward runs after it, and with it the reduce-scatters over dp for the whole step,
      # each depending only on its own gradients: XLA may start the head's while the first
      # layers' backward runs.
      grads, stats = accumulate_gradients(
          loss, None, batch, t.microbatches, first_microbatch=first, zero_grads=zero.gradient_accumulators(sinks),
          probes=probes, reduce_sum=lambda g: reduce_scatter(jax.tree.map(lambda x: x.astype(jnp.float32), g)),
          in_order=_after_the_others)
    # Captured statistics are global already (reduced over dp and tp where they were taken).
    return grads, {k: v if k == "capture" else collectives.psum(v, (DP, CP)) for k, v in stats.items()}

  def _gradients(self, params, batch, step=None):
    """The step's gradients (mean over the global batch's tokens) and loss metrics."""
    grads, stats = self._summed_gradients(params, batch, step)
    tokens = jnp.maximum(stats["tokens"], 1.0)
    grads = jax.tree.map(lambda g: g / tokens, grads)   # the mean over every token of the global batch
    metrics = {"loss": stats["nll_sum"] / tokens, "log_z_squared": stats["z_sum"] / tokens,
               "grad_norm": global_norm(grads, sharding.tensor_norms(self.layouts))}
    if "capture" in stats:
      metrics.update(self.probes.metrics(stats["capture"]))
    return grads, metrics

  def _train_step(self, state: TrainState, batch: dict, with_gradients: bool = False):
    grads, metrics = self._gradients(state.params, batch, state.step)
    if self.extra_work is not None:    # its scalar joins the loss times 0: XLA must compute it
      extra = self.extra_work(batch, state.step + 1)
      metrics["loss"] = metrics["loss"] + collectives.psum(0.0 * extra, MESH_AXES)
    metrics["learning_rate"] = self.learning_rate(state.step)
    # A non-finite loss, gradient norm or learning rate skips the update: the state passes
    # through unchanged (all three are global, so every device decides alike; the trainer
    # counts the skips and rolls back after train.nonfinite_rollback_after in a row). With
    # them finite, the new state is finite too: AdamW's and LAMB's moments of finite
    # gradients whose squares sum finitely (the norm) are finite, their steps bounded (Adam's
    # m / sqrt(v); LAMB's scaled to ||w||), short of an fp32 overflow past 3.4e38; so no NaN
    # or Inf reaches a checkpoint. Decided before the update. On XLA:CPU as a branch: the
    # update runs as it would unguarded, in place (a select of new and old values there takes
    # a second pass over the state, or copies the moments the update reads twice). On GPUs as
    # a select, which XLA fuses into the update's last elementwise kernel: a conditional there
    # holds its operands apart (the gradients twice more: the 1.3B MFU step on one H100
    # needed 38.4 GiB with it, 28.9 GiB with the select).
    finite = (jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
              & jnp.isfinite(metrics["learning_rate"]))

    def update(state):
      with jax.named_scope("optimizer"):
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        return TrainState(state.step + 1, optax.apply_updates(state.params, updates), opt_state)
    if self.skips_by_branch:
      new_state = lax.cond(finite, update, lambda state: state, state)
    else:
      new_state = jax.tree.map(functools.partial(jnp.where, finite), update(state), state)
    metrics["skipped"] = 1 - finite.astype(jnp.int32)
    return (new_state, metrics, grads) if with_gradients else (new_state, metrics)

  @property
  def skips_by_branch(self) -> bool:
    """How a non-finite step skips its update: a lax.cond (XLA:CPU) or a select (GPUs)."""
    return self.platform == "cpu"

  # --- The jitted step.

  def _for_platform(self, fn):
    """`fn` with the kernels it traces lowered for the step's platform (kernels.lowering_for)."""
    @functools.wraps(fn)
    def traced(*args):
      with lowering_for(self.platform):
        return fn(*args)
    return traced

  def summed_gradients(self, gradients_fn=None):
    """(params, batch) -> (gradient shards, loss stats), both summed over the batch: the step
    without its optimizer (benchmarks, memory checks). `gradients_fn` replaces the step's
    own (params, batch) -> ... per-device function, e.g. the pipeline baseline."""
    return jax.jit(jax.shard_map(self._for_platform(gradients_fn or self._summed_gradients), mesh=self.mesh,
                                 in_specs=(self.state_specs.params, batch_spec(self.mesh)),
                                 out_specs=(self.state_specs.params, P())))

  def train_step(self, with_gradients: bool = False):
    """(state, batch) -> (state, metrics), the state donated; with_gradients=True also returns
    the step's gradients (mean over the batch's tokens, sharded like the params)."""
    out_specs = (self.state_specs, P()) + ((self.state_specs.params,) if with_gradients else ())
    mapped = jax.shard_map(self._for_platform(functools.partial(self._train_step, with_gradients=with_gradients)),
                           mesh=self.mesh,
                           in_specs=(self.state_specs, batch_spec(self.mesh)), out_specs=out_specs)
    return jax.jit(mapped, donate_argnums=0, compiler_options=self.compiler_options)

  def compiled_train_step(self):
    """train_step(), compiled now from abstract inputs (ahead of the first step)."""
    return self.train_step().lower(*self.abstract_inputs()).compile()

  # --- Held-out evaluation: the forward alone, on the same mesh and layouts.

  def _eval_sums(self, params, batch):
    """ZeRO gather -> the forward of every microbatch -> the loss sums, per device; summed
    over dp (and pp) so every device holds the batch's global sums. No gradients, no z-loss:
    the held-out loss is the cross-entropy alone."""
    p, microbatch_count = self.parallel, self.train.microbatches
    batch = self._in_context_shards(batch)
    if self.pipeline is not None:
      stats = pipeline_loss_sums(params, batch, self.layouts, p.pp, p.virtual_stages, microbatch_count,
                                 self.model.config, self.overlap, bucket_bytes=p.dp_bucket_bytes)
    else:
      full_params = zero.gather_params(params, self.layouts, self.model.config.compute_dtype,
                                       bucket_bytes=p.dp_bucket_bytes, model=self.model.config)
      microbatches = split_microbatches(batch, microbatch_count)
      # One microbatch's activations at a time, as in training; the zeros are typed like the
      # batch (inside the shard_map the sums vary over dp as it does).
      start = jnp.zeros_like(microbatches["loss_mask"][0, 0, 0], jnp.float32)

      def one_microbatch(sums, microbatch):
        _, stats = jax.named_scope("forward")(loss_sums)(full_params, microbatch, self.model.config, self.overlap)
        return {k: sums[k] + stats[k] for k in sums}, None

      stats, _ = lax.scan(one_microbatch, {"nll_sum": start, "tokens": start}, microbatches)
      stats = {k: collectives.psum(v, (DP, CP)) for k, v in stats.items()}
    return {"eval_loss_sum": stats["nll_sum"], "eval_tokens": stats["tokens"]}

  def eval_step(self):
    """(params, batch) -> {"eval_loss_sum", "eval_tokens"}: the batch's summed cross-entropy and
    its token count, global (every device holds them). Sum over batches, then divide: the
    held-out loss is the mean over every token. Nothing is donated: the state trains on."""
    mapped = jax.shard_map(self._for_platform(self._eval_sums), mesh=self.mesh, in_specs=(self.state_specs.params, batch_spec(self.mesh)),
                           out_specs=P())
    return jax.jit(mapped, compiler_options=self.compiler_options)

  def compiled_eval_step(self):
    state, batch = self.abstract_inputs()
    return self.eval_step().lower(state.params, batch).compile()

  @property
  def compiler_options(self) -> dict | None:
    """XLA options the step compiles with: the windowed-einsum ones in tp_overlap="xla"; on a
    GPU with tp > 1, DotMerger off in tp_overlap="collective_matmul" (COLLECTIVE_MATMUL_OPTIONS)."""
    if self.overlap.mode == "xla":
      return XLA_WINDOWED_EINSUM_OPTIONS
    if self.overlap.mode == "collective_matmul" and self.mesh.shape[TP] > 1 and self.platform in ("gpu", "cuda"):
      return COLLECTIVE_MATMUL_OPTIONS
    return None
