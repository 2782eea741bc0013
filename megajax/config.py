"""The experiment config: every field with its default and its checks, section by section.

A config file is plain Python with a `get_config()` returning a ConfigDict (see configs/).
Files start from `default_config()` so that every experiment has the same, locked field set:
a typo in `--config.model.num_layer=4` fails loudly.

Each section below is a pair: `_<section>()` with the fields and their defaults, then
`_check_<section>(config)` with their checks, so a knob's default sits next to its check.
`validate(config)` runs the checks in section order before anything is compiled; it raises
`ConfigError`, whose one-line message names the field path and the fix. A check that ties a
field to another section's (heads to parallel.tp, say) sits in the later section. The names
a choice field accepts are module constants `<FIELD>_CHOICES`; code that implements a choice
keys its registry by them (e.g. megajax.layers.ATTENTION_IMPLS, tested equal).
"""

from __future__ import annotations

import importlib.util

import json
import os

import ml_collections

from megajax import config_checks as check
from megajax.layers.families import ATTENTION_FUSED, BLOCK_FAMILIES, MLP_FAMILIES, NORM_FAMILIES
from megajax.config_checks import ConfigError

# The repository's root and its configs/ (the package is installed editable, README): the
# benchmarks run the launcher from there, the planner reads the paper's 175B config.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS_DIR = os.path.join(REPO, "configs")


# --- model ------------------------------------------------------------------------------------

# The families' names: the keys of their rows in megajax.layers.families (one place states each).
BLOCK_CHOICES = tuple(BLOCK_FAMILIES)             # parallel, parallel_two_norms, serial
NORM_CHOICES = tuple(NORM_FAMILIES)               # layernorm, layernorm_nobias, rmsnorm
MLP_CHOICES = tuple(MLP_FAMILIES)                 # gelu, gelu_exact, swiglu
ATTENTION_IMPL_CHOICES = tuple(ATTENTION_FUSED)   # xla, pallas, cudnn (megajax.layers.ATTENTION_IMPLS' keys too)
DTYPE_CHOICES = ("float32", "bfloat16", "float16")
REMAT_CHOICES = ("none", "full", "dots")              # megajax.model.REMAT_POLICIES' keys, and "none"


def _model() -> ml_collections.ConfigDict:
  m = ml_collections.ConfigDict()
  m.vocab_size = 256
  m.seq_len = 128
  m.num_layers = 2
  m.hidden_dim = 64
  m.num_heads = 4
  m.num_kv_heads = 0        # 0: as many KV heads as query heads (no grouping).
  m.mlp_dim = 0             # 0: 4 * hidden_dim (also for swiglu; Llama's 8/3 ratio is set explicitly).
  m.window = 0              # Sliding-window width w; 0: full causal attention.
  m.window_pattern = "L"    # Per layer, repeated: L = local (window), G = global.
  # "parallel" (MegaScale PTB: x + Attn(N(x)) + MLP(N(x))), "parallel_two_norms" (GPT-NeoX:
  # x + Attn(N1(x)) + MLP(N2(x))) or "serial" (GPT, Llama: z = x + Attn(N1(x)); z + MLP(N2(z))).
  m.block = "parallel"
  m.norm = "layernorm"      # "layernorm" (scale and bias), "layernorm_nobias" (scale: Cohere) or
                            # "rmsnorm" (Llama: scale only).
  m.mlp = "gelu"            # "gelu" (wi, wo; tanh GeLU), "gelu_exact" (erf GeLU: Pythia) or "swiglu"
                            # (Llama: wo(silu(wi_gate(x)) * wi_up(x))).
  m.attention_impl = "xla"
  m.compute_dtype = "bfloat16"
  m.param_dtype = "float32"
  m.tie_embeddings = False
  m.use_bias = True         # biases in the attention and MLP linears (False: Llama, PaLM).
  m.qkv_bias = False        # biases on the query, key and value projections even without use_bias (Qwen2).
  m.rope_theta = 10000.0
  m.global_rope = True      # False: global (G) layers see no positions (NoPE; Cohere2's), local ones rotate.
  m.logit_scale = 1.0       # The logits times this (Cohere's 0.0625): in the loss, sampling and export.
  m.layernorm_epsilon = 1e-5  # the epsilon of model.norm, either kind.
  m.init_std = 0.02
  m.remat = "none"          # Activation recomputation per block.
  return m


def _check_model(config) -> None:
  m = config.model
  for field in ("model.vocab_size", "model.seq_len", "model.num_layers", "model.hidden_dim", "model.num_heads"):
    check.positive_int(config, field)
  check.choice(config, "model.block", BLOCK_CHOICES)
  check.choice(config, "model.norm", NORM_CHOICES)
  check.boolean(config, "model.global_rope")
  check.boolean(config, "model.qkv_bias")
  check.require(check.finite(m.logit_scale) and m.logit_scale > 0, "model.logit_scale", m.logit_scale,
                "must be a finite number > 0", "e.g. 1.0 (none), or Cohere's 0.0625")
  check.choice(config, "model.mlp", MLP_CHOICES)
  check.choice(config, "model.attention_impl", ATTENTION_IMPL_CHOICES)
  check.choice(config, "model.compute_dtype", DTYPE_CHOICES)
  check.choice(config, "model.param_dtype", DTYPE_CHOICES)
  check.choice(config, "model.remat", REMAT_CHOICES)

  # Attention heads.
  check.require(m.hidden_dim % m.num_heads == 0, "model.num_heads", m.num_heads,
                f"model.hidden_dim={m.hidden_dim} is not divisible by it",
                f"use a divisor of {m.hidden_dim}, e.g. {check.nearest_divisor(m.hidden_dim, m.num_heads)}")
  head_dim = m.hidden_dim // m.num_heads
  check.require(head_dim % 2 == 0, "model.num_heads", m.num_heads,
                f"head dim {head_dim} is odd and rotary embeddings need it even",
                "pick num_heads so that hidden_dim / num_heads is even")
  check.require((m.num_kv_heads or 0) >= 0, "model.num_kv_heads", m.num_kv_heads, "must be >= 0",
                "set 0 (one KV head per query head) or a divisor of model.num_heads")
  kv_heads = m.num_kv_heads or m.num_heads
  check.require(m.num_heads % kv_heads == 0, "model.num_kv_heads", m.num_kv_heads,
                f"model.num_heads={m.num_heads} is not divisible by it",
                f"use a divisor of {m.num_heads}, e.g. {check.nearest_divisor(m.num_heads, kv_heads)}")
  check.require((m.mlp_dim or 0) >= 0, "model.mlp_dim", m.mlp_dim, "must be >= 0",
                "set 0 (4 * hidden_dim) or a positive width")

  # Sliding window.
  window = m.window or 0  # None (from Python) and 0 (from the command line) both mean full causal.
  check.require(isinstance(window, int) and 0 <= window <= m.seq_len, "model.window", m.window,
                f"must be between 1 and model.seq_len={m.seq_len}, or 0 for full causal attention",
                f"set --config.model.window to a value in [1, {m.seq_len}] or 0")
  pattern = m.window_pattern
  check.require(isinstance(pattern, str) and len(pattern) >= 1 and set(pattern) <= {"L", "G"},
                "model.window_pattern", pattern, "must be a non-empty string of L (local) and G (global)",
                "e.g. 'L' (every layer local) or 'LG' (alternate local and global)")
  check.require(window > 0 or "L" not in pattern or pattern == "L", "model.window_pattern", pattern,
                "has local layers but model.window=0", "set model.window to the local width")

  for field in ("model.rope_theta", "model.layernorm_epsilon", "model.init_std"):
    check.positive_number(config, field)


