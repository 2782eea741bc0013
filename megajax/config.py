"""The experiment config: every field with its default and its checks, section by section.

A config file is plain Python with a `get_config()` returning a ConfigDict (see configs/).
Files start from `default_config()` so that every experiment has the same, locked field set:
a typo in `--config.model.num_layer=4` fails loudly.

The fields, their types and defaults are the frozen dataclasses of megajax.sections (one line
per field); this module holds `_check_<section>(config)`, each section's checks, in the same
order (the parallel section's, the longest, in megajax.config_parallel). `validate(config)` runs the checks in section order before anything is compiled; it raises
`ConfigError`, whose one-line message names the field path and the fix. A check that ties a
field to another section's (heads to parallel.tp, say) sits in the later section. The names
a choice field accepts are module constants `<FIELD>_CHOICES`; code that implements a choice
keys its registry by them (e.g. megajax.layers.ATTENTION_IMPLS, tested equal). A run
resolves its checked ConfigDict once into those sections (megajax.sections.RunConfig).
"""

from __future__ import annotations

import importlib.util

import json
import os

import ml_collections

from megajax import config_checks as check
from megajax.layers.families import ATTENTION_FUSED, BLOCK_FAMILIES, MLP_FAMILIES, NORM_FAMILIES
from megajax.config_checks import ConfigError
from megajax.config_parallel import (GRAD_SYNC_CHOICES, SCHEDULE_CHOICES, TP_OVERLAP_CHOICES, TRAVERSAL_CHOICES,
                                     check_parallel)
from megajax.sections import (SECTION_TYPES, CheckpointSection, DataSection, DebugSection, ModelSection,
                              ObserveSection, OptimizerSection, ParallelSection, RuntimeSection, SupervisorSection,
                              TrainSection, to_config_dict)

__all__ = ["ATTENTION_IMPL_CHOICES", "BLOCK_CHOICES", "CAPTURE_TENSOR_CHOICES", "CONFIGS_DIR", "ConfigError",
           "DATA_SOURCE_CHOICES", "DTYPE_CHOICES", "EVAL_FRACTION_MAX", "FAIL_MODES", "GRAD_SYNC_CHOICES",
           "MIXTURE_EXAMPLE", "MLP_CHOICES", "NORM_CHOICES", "OPTIMIZER_CHOICES", "PERTURBATION_CHOICES",
           "REMAT_CHOICES", "REPO", "RESTORE_MODE_CHOICES", "SCHEDULE_CHOICES", "SECTIONS",
           "TOKEN_FILE_SUFFIXES", "TP_OVERLAP_CHOICES", "TRAVERSAL_CHOICES", "XLA_PRESET_CHOICES",
           "apply_overrides", "default_config", "load_config", "parse_mixture", "read_run_config",
           "validate"]

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
  # cuDNN's fused attention takes half precision only (jax raises deep inside the trace otherwise).
  check.require(m.attention_impl != "cudnn" or m.compute_dtype in ("bfloat16", "float16"),
                "model.attention_impl", m.attention_impl,
                f"cuDNN attention takes bfloat16 or float16 inputs, model.compute_dtype is {m.compute_dtype}",
                "use model.compute_dtype=bfloat16, or model.attention_impl=xla (or pallas) for float32")

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


# --- data -------------------------------------------------------------------------------------

DATA_SOURCE_CHOICES = ("synthetic", "tokens")
TOKEN_FILE_SUFFIXES = (".bin", ".npy")
MIXTURE_EXAMPLE = "books.bin:0.7,code.bin:0.3"
EVAL_FRACTION_MAX = 0.5       # Holding out half or more of a corpus is a split, not an eval set.


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


# --- checkpoint -------------------------------------------------------------------------------

RESTORE_MODE_CHOICES = ("direct", "broadcast")


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


def _check_runtime(config) -> None:
  check.choice(config, "runtime.xla_preset", XLA_PRESET_CHOICES)
  check.non_negative_int(config, "runtime.gc_every_steps")
  flags = config.runtime.xla_flags
  check.require(isinstance(flags, str) and all(f.startswith("--") for f in flags.split()),
                "runtime.xla_flags", flags, "must be XLA flags, each starting with --",
                "e.g. --config.runtime.xla_flags='--xla_gpu_enable_latency_hiding_scheduler=false'")


# --- supervisor -------------------------------------------------------------------------------

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
    sizes = (p.dp, p.pp, p.tp) if len(parts) == 3 else (p.dp, p.pp, p.cp, p.tp)   # "dp,pp,tp": cp 0
    check.require(len(parts) in (3, 4) and all(x.strip().isdigit() and int(x) < n for x, n in zip(parts, sizes)),
                  "debug.slow_rank", slow, "must be 'dp,pp,cp,tp' (or 'dp,pp,tp') coordinates of a rank in the mesh",
                  f"e.g. '0,0,0,0' (mesh dp={p.dp} pp={p.pp} cp={p.cp} tp={p.tp})")
  check.positive_int(config, "debug.slow_rank_work")
  check.non_negative_int(config, "debug.slow_rank_from_step")


# --- The whole config ---------------------------------------------------------------------------

# Section -> (its fields and defaults, its checks), in the order validate() checks them: a section's
# checks may read the sections before it.
SECTIONS = {
    "model": (ModelSection, _check_model),
    "train": (TrainSection, _check_train),
    "optimizer": (OptimizerSection, _check_optimizer),
    "parallel": (ParallelSection, check_parallel),
    "data": (DataSection, _check_data),
    "checkpoint": (CheckpointSection, _check_checkpoint),
    "runtime": (RuntimeSection, _check_runtime),
    "supervisor": (SupervisorSection, _check_supervisor),
    "observe": (ObserveSection, _check_observe),
    "debug": (DebugSection, _check_debug),
}
assert tuple(SECTIONS) == tuple(SECTION_TYPES), "megajax.sections.SECTION_TYPES: the same sections in the same order"


def default_config() -> ml_collections.ConfigDict:
  """All fields with their defaults: a tiny model that trains on a CPU."""
  c = ml_collections.ConfigDict()
  for name, (section_type, _) in SECTIONS.items():
    c[name] = to_config_dict(section_type)
  return c


def validate(config: ml_collections.ConfigDict) -> None:
  """Checks the whole config; raises ConfigError on the first bad field. Touches no device."""
  for _, check_section in SECTIONS.values():
    check_section(config)


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
