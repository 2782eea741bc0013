"""The parallel section's checks: the mesh's degrees against the model's shapes and the batch,
context parallelism's layout rules and MegaFBD's limits (megajax.config.SECTIONS runs
`check_parallel`; the choices are re-exported there). A check raises config_checks.ConfigError
naming the field and the fix, before anything compiles.
"""

from __future__ import annotations

from megajax import config_checks as check

__all__ = ["GRAD_SYNC_CHOICES", "SCHEDULE_CHOICES", "TP_OVERLAP_CHOICES", "TRAVERSAL_CHOICES", "check_parallel"]

# How tensor-parallel collectives meet the matmuls (megajax.parallel.collective_matmul).
TP_OVERLAP_CHOICES = ("none", "collective_matmul", "xla")
# Pipeline schedules and traversals (megajax.parallel.pipeline.schedule takes its names from here).
SCHEDULE_CHOICES = ("gpipe", "1f1b", "interleaved_1f1b")
TRAVERSAL_CHOICES = ("depth_first", "breadth_first")
# When ZeRO-2 reduce-scatters the gradients over dp (megajax.parallel.step, pipeline.executor).
GRAD_SYNC_CHOICES = ("step", "microbatch")


def check_parallel(config) -> None:
  """The parallel section's checks (megajax.config.validate runs them after the model's,
  train's and optimizer's, which they read)."""
  m, p, t = config.model, config.parallel, config.train
  for field in ("parallel.dp", "parallel.pp", "parallel.cp", "parallel.tp", "parallel.tp_overlap_chunks",
                "parallel.virtual_stages"):
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
  _check_context_parallel(config)
  shard = m.seq_len // (p.cp * p.tp)          # one device's tokens of a row
  if p.tp_overlap in (None, "collective_matmul"):     # unset: a GPU runs collective matmul
    check.require(m.seq_len % (p.cp * p.tp * p.tp_overlap_chunks) == 0, "parallel.tp_overlap_chunks",
                  p.tp_overlap_chunks, f"each device's {shard}-token sequence shard must split into this many chunks",
                  f"use a divisor of {shard}, e.g. {check.nearest_divisor(shard, p.tp_overlap_chunks)}")

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


def _check_context_parallel(config) -> None:
  """parallel.cp: a row cut into 2 * cp chunks (the dual-chunk layout a global layer's ring
  needs; cp contiguous shards when every layer has a window), each split over tp; a sliding
  window reaching at most one chunk (shard) back: the halo comes from one neighbour."""
  m, p, o = config.model, config.parallel, config.observe
  if p.cp == 1:
    return
  unit = 2 * p.cp * p.tp
  check.require(m.seq_len % unit == 0, "model.seq_len", m.seq_len,
                f"context parallelism cuts a row into 2 * parallel.cp = {2 * p.cp} chunks, each split over "
                f"parallel.tp={p.tp}", f"use a multiple of {unit}, e.g. {-(-m.seq_len // unit) * unit}")
  kinds = {m.window_pattern[layer % len(m.window_pattern)] for layer in range(m.num_layers)} if m.window else {"G"}
  chunk = m.seq_len // (2 * p.cp) if "G" in kinds else m.seq_len // p.cp
  check.require("L" not in kinds or m.window <= chunk + 1, "model.window", m.window,
                f"with parallel.cp={p.cp} a rank holds " + ("chunks" if "G" in kinds else "shards") +
                f" of {chunk} positions and takes a sliding window's halo from one neighbour",
                f"use a window of at most {chunk + 1}, or a smaller parallel.cp")
  for field, value, off in (("observe.capture", o.capture, "''"), ("observe.perturb", o.perturb, "''")):
    check.require(not value, field, value, f"not with parallel.cp={p.cp}: the probes see whole rows",
                  f"set {field}={off}, or parallel.cp=1")


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
      ("parallel.cp", p.cp, p.cp == 1, "MegaFBD's groups are dp x tp each (no context parallelism)", "1"),
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
