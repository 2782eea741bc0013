"""The experiment config: every field with its default, loading, and validation.

A config file is plain Python with a `get_config()` returning a ConfigDict
(see configs/). Files start from `default_config()` so that every experiment has
the same, locked field set: a typo in `--config.model.num_layer=4` fails loudly.

`validate(config)` runs before anything is compiled; it raises `ConfigError`,
whose one-line message names the field path and the fix.
"""

from __future__ import annotations

import importlib.util
import os

import ml_collections

BLOCKS = ("parallel", "serial")
ATTENTION_IMPLS = ("xla", "pallas", "cudnn")  # Kept equal to megajax.layers.ATTENTION_IMPLS (tested).
OPTIMIZERS = ("lamb", "adamw")
DTYPES = ("float32", "bfloat16", "float16")
REMAT_POLICIES = ("none", "full", "dots")
DATA_SOURCES = ("synthetic", "tokens")
RESTORE_MODES = ("direct", "broadcast")
XLA_PRESETS = ("auto", "none")
TP_OVERLAP_MODES = ("none", "collective_matmul", "xla")
TOKEN_FILE_SUFFIXES = (".bin", ".npy")
CAPTURE_TENSORS = ("attn_probs", "attn_out", "mlp_out", "residual")
PERTURBATIONS = ("", "noise", "offset", "bitflip")
# megajax.parallel.schedule takes its names from here (config imports no parallel code).
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
PIPELINE_TRAVERSALS = ("depth_first", "breadth_first")


class ConfigError(ValueError):
  """A config field has a bad value. `str(error)` is one line: field, problem, fix."""

  def __init__(self, field: str, value, problem: str, fix: str):
    self.field = field
    super().__init__(f"{field}={value!r}: {problem}; {fix}")


