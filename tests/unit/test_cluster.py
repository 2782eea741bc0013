"""Joining a multi-process job: which cluster launcher this process runs under, and a plain
single process when none is detected."""

import pytest

from megajax.launch import cluster


def test_cluster_detection(monkeypatch):
  for var in (*cluster.SLURM_VARS, *cluster.OPENMPI_VARS, "KUBERNETES_SERVICE_HOST", "JOB_COMPLETION_INDEX"):
    monkeypatch.delenv(var, raising=False)
  assert cluster.detected_cluster() is None
  # An sbatch script outside srun has SLURM_NTASKS but no step: jax could not form the job.
  monkeypatch.setenv("SLURM_JOB_ID", "7")
  monkeypatch.setenv("SLURM_NTASKS", "4")
  assert cluster.detected_cluster() is None
  for var, value in (("SLURM_STEP_NODELIST", "node[1-4]"), ("SLURM_PROCID", "0"), ("SLURM_LOCALID", "0")):
    monkeypatch.setenv(var, value)
  assert cluster.detected_cluster() == "slurm"
  monkeypatch.setenv("SLURM_NTASKS", "1")  # a one-task allocation is a single process
  assert cluster.detected_cluster() is None


def test_kubernetes_without_its_client_says_what_to_install(monkeypatch):
  for var in (*cluster.SLURM_VARS, *cluster.OPENMPI_VARS):
    monkeypatch.delenv(var, raising=False)
  monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
  monkeypatch.setenv("JOB_COMPLETION_INDEX", "0")
  monkeypatch.setattr(cluster.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(cluster.TopologyError, match=r"megajax\[k8s\]"):
    cluster.detected_cluster()


def test_single_process_when_nothing_is_detected(monkeypatch):
  for var in (*cluster.SLURM_VARS, *cluster.OPENMPI_VARS, "KUBERNETES_SERVICE_HOST"):
    monkeypatch.delenv(var, raising=False)
  assert cluster.initialize_distributed() == "single process"