# --- train ------------------------------------------------------------------------------------

def _train() -> ml_collections.ConfigDict:
  t = ml_collections.ConfigDict()
  t.steps = 200
  t.batch_size = 16         # Global batch, in sequences.
  t.microbatches = 1        # Gradient accumulation inside one step.
  t.seed = 0
  t.log_every = 10
  t.z_loss = 0.0            # Weight of the z-loss (mean logsumexp^2).
  # Non-finite loss or gradients: the update is skipped (counted in `skipped_steps`); after this
  # many consecutive skips the run rolls back to the latest checkpoint and reads on past the
  # batches that failed. No NaN or Inf is ever saved.
  t.nonfinite_rollback_after = 3
  # Held-out loss every eval_every steps and after the last one (0: never), over eval_batches
  # batches of train.batch_size rows of the eval data (data.eval_path / data.eval_fraction).
  t.eval_every = 0
  t.eval_batches = 8
  # Fine-tuning: a fresh run (no checkpoint in the workdir yet) starts from these parameters
  # instead of a random init: a directory megajax.checkpoint.save_params wrote (another run's
  # WORKDIR/params, megajax-import-hf's WORKDIR/hf_import/params). "": random init.
  t.init_params = ""
  # The memory check before anything compiles (parallel/planner/fits.py) refuses a job whose
  # estimate is over its devices' memory; True runs it anyway (a warning), e.g. where XLA's
  # rematerialization is known to save what the estimate counts.
  t.force_memory = False
  return t


def _check_train(config) -> None:
  t = config.train
  for field in ("train.steps", "train.batch_size", "train.microbatches", "train.log_every"):
    check.positive_int(config, field)
  check.non_negative_number(config, "train.z_loss", "e.g. 1e-4, or 0 to disable")
  check.require(t.batch_size % t.microbatches == 0, "train.microbatches", t.microbatches,
                f"train.batch_size={t.batch_size} is not divisible by it",
                f"use a divisor of {t.batch_size}, e.g. {check.nearest_divisor(t.batch_size, t.microbatches)}")
  check.positive_int(config, "train.nonfinite_rollback_after")
  # (Whether there is eval data for train.eval_every is data's check: _check_data.)
  check.non_negative_int(config, "train.eval_every")
  check.positive_int(config, "train.eval_batches")
  # (Whether the directory holds this model's parameters is read when a fresh run starts.)
  check.require(isinstance(t.init_params, str), "train.init_params", t.init_params, "must be a directory path",
                "a parameters directory (a run's WORKDIR/params), or '' for a random init")
  check.boolean(config, "train.force_memory")


# --- optimizer --------------------------------------------------------------------------------

OPTIMIZER_CHOICES = ("lamb", "adamw")


def _optimizer() -> ml_collections.ConfigDict:
  o = ml_collections.ConfigDict()
  o.name = "lamb"
  o.learning_rate = 1e-2  # Peak learning rate.
  o.warmup_steps = 20
  o.end_lr_ratio = 0.1    # Final learning rate as a fraction of the peak.
  o.b1 = 0.9
  o.b2 = 0.999
  o.eps = 1e-6
  o.weight_decay = 0.01
  o.grad_clip_norm = 1.0  # 0 disables global-norm clipping.
  return o


def _check_optimizer(config) -> None:
  o, t = config.optimizer, config.train
  check.choice(config, "optimizer.name", OPTIMIZER_CHOICES)
  # Finite, and a learning rate of 0 is refused too: every update (weight decay included, which
  # LAMB and AdamW scale by it) would be a no-op, a run that trains nothing while looking fine.
  for field in ("optimizer.learning_rate", "optimizer.eps"):
    check.positive_number(config, field)
  check.require(0 <= o.b1 < 1, "optimizer.b1", o.b1, "must be in [0, 1)", "e.g. 0.9")      # nan, inf fail too
  check.require(0 <= o.b2 < 1, "optimizer.b2", o.b2, "must be in [0, 1)", "e.g. 0.999")
  check.non_negative_number(config, "optimizer.weight_decay", "e.g. 0.01")
  check.non_negative_number(config, "optimizer.grad_clip_norm", "e.g. 1.0, or 0 to disable clipping")
  check.require(0 <= o.end_lr_ratio <= 1, "optimizer.end_lr_ratio", o.end_lr_ratio, "must be in [0, 1]", "e.g. 0.1")
  check.require(isinstance(o.warmup_steps, int) and 0 <= o.warmup_steps < t.steps, "optimizer.warmup_steps",
                o.warmup_steps, f"must be in [0, train.steps={t.steps})", "shorten the warmup or train longer")