def default_config() -> ml_collections.ConfigDict:
  """All fields with their defaults: a tiny model that trains on a CPU."""
  c = ml_collections.ConfigDict()

  c.model = ml_collections.ConfigDict()
  c.model.vocab_size = 256
  c.model.seq_len = 128
  c.model.num_layers = 2
  c.model.hidden_dim = 64
  c.model.num_heads = 4
  c.model.num_kv_heads = 0        # 0: as many KV heads as query heads (no grouping).
  c.model.mlp_dim = 0             # 0: 4 * hidden_dim.
  c.model.window = 0              # Sliding-window width w; 0: full causal attention.
  c.model.window_pattern = "L"    # Per layer, repeated: L = local (window), G = global.
  c.model.block = "parallel"      # "parallel" (MegaScale PTB) or "serial" (GPT).
  c.model.attention_impl = "xla"
  c.model.compute_dtype = "bfloat16"
  c.model.param_dtype = "float32"
  c.model.tie_embeddings = False
  c.model.use_bias = True
  c.model.rope_theta = 10000.0
  c.model.layernorm_epsilon = 1e-5
  c.model.init_std = 0.02
  c.model.remat = "none"          # Activation recomputation per block.

  c.parallel = ml_collections.ConfigDict()
  c.parallel.dp = 1
  c.parallel.pp = 1
  c.parallel.tp = 1
  # How tensor-parallel collectives meet the matmuls: "none" (all-gather, then matmul),
  # "collective_matmul" (ppermute rings fused with the matmul chunks, MegaScale Fig. 3c) or
  # "xla" (plain collectives + XLA's windowed-einsum rewrite on GPU).
  c.parallel.tp_overlap = "collective_matmul"
  c.parallel.tp_overlap_chunks = 2  # Sequence chunks per ring step (2: one per ring direction).
  # Pipeline (pp > 1): the layers are cut into pp * virtual_stages chunks, stage s holding
  # chunks s, s + pp, ...; train.microbatches microbatches flow through them in this order.
  c.parallel.virtual_stages = 1     # Model chunks per stage (Megatron's interleaving, v).
  c.parallel.schedule = "interleaved_1f1b"  # "gpipe", "1f1b" (v=1) or "interleaved_1f1b".
  c.parallel.traversal = "depth_first"      # Or "breadth_first": more in flight, fewer switches.

  c.train = ml_collections.ConfigDict()
  c.train.steps = 200
  c.train.batch_size = 16         # Global batch, in sequences.
  c.train.microbatches = 1        # Gradient accumulation inside one step.
  c.train.seed = 0
  c.train.log_every = 10
  c.train.z_loss = 0.0            # Weight of the z-loss (mean logsumexp^2).

  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.name = "lamb"
  c.optimizer.learning_rate = 1e-2  # Peak learning rate.
  c.optimizer.warmup_steps = 20
  c.optimizer.end_lr_ratio = 0.1    # Final learning rate as a fraction of the peak.
  c.optimizer.b1 = 0.9
  c.optimizer.b2 = 0.999
  c.optimizer.eps = 1e-6
  c.optimizer.weight_decay = 0.01
  c.optimizer.grad_clip_norm = 1.0  # 0 disables global-norm clipping.

  c.data = ml_collections.ConfigDict()
  c.data.source = "synthetic"     # "synthetic" or "tokens" (a megajax-prepare-data file).
  c.data.path = ""                # Token file (.bin with its .json, or .npy) for "tokens".
  c.data.shuffle = True
  c.data.synthetic_records = 1_000_000
  c.data.read_threads = 2
  c.data.prefetch = 4             # Batches the loader prepares ahead of the step.

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.save_params = True   # Write WORKDIR/params (Orbax) when training ends.
  # Training checkpoints in WORKDIR/checkpoints: every `every_steps` steps (0: only at the end
  # and on preemption), asynchronous (the step waits only for the device -> host copy). A
  # relaunch with the same workdir resumes from the latest complete one.
  c.checkpoint.every_steps = 100
  c.checkpoint.keep = 3             # The last `keep` checkpoints ...
  c.checkpoint.keep_period = 0      # ... plus every step divisible by this one, forever (0: none).
  c.checkpoint.async_save = True
  # "direct": every process reads its own shards; "broadcast": data-parallel replica 0 reads,
  # the other replicas receive over the interconnect (MegaScale 4.4), at most this much at once.
  c.checkpoint.restore_mode = "direct"
  c.checkpoint.broadcast_memory_limit_mib = 1024

  # Non-finite loss or gradients: the update is skipped (counted in `skipped_steps`); after this
  # many consecutive skips the run rolls back to the latest checkpoint and reads on past the
  # batches that failed. No NaN or Inf is ever saved.
  c.train.nonfinite_rollback_after = 3

  # Start-up (megajax-train): XLA's persistent compilation cache, so a restart skips compiling
  # ("": WORKDIR/jax_cache; "none": off), and the XLA / NCCL presets for GPUs
  # (megajax.launch.runtime: "auto" or "none"), with extra XLA flags that override them.
  c.runtime = ml_collections.ConfigDict()
  c.runtime.compilation_cache_dir = ""
  c.runtime.xla_preset = "auto"
  c.runtime.xla_flags = ""

  # megajax-supervise: heartbeats (a file per worker in WORKDIR/heartbeats), failure detection
  # and automatic restart from the latest checkpoint.
  c.supervisor = ml_collections.ConfigDict()
  c.supervisor.processes = 1              # Worker processes (one per host).
  c.supervisor.devices_per_process = 0    # Local CPU workers: devices each (0: the mesh / processes).
  # How to start the job: "" starts local processes; otherwise a shell command template run
  # once per (re)start, e.g. "srun --nodes={processes} --ntasks-per-node=1 {train}", where
  # {train} is the worker's command line (topology auto-detected by jax.distributed); also
  # {args}, {processes}, {exclude} and the variables MEGAJAX_PROCESSES, MEGAJAX_EXCLUDE_HOSTS.
  c.supervisor.command = ""
  c.supervisor.stop_command = ""          # Run after stopping `command`'s job (kubectl delete ...).
  c.supervisor.heartbeat_interval_s = 1.0
  c.supervisor.heartbeat_timeout_s = 10.0   # No heartbeat for this long: the worker is lost.
  c.supervisor.hang_timeout_s = 120.0       # No step finished for this long: the job hangs.
  c.supervisor.startup_timeout_s = 1800.0   # The first step (start, restore, compile) must end by then.
  c.supervisor.max_restarts = 3
  c.supervisor.diagnose = True              # Run megajax-diagnose after a failure.
  c.supervisor.elastic = True               # Continue on fewer hosts (smaller dp) without a bad one ...
  c.supervisor.spares = 0                   # ... unless the allocation has spare hosts to replace it.

  # Observability (megajax.observe): sampled traces, activation capture and perturbations.
  c.observe = ml_collections.ConfigDict()
  # Every N steps each process traces one step with jax.profiler into WORKDIR/traces/step_<n>
  # (merge, heat map and stragglers: megajax-trace WORKDIR); 0: off.
  c.observe.trace_every = 0
  # Observation points "layer:tensor,...", tensor one of CAPTURE_TENSORS, layer an index or *
  # (e.g. "0:attn_probs,*:residual"): statistics (and a small sample) of each, computed every
  # step, read one step late and appended to WORKDIR/activations.jsonl every `capture_every`
  # steps (the device work does not thin out: capture few points on big runs). "": off.
  c.observe.capture = ""
  c.observe.capture_every = 1
  c.observe.capture_sample = 0      # Also the first N values of each captured tensor (0: none).
  # Perturbation for robustness experiments: "" (off), "noise" (Gaussian, std perturb_scale),
  # "offset" (+perturb_scale) or "bitflip" (bit perturb_bit of a perturb_fraction of the
  # elements), applied at perturb_at: "layer:<i>" (layer i's output) or "stage:<s>" (the
  # activations pipeline stage s sends on).
  c.observe.perturb = ""
  c.observe.perturb_at = ""
  c.observe.perturb_scale = 0.0
  c.observe.perturb_bit = 30
  c.observe.perturb_fraction = 1e-3

  c.debug = ml_collections.ConfigDict()
  c.debug.fail_at_step = 0          # Fault injection (tests): SIGKILL this process after that step.
  c.debug.fail_process = -1         # ... only this process (-1: every process).
  c.debug.nonfinite_steps = ""      # Fault injection: "8,9,10" makes those steps' loss NaN.
  c.debug.diagnose_slow_process = -1  # Fault injection: megajax-diagnose sees this process slow.
  # Straggler drill: the rank "dp,pp,tp" runs `slow_rank_work` extra matmuls of the hidden size
  # once per step, after its gradients, under the "forward" scope (megajax-trace should name it; "": off).
  c.debug.slow_rank = ""
  c.debug.slow_rank_work = 8
  c.debug.slow_rank_from_step = 0   # ... from this step on (one compiled program, before and after).
  return c


