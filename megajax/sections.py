"""Every config field once: its type, its default and what it means, section by section.

Each section is a frozen dataclass. The experiment file's ConfigDict (megajax.config:
`default_config()`, the `--config.a.b=v` flags, config.json) is built from these defaults, so a
field's default and type live here only; its checks are megajax.config's `_check_<section>`.
A run turns its checked ConfigDict into these sections once (`RunConfig.of`, at the bottom:
the model's as `ModelConfig`, the section resolved); the layers below take the section they
need. The values a section derives from its own fields (a mesh shape, the per-platform
defaults, whether batches carry documents) are its properties, computed in one place.
Nothing here imports jax: the launcher reads this before it starts one.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing

import ml_collections
import ml_dtypes
import numpy as np


# --- model ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ModelSection:
  """The model as the file states it (zeros meaning "the default"); megajax.model.ModelConfig
  is its resolved form (widths filled in, dtypes), the one the code below reads."""

  vocab_size: int = 256
  seq_len: int = 128
  num_layers: int = 2
  hidden_dim: int = 64
  num_heads: int = 4
  num_kv_heads: int = 0       # 0: as many KV heads as query heads (no grouping).
  mlp_dim: int = 0            # 0: 4 * hidden_dim (also for swiglu; Llama's 8/3 ratio is set explicitly).
  window: int = 0             # Sliding-window width w; 0: full causal attention.
  window_pattern: str = "L"   # Per layer, repeated: L = local (window), G = global.
  # "parallel" (MegaScale PTB: x + Attn(N(x)) + MLP(N(x))), "parallel_two_norms" (GPT-NeoX:
  # x + Attn(N1(x)) + MLP(N2(x))) or "serial" (GPT, Llama: z = x + Attn(N1(x)); z + MLP(N2(z))).
  block: str = "parallel"
  norm: str = "layernorm"     # "layernorm" (scale and bias), "layernorm_nobias" (scale: Cohere) or
                              # "rmsnorm" (Llama: scale only).
  mlp: str = "gelu"           # "gelu" (wi, wo; tanh GeLU), "gelu_exact" (erf GeLU: Pythia) or "swiglu"
                              # (Llama: wo(silu(wi_gate(x)) * wi_up(x))).
  attention_impl: str = "xla"
  compute_dtype: str = "bfloat16"
  param_dtype: str = "float32"
  tie_embeddings: bool = False
  use_bias: bool = True       # biases in the attention and MLP linears (False: Llama, PaLM).
  qkv_bias: bool = False      # biases on the query, key and value projections even without use_bias (Qwen2).
  rope_theta: float = 10000.0
  global_rope: bool = True    # False: global (G) layers see no positions (NoPE; Cohere2's), local ones rotate.
  logit_scale: float = 1.0    # The logits times this (Cohere's 0.0625): in the loss, sampling and export.
  layernorm_epsilon: float = 1e-5   # the epsilon of model.norm, either kind.
  init_std: float = 0.02
  remat: str = "none"         # Activation recomputation per block.


def _dtype(name) -> np.dtype:
  """A dtype by name ("bfloat16" is ml_dtypes', the one jax uses) or the dtype itself."""
  return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


@dataclasses.dataclass(frozen=True)
class ModelConfig(ModelSection):
  """The model section resolved, what the model code reads: num_kv_heads and mlp_dim of 0
  filled in (num_heads; 4 * hidden_dim), window 0 as None (full causal), compute_dtype and
  param_dtype as numpy dtypes. Its fields are ModelSection's (a model field is stated once)."""

  def __post_init__(self):
    resolved = {"num_kv_heads": self.num_kv_heads or self.num_heads, "mlp_dim": self.mlp_dim or 4 * self.hidden_dim,
                "window": self.window or None, "compute_dtype": _dtype(self.compute_dtype),
                "param_dtype": _dtype(self.param_dtype)}
    for name, value in resolved.items():       # frozen: set once, here (resolving twice changes nothing)
      object.__setattr__(self, name, value)

  @classmethod
  def from_config(cls, model) -> "ModelConfig":
    """`model`: the config's model section (ModelSection, its ConfigDict node, or a ModelConfig)."""
    return cls(**{f.name: getattr(model, f.name) for f in dataclasses.fields(cls)})

  @property
  def head_dim(self) -> int:
    return self.hidden_dim // self.num_heads

  def layer_window(self, layer: int) -> int | None:
    """The window of one layer: `window` on local (L) layers, None on global (G) ones."""
    local = self.window_pattern[layer % len(self.window_pattern)] == "L"
    return self.window if local else None


# --- train ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TrainSection:
  steps: int = 200
  batch_size: int = 16        # Global batch, in sequences.
  microbatches: int = 1       # Gradient accumulation inside one step.
  seed: int = 0
  log_every: int = 10
  z_loss: float = 0.0         # Weight of the z-loss (mean logsumexp^2).
  # Non-finite loss or gradients: the update is skipped (counted in `skipped_steps`); after this
  # many consecutive skips the run rolls back to the latest checkpoint and reads on past the
  # batches that failed. No NaN or Inf is ever saved.
  nonfinite_rollback_after: int = 3
  # Held-out loss every eval_every steps and after the last one (0: never), over eval_batches
  # batches of train.batch_size rows of the eval data (data.eval_path / data.eval_fraction).
  eval_every: int = 0
  eval_batches: int = 8
  # Fine-tuning: a fresh run (no checkpoint in the workdir yet) starts from these parameters
  # instead of a random init: a directory megajax.checkpoint.save_params wrote (another run's
  # WORKDIR/params, megajax-import-hf's WORKDIR/hf_import/params). "": random init.
  init_params: str = ""
  # The memory check before anything compiles (parallel/planner/fits.py) refuses a job whose
  # estimate is over its devices' memory; True runs it anyway (a warning), e.g. where XLA's
  # rematerialization is known to save what the estimate counts.
  force_memory: bool = False


# --- optimizer --------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class OptimizerSection:
  name: str = "lamb"
  learning_rate: float = 1e-2   # Peak learning rate.
  warmup_steps: int = 20
  end_lr_ratio: float = 0.1     # Final learning rate as a fraction of the peak.
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-6
  weight_decay: float = 0.01
  grad_clip_norm: float = 1.0   # 0 disables global-norm clipping.


# --- parallel ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class FbdSection:
  # MegaFBD (MegatronApp section 4; megajax.parallel.fbd): the forward of every microbatch on a
  # group of devices of its own (forward_dp x forward_tp of them, the job's first), the backward
  # and the optimizer on the rest (parallel.dp x parallel.tp, pp = 1): the job has
  # forward_dp * forward_tp + dp * tp devices. Residuals stream forward -> backward per
  # microbatch, the weights (in the compute dtype) backward -> forward once per step. One process.
  enabled: bool = False
  forward_dp: int = 1
  forward_tp: int = 1


@dataclasses.dataclass(frozen=True)
class ParallelSection:
  dp: int = 1
  pp: int = 1
  # Context parallelism: each row's positions split over cp devices (the ring's dual-chunk
  # layout: rank r holds chunks r and 2cp-1-r of 2cp), parameters replicated like dp, gradients
  # reduced over dp x cp. Sliding-window layers exchange a halo of window-1 keys, global layers
  # pass K/V round a ring (megajax.parallel.context_parallel). For sequences one device's
  # activations cannot hold.
  cp: int = 1
  tp: int = 1
  # How tensor-parallel collectives meet the matmuls: "none" (all-gather, then matmul),
  # "collective_matmul" (ppermute rings fused with the matmul chunks, MegaScale Fig. 3c) or
  # "xla" (plain collectives + XLA's windowed-einsum rewrite on GPU). Unset (None): chosen by
  # measurement per platform (tp_overlap_on(platform)): collective_matmul on GPUs, none
  # on CPU, where a collective is a copy with nothing to hide it under (bench peer, dp=2 tp=4:
  # 2613 vs 2970 ms a step; jit Megatron-TP 2667).
  tp_overlap: str | None = None
  tp_overlap_chunks: int = 2    # Sequence chunks per ring step (2: one per ring direction).
  # Pipeline (pp > 1): the layers are cut into pp * virtual_stages chunks, stage s holding
  # chunks s, s + pp, ...; train.microbatches microbatches flow through them in this order.
  virtual_stages: int = 1       # Model chunks per stage (Megatron's interleaving, v).
  schedule: str = "interleaved_1f1b"   # "gpipe", "1f1b" (v=1) or "interleaved_1f1b".
  traversal: str = "depth_first"       # Or "breadth_first": more in flight, fewer switches.
  # A chunk's backward: False reads the residuals its forward kept (what model.remat saves),
  # held from forward to backward in up to the schedule's in-flight count of slots; True
  # reruns the chunk's forward from its stashed input, keeping only that input (a whole
  # forward more per step: the low-memory option). Unset (None): chosen by measurement per
  # platform (pipeline_recompute_on(platform)): False on GPUs, True on CPU, where
  # XLA:CPU copies the residual slots every tick (bench peer, pp=2 v=2: 2180 vs 2912 ms).
  pipeline_recompute: bool | None = None
  # Gradient sync over dp. "step": each device sums its microbatches' gradients locally in
  # fp32 and reduce-scatters them once per step (one collective per leaf, 1/m of the dp
  # traffic), holding a full, dp-unsharded fp32 gradient of its tp shard (and pp stage) for
  # the step: params/(tp*pp) * 4 bytes. "microbatch": every microbatch's gradients are
  # reduce-scattered as they come, so only the 1/dp shard is carried (the low-memory option,
  # m times the dp traffic).
  grad_sync: str = "step"
  # ZeRO's collectives over dp: a fused matmul's kernels move as its one operand (the gathered
  # buffer is the operand), every other matrix alone; the small leaves (norm scales, biases)
  # packed into all-gathers and reduce-scatters of at most this many MiB each, in the order the
  # forward uses them (the backward makes them); 0: one collective per leaf. Fewer, larger
  # collectives: each costs a launch and a rendezvous (XLA:GPU combines independent ones too).
  dp_bucket_mb: float = 32.0
  fbd: FbdSection = dataclasses.field(default_factory=FbdSection)

  @property
  def mesh_shape(self) -> tuple[int, int, int, int]:
    """The (dp, pp, cp, tp) sizes of the mesh (megajax.parallel.mesh.MESH_AXES' order)."""
    return (self.dp, self.pp, self.cp, self.tp)

  @property
  def device_count(self) -> int:
    """The devices the job runs on: dp * pp * cp * tp, plus MegaFBD's forward group."""
    forward = self.fbd.forward_dp * self.fbd.forward_tp if self.fbd.enabled else 0
    return self.dp * self.pp * self.cp * self.tp + forward

  @property
  def dp_bucket_bytes(self) -> int:
    """dp_bucket_mb in bytes: the most one ZeRO collective of small leaves (norm scales,
    biases) carries (0: one per leaf); matrices move alone or as a fused operand (megajax.parallel.zero)."""
    return int(self.dp_bucket_mb * 2**20)

  def tp_overlap_on(self, platform: str) -> str:
    """tp_overlap, or where unset the measured default of `platform` ("cpu": "none";
    "gpu" / "cuda": "collective_matmul")."""
    return ("none" if platform == "cpu" else "collective_matmul") if self.tp_overlap is None else self.tp_overlap

  def pipeline_recompute_on(self, platform: str) -> bool:
    """pipeline_recompute, or where unset the measured default of `platform` ("cpu": rerun the
    chunk's forward; "gpu" / "cuda": read the kept residuals)."""
    return platform == "cpu" if self.pipeline_recompute is None else bool(self.pipeline_recompute)


# --- data -------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class DataSection:
  source: str = "synthetic"   # "synthetic" or "tokens" (a megajax-prepare-data file).
  path: str = ""              # Token file (.bin with its .json, or .npy) for "tokens".
  # Instead of data.path: several token files read in proportion to their weights,
  # "books.bin:0.7,code.bin:0.3" (one tokenizer and vocabulary for all).
  mixture: str = ""
  # Token data: a row's documents attend only within themselves (the batch carries
  # segment_ids and positions) and no loss on predicting a document's first token from the
  # previous document's EOS. Synthetic data has no documents.
  document_masking: bool = True
  # Evaluation data, one of: a token file, or a fraction of the training file's documents held
  # out (chosen by a hash of the document number; never trained on). Neither: no eval data.
  eval_path: str = ""
  eval_fraction: float = 0.0
  # Hash the whole .bin when it is opened and compare with its sidecar's checksum: up to ~1 s per
  # GB per process. False for corpora where that start-up cost matters (every record's ids are
  # still range-checked); `megajax-prepare-data --verify=FILE` checks a file once instead.
  verify_checksum: bool = True
  shuffle: bool = True
  synthetic_records: int = 1_000_000
  read_threads: int = 2
  prefetch: int = 4           # Batches the loader prepares ahead of the step.

  @property
  def packs_documents(self) -> bool:
    """Does the batch carry segment_ids and positions (documents packed in rows)? The loader
    emits them exactly then; the step and the model read them."""
    return self.source == "tokens" and bool(self.document_masking)


# --- checkpoint -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class CheckpointSection:
  save_params: bool = True    # Write WORKDIR/params (Orbax) when training ends.
  # Training checkpoints in WORKDIR/checkpoints: every `every_steps` steps (0: only at the end
  # and on preemption), asynchronous (the step waits only for the device -> host copy). A
  # relaunch with the same workdir resumes from the latest complete one.
  every_steps: int = 100
  keep: int = 3               # The last `keep` checkpoints ...
  keep_period: int = 0        # ... plus every step divisible by this one, forever (0: none).
  async_save: bool = True
  # A 64-bit checksum of every saved array, computed on the devices and checked on restore (a
  # mismatch: the checkpoint is quarantined, the previous one used). Off only where its cost
  # matters more than catching a damaged file: on CPU hosts, whose 2 cores run every emulated
  # device, its launch adds ~0.07 s per GB to the step's wait (docs/checkpoints.md).
  checksums: bool = True
  # "direct": every process reads its own shards; "broadcast": data-parallel replica 0 reads,
  # the other replicas receive over the interconnect (MegaScale 4.4), at most this much at once.
  restore_mode: str = "direct"
  broadcast_memory_limit_mib: int = 1024


# --- runtime ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RuntimeSection:
  # Start-up (megajax-train): XLA's persistent compilation cache, so a restart skips compiling
  # ("": WORKDIR/jax_cache; "none": off), and the XLA / NCCL presets for GPUs
  # (megajax.launch.runtime: "auto" or "none"), with extra XLA flags that override them.
  compilation_cache_dir: str = ""
  xla_preset: str = "auto"
  xla_flags: str = ""
  # Python's cyclic garbage collector: off for the whole run, and every process collects at the
  # same steps, every `gc_every_steps` (0: Python's automatic collections). Tracing the step
  # allocates millions of objects, and the automatic collections walk the growing heap again and
  # again (a sixth of a small job's CPU time); in the loop, one rank's collection pauses every
  # other in the next collective (Megatron-LM's --manual-gc).
  gc_every_steps: int = 1000


# --- supervisor -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SupervisorSection:
  # megajax-supervise: heartbeats (a file per worker in WORKDIR/heartbeats), failure detection
  # and automatic restart from the latest checkpoint.
  processes: int = 1            # Worker processes (one per host).
  devices_per_process: int = 0  # Local CPU workers: devices each (0: the mesh / processes).
  # How to start the job: "" starts local processes; otherwise a shell command template run
  # once per (re)start, e.g. "srun --nodes={processes} --ntasks-per-node=1 {train}", where
  # {train} is the worker's command line (topology auto-detected by jax.distributed); also
  # {args}, {processes}, {exclude} and the variables MEGAJAX_PROCESSES, MEGAJAX_EXCLUDE_HOSTS.
  command: str = ""
  stop_command: str = ""        # Run after stopping `command`'s job (kubectl delete ...).
  heartbeat_interval_s: float = 1.0
  heartbeat_timeout_s: float = 10.0    # No heartbeat for this long: the worker is lost.
  hang_timeout_s: float = 120.0        # No step finished for this long: the job hangs.
  startup_timeout_s: float = 1800.0    # The first step (start, restore, compile) must end by then.
  max_restarts: int = 3
  diagnose: bool = True         # Run megajax-diagnose after a failure.
  elastic: bool = True          # Continue on fewer hosts (smaller dp) without a bad one ...
  spares: int = 0               # ... unless the allocation has spare hosts to replace it.


# --- observe ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ObserveSection:
  # Observability (megajax.observe): sampled traces, activation capture and perturbations.
  # Every N steps each process traces one step with jax.profiler into WORKDIR/traces/step_<n>
  # (merge, heat map and stragglers: megajax-trace WORKDIR); 0: off.
  trace_every: int = 0
  # Observation points "layer:tensor,...", tensor one of CAPTURE_TENSOR_CHOICES, layer an index
  # or * (e.g. "0:attn_probs,*:residual"): statistics (and a small sample) of each, computed every
  # step, read one step late and appended to WORKDIR/activations.jsonl every `capture_every`
  # steps (the device work does not thin out: capture few points on big runs). "": off.
  capture: str = ""
  capture_every: int = 1
  capture_sample: int = 0     # Also the first N values of each captured tensor (0: none).
  # Perturbation for robustness experiments: "" (off), "noise" (Gaussian, std perturb_scale),
  # "offset" (+perturb_scale) or "bitflip" (bit perturb_bit of a perturb_fraction of the
  # elements), applied at perturb_at: "layer:<i>" (layer i's output) or "stage:<s>" (the
  # activations pipeline stage s sends on).
  perturb: str = ""
  perturb_at: str = ""
  perturb_scale: float = 0.0
  perturb_bit: int = 30
  perturb_fraction: float = 1e-3
  # Weights & Biases as a tracker (pip install 'megajax[wandb]'; nothing of it is imported when
  # off): a project name logs what TensorBoard gets (loss, eval, throughput, MFU, goodput/*,
  # checkpoint times; x axis train/step) and the config, from process 0, into one W&B run per
  # workdir: a restart or resume continues it (its id is kept in WORKDIR/wandb_run_id). Its files
  # go under WORKDIR/wandb/; WANDB_MODE=offline keeps them there, no network (`wandb sync` uploads).
  wandb_project: str = ""
  wandb_entity: str = ""      # the team or user; "": W&B's default for the logged-in account

  @property
  def wants_probes(self) -> bool:
    """Does the step carry probes (capture or perturb)? megajax.observe.Probes.of builds them."""
    return bool(self.capture or self.perturb)


# --- debug: fault drills (megajax.trainer.drills) ---------------------------------------------

@dataclasses.dataclass(frozen=True)
class DebugSection:
  fail_at_step: int = 0         # Fail this process after that step (0: never) ...
  fail_process: int = -1        # ... only this process (-1: every process) ...
  fail_mode: str = "kill"       # ... "kill": SIGKILL (a crash); "hang": SIGSTOP (a silent host).
  nonfinite_steps: str = ""     # "8,9,10" makes those steps' loss NaN.
  diagnose_slow_process: int = -1   # megajax-diagnose sees this process slow.
  # Straggler: the rank "dp,pp,tp" runs `slow_rank_work` extra matmuls of the hidden size
  # once per step, after its gradients, under the "forward" scope (megajax-trace should name it; "": off).
  slow_rank: str = ""
  slow_rank_work: int = 8
  slow_rank_from_step: int = 0  # ... from this step on (one compiled program, before and after).


# The sections in the order megajax.config checks them (a section's checks may read the ones before).
SECTION_TYPES = {
    "model": ModelSection,
    "train": TrainSection,
    "optimizer": OptimizerSection,
    "parallel": ParallelSection,
    "data": DataSection,
    "checkpoint": CheckpointSection,
    "runtime": RuntimeSection,
    "supervisor": SupervisorSection,
    "observe": ObserveSection,
    "debug": DebugSection,
}


def to_config_dict(section_type: type) -> ml_collections.ConfigDict:
  """A section's defaults as the ConfigDict the files and flags set: each field typed by its
  default (an int field refuses a string), an optional one (`str | None`) a placeholder of its type."""
  node = ml_collections.ConfigDict()
  hints = typing.get_type_hints(section_type)
  for field in dataclasses.fields(section_type):
    kind = hints[field.name]
    if dataclasses.is_dataclass(kind):
      node[field.name] = to_config_dict(kind)
    elif field.default is None:
      (kind,) = [arg for arg in typing.get_args(kind) if arg is not types.NoneType]
      node[field.name] = ml_collections.config_dict.placeholder(kind)
    else:
      node[field.name] = field.default
  return node


def from_config_dict(section_type: type, node) -> object:
  """The frozen section of a (checked) ConfigDict node."""
  hints = typing.get_type_hints(section_type)
  nested = lambda kind, value: from_config_dict(kind, value) if dataclasses.is_dataclass(kind) else value
  return section_type(**{f.name: nested(hints[f.name], node[f.name]) for f in dataclasses.fields(section_type)})


def section(config, name: str):
  """One frozen section of a ConfigDict (`section(config, "parallel").mesh_shape`), for a tool
  that reads one derived value (a run resolves all of them once: RunConfig.of); of a
  RunConfig, its own."""
  node = getattr(config, name)
  return node if isinstance(node, SECTION_TYPES[name]) else from_config_dict(SECTION_TYPES[name], node)


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """A run's config resolved once: every section frozen and typed, the model's resolved. The
  trainer and the tools make it where they read the file (after megajax.config.validate); the
  layers below take the section they need (`run.parallel`, `run.data`, ...), never the dict."""

  model: ModelConfig
  train: TrainSection
  optimizer: OptimizerSection
  parallel: ParallelSection
  data: DataSection
  checkpoint: CheckpointSection
  runtime: RuntimeSection
  supervisor: SupervisorSection
  observe: ObserveSection
  debug: DebugSection
  # The config as its file and flags gave it (JSON): what config.json, a checkpoint's metadata
  # and the trackers record, and what a resumed run is compared with.
  json: str

  @classmethod
  def of(cls, config: "ml_collections.ConfigDict | RunConfig") -> "RunConfig":
    """`config`'s sections (as it is when it is a RunConfig already: the library's constructors
    take either). Not checked here: the trainer and the tools check the file where they read it."""
    if isinstance(config, RunConfig):
      return config
    sections = {name: from_config_dict(section_type, config[name]) for name, section_type in SECTION_TYPES.items()}
    sections["model"] = ModelConfig.from_config(sections["model"])
    return cls(**sections, json=config.to_json(indent=2))

  @property
  def record(self) -> dict:
    """The config as plain JSON values, {"model": {...}, ...}."""
    return json.loads(self.json)
