"""Joining a multi-process JAX job: explicit flags, or what SLURM / Open MPI / Kubernetes set.

jax.distributed.initialize() reads the cluster's environment itself; we only decide whether
there is a cluster at all, so a plain `megajax-train` on a workstation stays single-process.
"""

from __future__ import annotations

import os

from absl import logging
import jax


def _int_env(name: str) -> int:
  try:
    return int(os.environ.get(name, "0"))
  except ValueError:
    return 0


def detected_cluster() -> str | None:
  """The multi-process launcher this process runs under, if any."""
  if "SLURM_JOB_ID" in os.environ and _int_env("SLURM_NTASKS") > 1:
    return "slurm"
  if _int_env("OMPI_COMM_WORLD_SIZE") > 1:
    return "openmpi"
  if "KUBERNETES_SERVICE_HOST" in os.environ and "JOB_COMPLETION_INDEX" in os.environ:
    return "kubernetes"
  return None


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None) -> str:
  """Starts jax.distributed when this is a multi-process job; returns how the job was formed."""
  explicit = [coordinator_address, num_processes, process_id]
  if any(value is not None for value in explicit):
    if any(value is None for value in explicit):
      raise ValueError("--coordinator_address, --num_processes and --process_id go together; "
                       "pass all three, or none to auto-detect SLURM / Open MPI / Kubernetes")
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
    how = f"explicit ({num_processes} processes, coordinator {coordinator_address})"
  elif (cluster := detected_cluster()) is not None:
    jax.distributed.initialize()
    how = f"{cluster} ({jax.process_count()} processes)"
  else:
    how = "single process"
  logging.info("process %d of %d, %d local / %d global devices; job: %s", jax.process_index(),
               jax.process_count(), jax.local_device_count(), jax.device_count(), how)
  return how