def load_config(path: str, overrides: dict | None = None) -> ml_collections.ConfigDict:
  """Loads `get_config()` from a config file, applies {"model.num_layers": 4, ...}, validates."""
  if not os.path.isfile(path):
    raise ConfigError("config", path, "no such config file", "pass a path such as configs/default.py")
  spec = importlib.util.spec_from_file_location("megajax_user_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  for dotted, value in (overrides or {}).items():
    _set_field(config, dotted, value)
  validate(config)
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


def _require(ok: bool, field: str, value, problem: str, fix: str) -> None:
  if not ok:
    raise ConfigError(field, value, problem, fix)


def _positive_int(config, field: str) -> None:
  group, name = field.split(".")
  value = config[group][name]
  _require(isinstance(value, int) and not isinstance(value, bool) and value >= 1, field, value,
           "must be a positive integer", f"set --config.{field} to 1 or more")


def _non_negative_int(config, field: str) -> None:
  group, name = field.split(".")
  value = config[group][name]
  _require(isinstance(value, int) and not isinstance(value, bool) and value >= 0, field, value,
           "must be an integer >= 0", f"set --config.{field} to 0 or more")


def _choice(config, field: str, choices) -> None:
  group, name = field.split(".")
  value = config[group][name]
  _require(value in choices, field, value, "unknown name", f"choose one of {', '.join(choices)}")


def validate(config: ml_collections.ConfigDict) -> None:
  """Checks the whole config; raises ConfigError on the first bad field. Touches no device."""
  m, p, t, o, d = config.model, config.parallel, config.train, config.optimizer, config.data

  for field in ("model.vocab_size", "model.seq_len", "model.num_layers", "model.hidden_dim",
                "model.num_heads", "parallel.dp", "parallel.pp", "parallel.tp", "parallel.tp_overlap_chunks",
                "parallel.virtual_stages", "train.steps",
                "train.batch_size", "train.microbatches", "train.log_every"):
    _positive_int(config, field)
  for field in ("checkpoint.every_steps", "checkpoint.keep_period", "debug.fail_at_step"):
    _non_negative_int(config, field)
  _positive_int(config, "checkpoint.keep")
  _positive_int(config, "checkpoint.broadcast_memory_limit_mib")
  _choice(config, "checkpoint.restore_mode", RESTORE_MODES)
  _choice(config, "model.block", BLOCKS)
  _choice(config, "model.attention_impl", ATTENTION_IMPLS)
  _choice(config, "model.compute_dtype", DTYPES)
  _choice(config, "model.param_dtype", DTYPES)
  _choice(config, "model.remat", REMAT_POLICIES)
  _choice(config, "optimizer.name", OPTIMIZERS)
  _choice(config, "data.source", DATA_SOURCES)
  _choice(config, "parallel.tp_overlap", TP_OVERLAP_MODES)
  _choice(config, "parallel.schedule", PIPELINE_SCHEDULES)
  _choice(config, "parallel.traversal", PIPELINE_TRAVERSALS)

  # Attention heads.
  _require(m.hidden_dim % m.num_heads == 0, "model.num_heads", m.num_heads,
           f"model.hidden_dim={m.hidden_dim} is not divisible by it",
           f"use a divisor of {m.hidden_dim}, e.g. {_nearest_divisor(m.hidden_dim, m.num_heads)}")
  head_dim = m.hidden_dim // m.num_heads
  _require(head_dim % 2 == 0, "model.num_heads", m.num_heads,
           f"head dim {head_dim} is odd and rotary embeddings need it even",
           "pick num_heads so that hidden_dim / num_heads is even")
  _require((m.num_kv_heads or 0) >= 0, "model.num_kv_heads", m.num_kv_heads, "must be >= 0",
           "set 0 (one KV head per query head) or a divisor of model.num_heads")
  kv_heads = m.num_kv_heads or m.num_heads
  _require(m.num_heads % kv_heads == 0, "model.num_kv_heads", m.num_kv_heads,
           f"model.num_heads={m.num_heads} is not divisible by it",
           f"use a divisor of {m.num_heads}, e.g. {_nearest_divisor(m.num_heads, kv_heads)}")
  _require(m.num_heads % p.tp == 0, "model.num_heads", m.num_heads,
           f"not divisible by parallel.tp={p.tp}", "make the head count a multiple of parallel.tp")
  _require(kv_heads % p.tp == 0, "model.num_kv_heads", m.num_kv_heads,
           f"{kv_heads} KV heads do not split over parallel.tp={p.tp}",
           "use a multiple of parallel.tp KV heads (or 0 for one per query head)")
  _require((m.mlp_dim or 0) >= 0, "model.mlp_dim", m.mlp_dim, "must be >= 0", "set 0 (4 * hidden_dim) or a positive width")

  # Tensor + sequence parallelism: heads (above), MLP units, vocabulary and sequence split over tp.
  mlp_dim = m.mlp_dim or 4 * m.hidden_dim
  _require(mlp_dim % p.tp == 0, "model.mlp_dim", m.mlp_dim, f"{mlp_dim} MLP units do not split over parallel.tp={p.tp}",
           "use a multiple of parallel.tp")
  _require(m.vocab_size % p.tp == 0, "model.vocab_size", m.vocab_size,
           f"the vocabulary does not split over parallel.tp={p.tp}",
           f"pad it to a multiple of parallel.tp, e.g. {-(-m.vocab_size // p.tp) * p.tp} (extra ids are never seen)")
  _require(m.seq_len % p.tp == 0, "model.seq_len", m.seq_len,
           f"sequence parallelism splits it over parallel.tp={p.tp}", "use a multiple of parallel.tp")
  if p.tp_overlap == "collective_matmul":
    _require(m.seq_len % (p.tp * p.tp_overlap_chunks) == 0, "parallel.tp_overlap_chunks", p.tp_overlap_chunks,
             f"each device's {m.seq_len // p.tp}-token sequence shard must split into this many chunks",
             f"use a divisor of {m.seq_len // p.tp}, e.g. {_nearest_divisor(m.seq_len // p.tp, p.tp_overlap_chunks)}")

  # Sliding window.
  window = m.window or 0  # None (from Python) and 0 (from the command line) both mean full causal.
  _require(isinstance(window, int) and 0 <= window <= m.seq_len, "model.window", m.window,
           f"must be between 1 and model.seq_len={m.seq_len}, or 0 for full causal attention",
           f"set --config.model.window to a value in [1, {m.seq_len}] or 0")
  pattern = m.window_pattern
  _require(isinstance(pattern, str) and len(pattern) >= 1 and set(pattern) <= {"L", "G"},
           "model.window_pattern", pattern, "must be a non-empty string of L (local) and G (global)",
           "e.g. 'L' (every layer local) or 'LG' (alternate local and global)")
  _require(window > 0 or "L" not in pattern or pattern == "L", "model.window_pattern", pattern,
           "has local layers but model.window=0", "set model.window to the local width")

  # Numbers.
  for field in ("model.rope_theta", "model.layernorm_epsilon", "model.init_std",
                "optimizer.learning_rate", "optimizer.eps"):
    group, name = field.split(".")
    value = config[group][name]
    _require(isinstance(value, (int, float)) and value > 0, field, value, "must be a positive number",
             f"set --config.{field} to a value > 0")
  _require(0 <= o.b1 < 1, "optimizer.b1", o.b1, "must be in [0, 1)", "e.g. 0.9")
  _require(0 <= o.b2 < 1, "optimizer.b2", o.b2, "must be in [0, 1)", "e.g. 0.999")
  _require(o.weight_decay >= 0, "optimizer.weight_decay", o.weight_decay, "must be >= 0", "e.g. 0.01")
  _require(o.grad_clip_norm >= 0, "optimizer.grad_clip_norm", o.grad_clip_norm, "must be >= 0",
           "e.g. 1.0, or 0 to disable clipping")
  _require(0 <= o.end_lr_ratio <= 1, "optimizer.end_lr_ratio", o.end_lr_ratio, "must be in [0, 1]", "e.g. 0.1")
  _require(isinstance(o.warmup_steps, int) and 0 <= o.warmup_steps < t.steps, "optimizer.warmup_steps",
           o.warmup_steps, f"must be in [0, train.steps={t.steps})", "shorten the warmup or train longer")
  _require(t.z_loss >= 0, "train.z_loss", t.z_loss, "must be >= 0", "e.g. 1e-4, or 0 to disable")

  # Batch.
  _require(t.batch_size % t.microbatches == 0, "train.microbatches", t.microbatches,
           f"train.batch_size={t.batch_size} is not divisible by it",
           f"use a divisor of {t.batch_size}, e.g. {_nearest_divisor(t.batch_size, t.microbatches)}")
  _require((t.batch_size // t.microbatches) % p.dp == 0, "train.batch_size", t.batch_size,
           f"a microbatch of {t.batch_size // t.microbatches} sequences does not split over parallel.dp={p.dp}",
           "make batch_size a multiple of microbatches * parallel.dp")

  # Pipeline.
  chunks = p.pp * p.virtual_stages
  _require(p.pp == 1 or m.num_layers % chunks == 0, "model.num_layers", m.num_layers,
           f"the pipeline cuts the layers into parallel.pp * parallel.virtual_stages = {chunks} equal chunks",
           f"use a multiple of {chunks} layers, or fewer stages / virtual stages")
  _require(p.pp == 1 or p.schedule != "1f1b" or p.virtual_stages == 1, "parallel.virtual_stages", p.virtual_stages,
           "the 1f1b schedule has one chunk per stage", "set parallel.schedule=interleaved_1f1b for more")
  if p.pp > 1 and p.schedule == "interleaved_1f1b" and p.virtual_stages > 1:
    _require(t.microbatches % p.pp == 0, "train.microbatches", t.microbatches,
             f"interleaved 1F1B sends microbatches through the chunks in groups of parallel.pp={p.pp}",
             f"use a multiple of {p.pp}, e.g. {-(-t.microbatches // p.pp) * p.pp}")

  # Robustness: non-finite policy, start-up, supervisor, fault injection.
  _positive_int(config, "train.nonfinite_rollback_after")
  _choice(config, "runtime.xla_preset", XLA_PRESETS)
  _require(isinstance(config.runtime.xla_flags, str) and all(f.startswith("--") for f in config.runtime.xla_flags.split()),
           "runtime.xla_flags", config.runtime.xla_flags, "must be XLA flags, each starting with --",
           "e.g. --config.runtime.xla_flags='--xla_gpu_enable_latency_hiding_scheduler=false'")
  s = config.supervisor
  _positive_int(config, "supervisor.processes")
  _non_negative_int(config, "supervisor.devices_per_process")
  _non_negative_int(config, "supervisor.max_restarts")
  _non_negative_int(config, "supervisor.spares")
  for field in ("heartbeat_interval_s", "heartbeat_timeout_s", "hang_timeout_s", "startup_timeout_s"):
    _require(isinstance(s[field], (int, float)) and s[field] > 0, f"supervisor.{field}", s[field],
             "must be a positive number of seconds", f"set --config.supervisor.{field} to a value > 0")
  _require(s.heartbeat_timeout_s >= 2 * s.heartbeat_interval_s, "supervisor.heartbeat_timeout_s",
           s.heartbeat_timeout_s, f"a live worker beats only every heartbeat_interval_s={s.heartbeat_interval_s} s",
           "make it at least twice the interval")
  _require(not s.command or "{train}" in s.command or "{args}" in s.command, "supervisor.command", s.command,
           "the template never starts the trainer",
           "put {train} where the megajax-train command line goes (or {args} for its flags alone)")
  _require(isinstance(config.debug.fail_process, int) and config.debug.fail_process >= -1, "debug.fail_process",
           config.debug.fail_process, "must be a process index or -1", "e.g. 1, or -1 for every process")
  steps = config.debug.nonfinite_steps
  _require(isinstance(steps, str) and all(x.strip().isdigit() for x in steps.split(",") if x.strip()),
           "debug.nonfinite_steps", steps, "must be a comma-separated list of step numbers", "e.g. '8,9,10'")

  _validate_observe(config)

  # Data.
  _require(d.read_threads >= 1, "data.read_threads", d.read_threads, "must be >= 1", "e.g. 2")
  _require(d.prefetch >= 0, "data.prefetch", d.prefetch, "must be >= 0", "e.g. 4")
  if d.source == "synthetic":
    _require(d.synthetic_records >= t.batch_size, "data.synthetic_records", d.synthetic_records,
             f"smaller than train.batch_size={t.batch_size}", "raise it")
  else:
    _require(bool(d.path) and d.path.endswith(TOKEN_FILE_SUFFIXES), "data.path", d.path,
             "data.source='tokens' needs a .bin or .npy token file",
             "make one with megajax-prepare-data and pass --config.data.path=FILE")
    _require(os.path.isfile(d.path), "data.path", d.path, "file not found",
             "check the path, or make the file with megajax-prepare-data")


def _validate_observe(config: ml_collections.ConfigDict) -> None:
  o, p = config.observe, config.parallel
  _non_negative_int(config, "observe.trace_every")
  _positive_int(config, "observe.capture_every")
  _non_negative_int(config, "observe.capture_sample")
  for point in (x.strip() for x in o.capture.split(",") if x.strip()):
    layer, _, tensor = point.partition(":")
    _require(tensor in CAPTURE_TENSORS and (layer == "*" or (layer.isdigit() and int(layer) < config.model.num_layers)),
             "observe.capture", o.capture, f"{point!r} is not layer:tensor",
             f"use e.g. '0:attn_probs,*:residual' with a layer below model.num_layers={config.model.num_layers} "
             f"(or *) and a tensor in {CAPTURE_TENSORS}")
  _require(not o.capture or p.pp == 1, "observe.capture", o.capture,
           f"activation capture runs without a pipeline only (parallel.pp={p.pp})",
           "capture on a run with parallel.pp=1 (same model, dp / tp as you like), or set observe.capture=''")
  _choice(config, "observe.perturb", PERTURBATIONS)
  if o.perturb:
    kind, _, where = o.perturb_at.partition(":")
    limit = config.model.num_layers if kind == "layer" else p.pp
    _require(kind in ("layer", "stage") and where.isdigit() and int(where) < limit, "observe.perturb_at",
             o.perturb_at, "must name a layer or a pipeline stage",
             f"e.g. 'layer:0' (below model.num_layers={config.model.num_layers}) or 'stage:0' (below parallel.pp={p.pp})")
    _require(kind == "layer" or int(where) < p.pp - 1, "observe.perturb_at", o.perturb_at,
             "the last stage sends no activations on", f"use a stage below parallel.pp - 1 = {p.pp - 1}")
    _require(kind == "stage" or p.pp == 1, "observe.perturb_at", o.perturb_at,
             f"a layer's output is perturbed without a pipeline only (parallel.pp={p.pp})",
             "use 'stage:<s>' (what stage s sends on: its last layer's output), or parallel.pp=1")
    _require(0 <= o.perturb_bit < 32, "observe.perturb_bit", o.perturb_bit, "must be a bit index", "0..31")
    _require(0 < o.perturb_fraction <= 1, "observe.perturb_fraction", o.perturb_fraction,
             "must be in (0, 1]", "e.g. 1e-3")
  slow = config.debug.slow_rank
  if slow:
    parts = slow.split(",")
    sizes = (p.dp, p.pp, p.tp)
    _require(len(parts) == 3 and all(x.strip().isdigit() and int(x) < n for x, n in zip(parts, sizes)),
             "debug.slow_rank", slow, "must be 'dp,pp,tp' coordinates of a rank in the mesh",
             f"e.g. '0,0,0' (mesh dp={p.dp} pp={p.pp} tp={p.tp})")
  _positive_int(config, "debug.slow_rank_work")
  _non_negative_int(config, "debug.slow_rank_from_step")


def _nearest_divisor(n: int, near: int) -> int:
  divisors = [k for k in range(1, n + 1) if n % k == 0]
  return min(divisors, key=lambda k: (abs(k - near), -k))