# --- parallel ---------------------------------------------------------------------------------

# How tensor-parallel collectives meet the matmuls (megajax.parallel.collective_matmul).
TP_OVERLAP_CHOICES = ("none", "collective_matmul", "xla")
# Pipeline schedules and traversals (megajax.parallel.pipeline.schedule takes its names from here).
SCHEDULE_CHOICES = ("gpipe", "1f1b", "interleaved_1f1b")
TRAVERSAL_CHOICES = ("depth_first", "breadth_first")
# When ZeRO-2 reduce-scatters the gradients over dp (megajax.parallel.step, pipeline.executor).
GRAD_SYNC_CHOICES = ("step", "microbatch")


def tp_overlap(config, platform: str) -> str:
  """parallel.tp_overlap, or where unset the measured default of `platform` ("cpu": "none";
  "gpu" / "cuda": "collective_matmul")."""
  value = config.parallel.tp_overlap
  return ("none" if platform == "cpu" else "collective_matmul") if value is None else value


def pipeline_recompute(config, platform: str) -> bool:
  """parallel.pipeline_recompute, or where unset the measured default of `platform` ("cpu":
  rerun the chunk's forward; "gpu" / "cuda": read the kept residuals)."""
  value = config.parallel.pipeline_recompute
  return platform == "cpu" if value is None else bool(value)


def dp_bucket_bytes(config) -> int:
  """parallel.dp_bucket_mb in bytes: the most one ZeRO collective of small leaves (norm scales,
  biases) carries (0: one per leaf); matrices move alone or as a fused operand (megajax.parallel.zero)."""
  return int(config.parallel.dp_bucket_mb * 2**20)


def _parallel() -> ml_collections.ConfigDict:
  p = ml_collections.ConfigDict()
  p.dp = 1
  p.pp = 1
  p.tp = 1
  # How tensor-parallel collectives meet the matmuls: "none" (all-gather, then matmul),
  # "collective_matmul" (ppermute rings fused with the matmul chunks, MegaScale Fig. 3c) or
  # "xla" (plain collectives + XLA's windowed-einsum rewrite on GPU). Unset (None): chosen by
  # measurement per platform (tp_overlap(config, platform)): collective_matmul on GPUs, none
  # on CPU, where a collective is a copy with nothing to hide it under (bench peer, dp=2 tp=4:
  # 2613 vs 2970 ms a step; jit Megatron-TP 2667).
  p.tp_overlap = ml_collections.config_dict.placeholder(str)
  p.tp_overlap_chunks = 2  # Sequence chunks per ring step (2: one per ring direction).
  # Pipeline (pp > 1): the layers are cut into pp * virtual_stages chunks, stage s holding
  # chunks s, s + pp, ...; train.microbatches microbatches flow through them in this order.
  p.virtual_stages = 1     # Model chunks per stage (Megatron's interleaving, v).
  p.schedule = "interleaved_1f1b"  # "gpipe", "1f1b" (v=1) or "interleaved_1f1b".
  p.traversal = "depth_first"      # Or "breadth_first": more in flight, fewer switches.
  # A chunk's backward: False reads the residuals its forward kept (what model.remat saves),
  # held from forward to backward in up to the schedule's in-flight count of slots; True
  # reruns the chunk's forward from its stashed input, keeping only that input (a whole
  # forward more per step: the low-memory option). Unset (None): chosen by measurement per
  # platform (pipeline_recompute(config, platform)): False on GPUs, True on CPU, where
  # XLA:CPU copies the residual slots every tick (bench peer, pp=2 v=2: 2180 vs 2912 ms).
  p.pipeline_recompute = ml_collections.config_dict.placeholder(bool)
  # Gradient sync over dp. "step": each device sums its microbatches' gradients locally in
  # fp32 and reduce-scatters them once per step (one collective per leaf, 1/m of the dp
  # traffic), holding a full, dp-unsharded fp32 gradient of its tp shard (and pp stage) for
  # the step: params/(tp*pp) * 4 bytes. "microbatch": every microbatch's gradients are
  # reduce-scattered as they come, so only the 1/dp shard is carried (the low-memory option,
  # m times the dp traffic).
  p.grad_sync = "step"
  # ZeRO's collectives over dp: a fused matmul's kernels move as its one operand (the gathered
  # buffer is the operand), every other matrix alone; the small leaves (norm scales, biases)
  # packed into all-gathers and reduce-scatters of at most this many MiB each, in the order the
  # forward uses them (the backward makes them); 0: one collective per leaf. Fewer, larger
  # collectives: each costs a launch and a rendezvous (XLA:GPU combines independent ones too).
  p.dp_bucket_mb = 32.0
  # MegaFBD (MegatronApp section 4; megajax.parallel.fbd): the forward of every microbatch on a
  # group of devices of its own (forward_dp x forward_tp of them, the job's first), the backward
  # and the optimizer on the rest (parallel.dp x parallel.tp, pp = 1): the job has
  # forward_dp * forward_tp + dp * tp devices. Residuals stream forward -> backward per
  # microbatch, the weights (in the compute dtype) backward -> forward once per step. One process.
  p.fbd = ml_collections.ConfigDict()
  p.fbd.enabled = False
  p.fbd.forward_dp = 1
  p.fbd.forward_tp = 1
  return p


