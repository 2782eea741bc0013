"""What you run: the commands (thin entry points over the libraries), the supervisor, the
cluster glue, and the benchmarks.

  train.py        megajax-train          supervise.py  megajax-supervise
  local.py        megajax-local          diagnose.py   megajax-diagnose
  trace.py        megajax-trace          report.py     megajax-report
  plan.py         megajax-plan           schedule.py   megajax-schedule
  prepare_data.py megajax-prepare-data
  export_hf.py    megajax-export-hf      import_hf.py  megajax-import-hf
  training.py     what megajax-train and megajax-import-hf share: a run from a validated config
  cli.py          what the commands share: one-line failures, flag parsing, joining the job
  cluster.py      jax.distributed: explicit flags, SLURM, Open MPI, Kubernetes
  runtime.py      start-up: XLA / NCCL presets, the persistent compilation cache
  supervisor/     robust training's driver: the supervisor, its jobs, hang view, diagnostics
  bench/          python -m megajax.launch.bench NAME: side-by-side measurements
"""
