"""Joining a multi-process JAX job: explicit flags, or what SLURM / Open MPI / Kubernetes set.

jax.distributed.initialize() reads the cluster's environment itself; we decide whether this
is such a job (with the variables jax's own detectors need), so a plain `megajax-train` on a
workstation stays single-process and a half-configured job fails with one clear line.
"""

from __future__ import annotations

import importlib.util
import os

from absl import logging
import jax

# The variables jax.distributed's detectors read (jax/_src/clusters/*.py).
SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
OPENMPI_VARS = ("OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")


class TopologyError(ValueError):
  """The process topology is incomplete or cannot be detected; the message says what to pass."""


def _int_env(name: str) -> int:
  try:
    return int(os.environ.get(name, "0"))
  except ValueError:
    return 0


def detected_cluster() -> str | None:
  """The multi-process launcher this process runs under, if any (one-task jobs count as none)."""
  if all(var in os.environ for var in SLURM_VARS) and _int_env("SLURM_NTASKS") > 1:
    return "slurm"
  if all(var in os.environ for var in OPENMPI_VARS) and _int_env("OMPI_COMM_WORLD_SIZE") > 1:
    return "openmpi"
  if "KUBERNETES_SERVICE_HOST" in os.environ and "JOB_COMPLETION_INDEX" in os.environ:
    if importlib.util.find_spec("kubernetes") is None:
      raise TopologyError("a Kubernetes indexed job was detected but jax needs the `kubernetes` package to "
                          "find its peers; pip install 'megajax[k8s]', or pass --coordinator_address, "
                          "--num_processes and --process_id")
    return "kubernetes"
  return None


def expected_process_count(num_processes: int | None) -> int:
  """The job's process count before jax.distributed starts: the flag, else SLURM's or Open MPI's
  task count, else 1 (a Kubernetes indexed job does not say; pass --num_processes there)."""
  if num_processes:
    return num_processes
  cluster = detected_cluster()
  if cluster == "slurm":
    return _int_env("SLURM_NTASKS")
  if cluster == "openmpi":
    return _int_env("OMPI_COMM_WORLD_SIZE")
  return 1


def request_host_devices(count: int) -> None:
  """Asks XLA for `count` CPU devices in this process, unless XLA_FLAGS already says how many.

  Must run before jax starts its backend. Only the CPU platform reads the flag, so on a GPU
  machine it changes nothing; on a CPU-only one it lets a dp x tp mesh run on one host.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if count > 1 and "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
    logging.info("XLA_FLAGS: %s CPU devices per process (used only when there is no GPU)", count)


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None) -> str:
  """Starts jax.distributed when this is a multi-process job; returns how the job was formed."""
  explicit = {"--coordinator_address": coordinator_address, "--num_processes": num_processes,
              "--process_id": process_id}
  if any(value is not None for value in explicit.values()):
    missing = [name for name, value in explicit.items() if value is None]
    if missing:
      raise TopologyError(f"{', '.join(missing)} missing; pass --coordinator_address, --num_processes and "
                          "--process_id together, or none of them to auto-detect SLURM / Open MPI / Kubernetes")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes talk over gloo
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
    how = f"explicit ({num_processes} processes, coordinator {coordinator_address})"
  elif (cluster := detected_cluster()) is not None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize()
    how = f"{cluster} ({jax.process_count()} processes)"
  else:
    how = "single process"
  logging.info("process %d of %d, %d local / %d global devices; job: %s", jax.process_index(),
               jax.process_count(), jax.local_device_count(), jax.device_count(), how)
  return how