def _check_parallel(config) -> None:
  m, p, t = config.model, config.parallel, config.train
  for field in ("parallel.dp", "parallel.pp", "parallel.tp", "parallel.tp_overlap_chunks", "parallel.virtual_stages"):
    check.positive_int(config, field)
  if p.tp_overlap is not None:
    check.choice(config, "parallel.tp_overlap", TP_OVERLAP_CHOICES)
  check.choice(config, "parallel.schedule", SCHEDULE_CHOICES)
  check.choice(config, "parallel.traversal", TRAVERSAL_CHOICES)
  check.choice(config, "parallel.grad_sync", GRAD_SYNC_CHOICES)
  if p.pipeline_recompute is not None:
    check.boolean(config, "parallel.pipeline_recompute")
  check.non_negative_number(config, "parallel.dp_bucket_mb", "use a size in MiB, e.g. 32 (0: one collective per leaf)")

  # Tensor + sequence parallelism: heads, KV heads, MLP units, vocabulary and sequence split over tp.
  kv_heads = m.num_kv_heads or m.num_heads
  check.require(m.num_heads % p.tp == 0, "model.num_heads", m.num_heads,
                f"not divisible by parallel.tp={p.tp}", "make the head count a multiple of parallel.tp")
  check.require(kv_heads % p.tp == 0, "model.num_kv_heads", m.num_kv_heads,
                f"{kv_heads} KV heads do not split over parallel.tp={p.tp}",
                "use a multiple of parallel.tp KV heads (or 0 for one per query head)")
  mlp_dim = m.mlp_dim or 4 * m.hidden_dim
  check.require(mlp_dim % p.tp == 0, "model.mlp_dim", m.mlp_dim,
                f"{mlp_dim} MLP units do not split over parallel.tp={p.tp}", "use a multiple of parallel.tp")
  check.require(m.vocab_size % p.tp == 0, "model.vocab_size", m.vocab_size,
                f"the vocabulary does not split over parallel.tp={p.tp}",
                f"pad it to a multiple of parallel.tp, e.g. {-(-m.vocab_size // p.tp) * p.tp} "
                "(extra ids are never seen)")
  check.require(m.seq_len % p.tp == 0, "model.seq_len", m.seq_len,
                f"sequence parallelism splits it over parallel.tp={p.tp}", "use a multiple of parallel.tp")
  if p.tp_overlap in (None, "collective_matmul"):     # unset: a GPU runs collective matmul
    check.require(m.seq_len % (p.tp * p.tp_overlap_chunks) == 0, "parallel.tp_overlap_chunks", p.tp_overlap_chunks,
                  f"each device's {m.seq_len // p.tp}-token sequence shard must split into this many chunks",
                  f"use a divisor of {m.seq_len // p.tp}, "
                  f"e.g. {check.nearest_divisor(m.seq_len // p.tp, p.tp_overlap_chunks)}")

  # Data parallelism: each microbatch's rows split over dp.
  check.require((t.batch_size // t.microbatches) % p.dp == 0, "train.batch_size", t.batch_size,
                f"a microbatch of {t.batch_size // t.microbatches} sequences does not split over parallel.dp={p.dp}",
                "make batch_size a multiple of microbatches * parallel.dp")

  # Pipeline.
  chunks = p.pp * p.virtual_stages
  check.require(p.pp == 1 or m.num_layers % chunks == 0, "model.num_layers", m.num_layers,
                f"the pipeline cuts the layers into parallel.pp * parallel.virtual_stages = {chunks} equal chunks",
                f"use a multiple of {chunks} layers, or fewer stages / virtual stages")
  check.require(p.pp == 1 or p.schedule != "1f1b" or p.virtual_stages == 1, "parallel.virtual_stages", p.virtual_stages,
                "the 1f1b schedule has one chunk per stage", "set parallel.schedule=interleaved_1f1b for more")
  if p.pp > 1 and p.schedule == "interleaved_1f1b" and p.virtual_stages > 1:
    check.require(t.microbatches % p.pp == 0, "train.microbatches", t.microbatches,
                  f"interleaved 1F1B sends microbatches through the chunks in groups of parallel.pp={p.pp}",
                  f"use a multiple of {p.pp}, e.g. {-(-t.microbatches // p.pp) * p.pp}")
  _check_fbd(config)


def _check_fbd(config) -> None:
  """parallel.fbd: the forward group splits the model as tp does; what the decoupled step does
  not run is refused here (its devices and processes at build: megajax.parallel.fbd)."""
  m, p, t, f = config.model, config.parallel, config.train, config.parallel.fbd
  check.boolean(config, "parallel.fbd.enabled")
  if not f.enabled:
    return
  for field in ("parallel.fbd.forward_dp", "parallel.fbd.forward_tp"):
    check.positive_int(config, field)
  kv_heads, mlp_dim = m.num_kv_heads or m.num_heads, m.mlp_dim or 4 * m.hidden_dim
  for size, what in ((m.num_heads, "heads"), (kv_heads, "KV heads"), (mlp_dim, "MLP units"),
                     (m.vocab_size, "vocabulary entries")):
    check.require(size % f.forward_tp == 0, "parallel.fbd.forward_tp", f.forward_tp,
                  f"the model's {size} {what} do not split over the forward group's tp",
                  f"use a divisor of {size}, e.g. {check.nearest_divisor(size, f.forward_tp)}")
  check.require((t.batch_size // t.microbatches) % f.forward_dp == 0, "parallel.fbd.forward_dp", f.forward_dp,
                f"a microbatch of {t.batch_size // t.microbatches} sequences does not split over it",
                f"use a divisor of {t.batch_size // t.microbatches}")
  # The decoupled step is two GSPMD programs per microbatch and a third for the update: what the
  # 3D step's shard_map adds (a pipeline, probes inside the model, the straggler drill's work,
  # a single module for the trace's operations) has no place in it.
  for field, value, ok, why, off in (
      ("parallel.pp", p.pp, p.pp == 1, "MegaFBD's groups are dp x tp each (no pipeline)", "1"),
      ("observe.capture", config.observe.capture, not config.observe.capture,
       "activation capture runs inside the 3D step's model", "''"),
      ("observe.perturb", config.observe.perturb, not config.observe.perturb,
       "perturbations run inside the 3D step's model", "''"),
      ("observe.trace_every", config.observe.trace_every, not config.observe.trace_every,
       "MegaScan's trace reads one compiled step's operations; MegaFBD's step is several programs "
       "(python -m megajax.launch.bench fbd traces their overlap)", "0"),
      ("debug.slow_rank", config.debug.slow_rank, not config.debug.slow_rank,
       "the straggler drill adds work inside the 3D step's shard_map", "''")):
    check.require(ok, field, value, f"not with parallel.fbd.enabled=True: {why}",
                  f"set {field}={off}, or parallel.fbd.enabled=False")


# --- data -------------------------------------------------------------------------------------

DATA_SOURCE_CHOICES = ("synthetic", "tokens")
TOKEN_FILE_SUFFIXES = (".bin", ".npy")
MIXTURE_EXAMPLE = "books.bin:0.7,code.bin:0.3"
EVAL_FRACTION_MAX = 0.5       # Holding out half or more of a corpus is a split, not an eval set.


def _data() -> ml_collections.ConfigDict:
  d = ml_collections.ConfigDict()
  d.source = "synthetic"     # "synthetic" or "tokens" (a megajax-prepare-data file).
  d.path = ""                # Token file (.bin with its .json, or .npy) for "tokens".
  # Instead of data.path: several token files read in proportion to their weights,
  # "books.bin:0.7,code.bin:0.3" (one tokenizer and vocabulary for all).
  d.mixture = ""
  # Token data: a row's documents attend only within themselves (the batch carries
  # segment_ids and positions) and no loss on predicting a document's first token from the
  # previous document's EOS. Synthetic data has no documents.
  d.document_masking = True
  # Evaluation data, one of: a token file, or a fraction of the training file's documents held
  # out (chosen by a hash of the document number; never trained on). Neither: no eval data.
  d.eval_path = ""
  d.eval_fraction = 0.0
  # Hash the whole .bin when it is opened and compare with its sidecar's checksum: up to ~1 s per
  # GB per process. False for corpora where that start-up cost matters (every record's ids are
  # still range-checked); `megajax-prepare-data --verify=FILE` checks a file once instead.
  d.verify_checksum = True
  d.shuffle = True
  d.synthetic_records = 1_000_000
  d.read_threads = 2
  d.prefetch = 4             # Batches the loader prepares ahead of the step.
  return d


def parse_mixture(text: str) -> list[tuple[str, float]]:
  """"books.bin:0.7,code.bin:0.3" -> [("books.bin", 0.7), ("code.bin", 0.3)]; a ConfigError on
  data.mixture for anything else (a missing weight, a weight <= 0, a path twice)."""
  fix = f"write it as FILE:WEIGHT,FILE:WEIGHT, e.g. --config.data.mixture='{MIXTURE_EXAMPLE}'"
  if not isinstance(text, str) or not text.strip():
    raise ConfigError("data.mixture", text, "no token files in it", fix)
  sources = []
  for item in text.split(","):
    path, colon, weight = item.strip().rpartition(":")   # rpartition: a path may hold a ':'
    try:
      weight = float(weight)
    except ValueError:
      weight = None
    if not colon or not path or weight is None:
      raise ConfigError("data.mixture", text, f"{item.strip()!r} is not FILE:WEIGHT", fix)
    check.require(check.finite(weight) and weight > 0, "data.mixture", text,
                  f"the weight of {path} is {weight}, not a finite number > 0", fix)
    check.require(path not in [p for p, _ in sources], "data.mixture", text, f"{path} is in it twice",
                  "name each file once, with the sum of its weights")
    sources.append((path, weight))
  return sources


def _check_token_file(field: str, path: str) -> None:
  check.require(path.endswith(TOKEN_FILE_SUFFIXES), field, path, "not a .bin or .npy token file",
                "make one with megajax-prepare-data")
  check.require(os.path.isfile(path), field, path, "file not found",
                "check the path, or make the file with megajax-prepare-data")


def _check_data(config) -> None:
  d, t = config.data, config.train
  check.choice(config, "data.source", DATA_SOURCE_CHOICES)
  check.require(d.read_threads >= 1, "data.read_threads", d.read_threads, "must be >= 1", "e.g. 2")
  check.require(d.prefetch >= 0, "data.prefetch", d.prefetch, "must be >= 0", "e.g. 4")
  f = d.eval_fraction
  check.require(check.finite(f) and 0 <= f < EVAL_FRACTION_MAX, "data.eval_fraction", f,
                f"must be in [0, {EVAL_FRACTION_MAX}) (0: no documents held out)", "e.g. 0.01")
  if d.source == "synthetic":
    # A token file named while synthetic data trains is a run on the wrong data: refuse it.
    for field in ("path", "mixture", "eval_path"):
      check.require(not d[field], f"data.{field}", d[field], "set while data.source='synthetic', which reads no file",
                    "train on it with --config.data.source=tokens")
    check.require(f == 0, "data.eval_fraction", f, "set while data.source='synthetic', which has no documents to "
                  "hold out (its eval records are fresh ones)", "train on a token file with --config.data.source=tokens")
    check.require(d.synthetic_records >= t.batch_size, "data.synthetic_records", d.synthetic_records,
                  f"smaller than train.batch_size={t.batch_size}", "raise it")
    return
  check.require(not (d.path and d.mixture), "data.mixture", d.mixture, f"set together with data.path={d.path!r}",
                "keep one: --config.data.path='' to train on the mixture")
  if d.mixture:
    for path, _ in parse_mixture(d.mixture):
      check.require(path.endswith(TOKEN_FILE_SUFFIXES) and os.path.isfile(path), "data.mixture", d.mixture,
                    f"{path} is not an existing .bin or .npy token file",
                    "check the paths, or make the files with megajax-prepare-data")
  else:
    check.require(bool(d.path), "data.path", d.path, "data.source='tokens' needs a .bin or .npy token file",
                  "make one with megajax-prepare-data and pass --config.data.path=FILE")
    _check_token_file("data.path", d.path)
  if d.eval_path:
    _check_token_file("data.eval_path", d.eval_path)
    check.require(f == 0, "data.eval_fraction", f, f"set together with data.eval_path={d.eval_path!r}",
                  "keep one: --config.data.eval_fraction=0 to evaluate on the file")
  eval_every = t.get("eval_every", 0)
  check.require(not eval_every or bool(d.eval_path) or f > 0, "data.eval_path", d.eval_path,
                f"train.eval_every={eval_every} evaluates, but token data has no eval data",
                "set --config.data.eval_path=FILE or --config.data.eval_fraction=0.01")


def uses_document_masking(config) -> bool:
  """Does the batch carry segment_ids and positions (documents packed in rows)? The loader
  emits them exactly then; the step and the model read them."""
  return config.data.source == "tokens" and bool(config.data.document_masking)


# --- checkpoint -------------------------------------------------------------------------------

RESTORE_MODE_CHOICES = ("direct", "broadcast")


def _checkpoint() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.save_params = True   # Write WORKDIR/params (Orbax) when training ends.
  # Training checkpoints in WORKDIR/checkpoints: every `every_steps` steps (0: only at the end
  # and on preemption), asynchronous (the step waits only for the device -> host copy). A
  # relaunch with the same workdir resumes from the latest complete one.
  c.every_steps = 100
  c.keep = 3             # The last `keep` checkpoints ...
  c.keep_period = 0      # ... plus every step divisible by this one, forever (0: none).
  c.async_save = True
  # A 64-bit checksum of every saved array, computed on the devices and checked on restore (a
  # mismatch: the checkpoint is quarantined, the previous one used). Off only where its cost
  # matters more than catching a damaged file: on CPU hosts, whose 2 cores run every emulated
  # device, its launch adds ~0.07 s per GB to the step's wait (docs/checkpoints.md).
  c.checksums = True
  # "direct": every process reads its own shards; "broadcast": data-parallel replica 0 reads,
  # the other replicas receive over the interconnect (MegaScale 4.4), at most this much at once.
  c.restore_mode = "direct"
  c.broadcast_memory_limit_mib = 1024
  return c


def _check_checkpoint(config) -> None:
  for field in ("checkpoint.every_steps", "checkpoint.keep_period"):
    check.non_negative_int(config, field)
  check.positive_int(config, "checkpoint.keep")
  for field in ("checkpoint.async_save", "checkpoint.checksums", "checkpoint.save_params"):
    check.boolean(config, field)
  check.positive_int(config, "checkpoint.broadcast_memory_limit_mib")
  check.choice(config, "checkpoint.restore_mode", RESTORE_MODE_CHOICES)


# --- runtime ----------------------------------------------------------------------------------

XLA_PRESET_CHOICES = ("auto", "none")


def _runtime() -> ml_collections.ConfigDict:
  # Start-up (megajax-train): XLA's persistent compilation cache, so a restart skips compiling
  # ("": WORKDIR/jax_cache; "none": off), and the XLA / NCCL presets for GPUs
  # (megajax.launch.runtime: "auto" or "none"), with extra XLA flags that override them.
  r = ml_collections.ConfigDict()
  r.compilation_cache_dir = ""
  r.xla_preset = "auto"
  r.xla_flags = ""
  # Python's cyclic garbage collector: off for the whole run, and every process collects at the
  # same steps, every `gc_every_steps` (0: Python's automatic collections). Tracing the step
  # allocates millions of objects, and the automatic collections walk the growing heap again and
  # again (a sixth of a small job's CPU time); in the loop, one rank's collection pauses every
  # other in the next collective (Megatron-LM's --manual-gc).
  r.gc_every_steps = 1000
  return r


def _check_runtime(config) -> None:
  check.choice(config, "runtime.xla_preset", XLA_PRESET_CHOICES)
  check.non_negative_int(config, "runtime.gc_every_steps")
  flags = config.runtime.xla_flags
  check.require(isinstance(flags, str) and all(f.startswith("--") for f in flags.split()),
                "runtime.xla_flags", flags, "must be XLA flags, each starting with --",
                "e.g. --config.runtime.xla_flags='--xla_gpu_enable_latency_hiding_scheduler=false'")


# --- supervisor -------------------------------------------------------------------------------

def _supervisor() -> ml_collections.ConfigDict:
  # megajax-supervise: heartbeats (a file per worker in WORKDIR/heartbeats), failure detection
  # and automatic restart from the latest checkpoint.
  s = ml_collections.ConfigDict()
  s.processes = 1              # Worker processes (one per host).
  s.devices_per_process = 0    # Local CPU workers: devices each (0: the mesh / processes).
  # How to start the job: "" starts local processes; otherwise a shell command template run
  # once per (re)start, e.g. "srun --nodes={processes} --ntasks-per-node=1 {train}", where
  # {train} is the worker's command line (topology auto-detected by jax.distributed); also
  # {args}, {processes}, {exclude} and the variables MEGAJAX_PROCESSES, MEGAJAX_EXCLUDE_HOSTS.
  s.command = ""
  s.stop_command = ""          # Run after stopping `command`'s job (kubectl delete ...).
  s.heartbeat_interval_s = 1.0
  s.heartbeat_timeout_s = 10.0   # No heartbeat for this long: the worker is lost.
  s.hang_timeout_s = 120.0       # No step finished for this long: the job hangs.
  s.startup_timeout_s = 1800.0   # The first step (start, restore, compile) must end by then.
  s.max_restarts = 3
  s.diagnose = True              # Run megajax-diagnose after a failure.
  s.elastic = True               # Continue on fewer hosts (smaller dp) without a bad one ...
  s.spares = 0                   # ... unless the allocation has spare hosts to replace it.
  return s


def _check_supervisor(config) -> None:
  s = config.supervisor
  check.positive_int(config, "supervisor.processes")
  check.non_negative_int(config, "supervisor.devices_per_process")
  check.non_negative_int(config, "supervisor.max_restarts")
  check.non_negative_int(config, "supervisor.spares")
  for field in ("heartbeat_interval_s", "heartbeat_timeout_s", "hang_timeout_s", "startup_timeout_s"):
    check.require(check.finite(s[field]) and s[field] > 0, f"supervisor.{field}", s[field],
                  "must be a finite number of seconds > 0", f"set --config.supervisor.{field} to a value > 0")
  check.require(s.heartbeat_timeout_s >= 2 * s.heartbeat_interval_s, "supervisor.heartbeat_timeout_s",
                s.heartbeat_timeout_s,
                f"a live worker beats only every heartbeat_interval_s={s.heartbeat_interval_s} s",
                "make it at least twice the interval")
  check.require(not s.command or "{train}" in s.command or "{args}" in s.command, "supervisor.command", s.command,
                "the template never starts the trainer",
                "put {train} where the megajax-train command line goes (or {args} for its flags alone)")


# --- observe ----------------------------------------------------------------------------------

CAPTURE_TENSOR_CHOICES = ("attn_probs", "attn_out", "mlp_out", "residual")
PERTURBATION_CHOICES = ("", "noise", "offset", "bitflip")


def _observe() -> ml_collections.ConfigDict:
  # Observability (megajax.observe): sampled traces, activation capture and perturbations.
  o = ml_collections.ConfigDict()
  # Every N steps each process traces one step with jax.profiler into WORKDIR/traces/step_<n>
  # (merge, heat map and stragglers: megajax-trace WORKDIR); 0: off.
  o.trace_every = 0
  # Observation points "layer:tensor,...", tensor one of CAPTURE_TENSOR_CHOICES, layer an index
  # or * (e.g. "0:attn_probs,*:residual"): statistics (and a small sample) of each, computed every
  # step, read one step late and appended to WORKDIR/activations.jsonl every `capture_every`
  # steps (the device work does not thin out: capture few points on big runs). "": off.
  o.capture = ""
  o.capture_every = 1
  o.capture_sample = 0      # Also the first N values of each captured tensor (0: none).
  # Perturbation for robustness experiments: "" (off), "noise" (Gaussian, std perturb_scale),
  # "offset" (+perturb_scale) or "bitflip" (bit perturb_bit of a perturb_fraction of the
  # elements), applied at perturb_at: "layer:<i>" (layer i's output) or "stage:<s>" (the
  # activations pipeline stage s sends on).
  o.perturb = ""
  o.perturb_at = ""
  o.perturb_scale = 0.0
  o.perturb_bit = 30
  o.perturb_fraction = 1e-3
  # Weights & Biases as a tracker (pip install 'megajax[wandb]'; nothing of it is imported when
  # off): a project name logs what TensorBoard gets (loss, eval, throughput, MFU, goodput/*,
  # checkpoint times; x axis train/step) and the config, from process 0, into one W&B run per
  # workdir: a restart or resume continues it (its id is kept in WORKDIR/wandb_run_id). Its files
  # go under WORKDIR/wandb/; WANDB_MODE=offline keeps them there, no network (`wandb sync` uploads).
  o.wandb_project = ""
  o.wandb_entity = ""       # the team or user; "": W&B's default for the logged-in account
  return o


def _check_observe(config) -> None:
  o, p = config.observe, config.parallel
  check.require(not o.wandb_project or importlib.util.find_spec("wandb") is not None, "observe.wandb_project",
                o.wandb_project, "Weights & Biases is not installed", "pip install 'megajax[wandb]', or set "
                "observe.wandb_project=''")
  check.require(not set("/\\#?%:") & set(o.wandb_project), "observe.wandb_project", o.wandb_project,
                "W&B project names cannot hold / \\ # ? % :", "e.g. my-gpt-runs")
  check.non_negative_int(config, "observe.trace_every")
  check.positive_int(config, "observe.capture_every")
  check.non_negative_int(config, "observe.capture_sample")
  for point in (x.strip() for x in o.capture.split(",") if x.strip()):
    layer, _, tensor = point.partition(":")
    known_layer = layer == "*" or (layer.isdigit() and int(layer) < config.model.num_layers)
    check.require(tensor in CAPTURE_TENSOR_CHOICES and known_layer,
                  "observe.capture", o.capture, f"{point!r} is not layer:tensor",
                  f"use e.g. '0:attn_probs,*:residual' with a layer below model.num_layers={config.model.num_layers} "
                  f"(or *) and a tensor in {CAPTURE_TENSOR_CHOICES}")
  check.require(not o.capture or p.pp == 1, "observe.capture", o.capture,
                f"activation capture runs without a pipeline only (parallel.pp={p.pp})",
                "capture on a run with parallel.pp=1 (same model, dp / tp as you like), or set observe.capture=''")
  check.choice(config, "observe.perturb", PERTURBATION_CHOICES)
  if o.perturb:
    kind, _, where = o.perturb_at.partition(":")
    limit = config.model.num_layers if kind == "layer" else p.pp
    check.require(kind in ("layer", "stage") and where.isdigit() and int(where) < limit, "observe.perturb_at",
                  o.perturb_at, "must name a layer or a pipeline stage",
                  f"e.g. 'layer:0' (below model.num_layers={config.model.num_layers}) "
                  f"or 'stage:0' (below parallel.pp={p.pp})")
    check.require(kind == "layer" or int(where) < p.pp - 1, "observe.perturb_at", o.perturb_at,
                  "the last stage sends no activations on", f"use a stage below parallel.pp - 1 = {p.pp - 1}")
    check.require(kind == "stage" or p.pp == 1, "observe.perturb_at", o.perturb_at,
                  f"a layer's output is perturbed without a pipeline only (parallel.pp={p.pp})",
                  "use 'stage:<s>' (what stage s sends on: its last layer's output), or parallel.pp=1")
    check.require(check.finite(o.perturb_scale), "observe.perturb_scale", o.perturb_scale, "must be finite",
                  "e.g. 0.1 (a non-finite perturbation is observe.perturb=bitflip's)")
    check.require(0 <= o.perturb_bit < 32, "observe.perturb_bit", o.perturb_bit, "must be a bit index", "0..31")
    check.require(0 < o.perturb_fraction <= 1, "observe.perturb_fraction", o.perturb_fraction,
                  "must be in (0, 1]", "e.g. 1e-3")


# --- debug: fault drills (megajax.trainer.drills) ---------------------------------------------

FAIL_MODES = ("kill", "hang")     # megajax.trainer.drills.FAIL_SIGNALS' keys

def _debug() -> ml_collections.ConfigDict:
  d = ml_collections.ConfigDict()
  d.fail_at_step = 0          # Fail this process after that step (0: never) ...
  d.fail_process = -1         # ... only this process (-1: every process) ...
  d.fail_mode = "kill"        # ... "kill": SIGKILL (a crash); "hang": SIGSTOP (a silent host).
  d.nonfinite_steps = ""      # "8,9,10" makes those steps' loss NaN.
  d.diagnose_slow_process = -1  # megajax-diagnose sees this process slow.
  # Straggler: the rank "dp,pp,tp" runs `slow_rank_work` extra matmuls of the hidden size
  # once per step, after its gradients, under the "forward" scope (megajax-trace should name it; "": off).
  d.slow_rank = ""
  d.slow_rank_work = 8
  d.slow_rank_from_step = 0   # ... from this step on (one compiled program, before and after).
  return d


def _check_debug(config) -> None:
  p = config.parallel
  check.non_negative_int(config, "debug.fail_at_step")
  check.require(isinstance(config.debug.fail_process, int) and config.debug.fail_process >= -1, "debug.fail_process",
           config.debug.fail_process, "must be a process index or -1", "e.g. 1, or -1 for every process")
  check.require(config.debug.fail_mode in FAIL_MODES, "debug.fail_mode", config.debug.fail_mode,
                f"must be one of {', '.join(FAIL_MODES)}", "kill (a crash) or hang (a process that stops answering)")
  steps = config.debug.nonfinite_steps
  check.require(isinstance(steps, str) and all(x.strip().isdigit() for x in steps.split(",") if x.strip()),
           "debug.nonfinite_steps", steps, "must be a comma-separated list of step numbers", "e.g. '8,9,10'")
  slow = config.debug.slow_rank
  if slow:
    parts = slow.split(",")
    sizes = (p.dp, p.pp, p.tp)
    check.require(len(parts) == 3 and all(x.strip().isdigit() and int(x) < n for x, n in zip(parts, sizes)),
                  "debug.slow_rank", slow, "must be 'dp,pp,tp' coordinates of a rank in the mesh",
                  f"e.g. '0,0,0' (mesh dp={p.dp} pp={p.pp} tp={p.tp})")
  check.positive_int(config, "debug.slow_rank_work")
  check.non_negative_int(config, "debug.slow_rank_from_step")


# --- The whole config ---------------------------------------------------------------------------

# Section -> (its defaults, its checks), in the order validate() checks them: a section's
# checks may read the sections before it.
SECTIONS = {
    "model": (_model, _check_model),
    "train": (_train, _check_train),
    "optimizer": (_optimizer, _check_optimizer),
    "parallel": (_parallel, _check_parallel),
    "data": (_data, _check_data),
    "checkpoint": (_checkpoint, _check_checkpoint),
    "runtime": (_runtime, _check_runtime),
    "supervisor": (_supervisor, _check_supervisor),
    "observe": (_observe, _check_observe),
    "debug": (_debug, _check_debug),
}


def default_config() -> ml_collections.ConfigDict:
  """All fields with their defaults: a tiny model that trains on a CPU."""
  c = ml_collections.ConfigDict()
  for name, (defaults, _) in SECTIONS.items():
    c[name] = defaults()
  return c


def validate(config: ml_collections.ConfigDict) -> None:
  """Checks the whole config; raises ConfigError on the first bad field. Touches no device."""
  for _, check_section in SECTIONS.values():
    check_section(config)


def wants_probes(config: ml_collections.ConfigDict) -> bool:
  """Does the step carry probes (observe.capture or observe.perturb)? megajax.observe.Probes
  builds them; megajax.parallel.ParallelStep refuses a config that wants them without them."""
  return bool(config.observe.capture or config.observe.perturb)


def load_config(path: str, overrides: dict | None = None) -> ml_collections.ConfigDict:
  """The config of `path`, with {"model.num_layers": 4, ...} applied, validated. `path` is a
  config file (`get_config()`, or `file.py:argument`: `get_config(argument)`), a run's workdir,
  or its config.json (read_run_config)."""
  file, colon, argument = path.partition(":")
  if os.path.isdir(path) or path.endswith(".json"):
    config = read_run_config(path)
  elif colon and not os.path.isfile(path):            # `file.py:argument`, as --config takes it
    config = check.read_config_file(file, argument)
  else:
    config = check.read_config_file(path)
  config = apply_overrides(config, overrides or {})
  validate(config)
  return config


def read_run_config(path: str) -> ml_collections.ConfigDict:
  """A run's config: `path` is its workdir or the config.json megajax-train wrote there. Read
  over today's defaults (a field added since keeps its default); the drills and probes, which
  only that training run wanted, back to their defaults. Not validated. A missing or unreadable
  file, or a field today's megajax lacks: a ConfigError naming it."""
  file = os.path.join(path, "config.json") if os.path.isdir(path) else path
  if not os.path.isfile(file):
    raise ConfigError("config", file, "not found", "pass a run's workdir (megajax-train --workdir=W writes "
                      "W/config.json), its config.json, or a config file such as configs/default.py")
  try:
    with open(file, encoding="utf-8") as f:
      saved = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
    raise ConfigError("config", file, f"unreadable ({check.one_line(error)})",
                      "it is a run's config as megajax-train writes it; pass another workdir") from None
  if not isinstance(saved, dict):
    raise ConfigError("config", file, f"holds a JSON {type(saved).__name__}, not a config object",
                      "pass the config.json megajax-train wrote")
  config = apply_overrides(default_config(), _dotted(saved))
  defaults = default_config()
  config.debug, config.observe = defaults.debug, defaults.observe
  return config


def _dotted(tree: dict, prefix: str = "") -> dict:
  """{"model": {"num_layers": 4}} -> {"model.num_layers": 4}."""
  flat = {}
  for name, value in tree.items():
    if isinstance(value, dict):
      flat.update(_dotted(value, f"{prefix}{name}."))
    else:
      flat[f"{prefix}{name}"] = value
  return flat


def apply_overrides(config: ml_collections.ConfigDict, overrides: dict) -> ml_collections.ConfigDict:
  """Sets {"model.num_layers": 4, ...} on `config` (in place, and returns it); a name that is
  no field is a ConfigError (a typo never adds a field)."""
  for dotted, value in overrides.items():
    _set_field(config, dotted, value)
  return config


def _set_field(config, dotted: str, value) -> None:
  *parents, leaf = dotted.split(".")
  node = config
  for name in parents:
    if name not in node:
      raise ConfigError(dotted, value, "no such config field", "check the field names in megajax/config.py")
    node = node[name]
  if leaf not in node:
    raise ConfigError(dotted, value, "no such config field", "check the field names in megajax/config.py")
  node[leaf] = value
