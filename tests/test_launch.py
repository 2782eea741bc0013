"""The launcher's error paths (one line, exit 2, before compiling) and cluster detection."""

import re

import pytest

from megajax import data
from megajax.launch import cluster
from tests.conftest import run_module

TRAIN = ["-m", "megajax.launch.train", "--config=configs/default.py"]


def one_line_failure(result, *expected):
  """Exit code 2 and exactly one line besides megajax's own INFO log lines; no traceback."""
  output = result.stdout + result.stderr
  lines = [line for line in output.splitlines() if line.strip() and not re.match(r"I\d{4} ", line)]
  assert "Traceback" not in output
  assert result.returncode == 2, result.stderr[-2000:]
  assert len(lines) == 1, lines
  for text in expected:
    assert text in lines[0], lines[0]
  return lines[0]


def test_bad_config_is_one_line_before_anything_starts(tmp_path):
  line = one_line_failure(run_module([*TRAIN, f"--workdir={tmp_path}/run", "--config.model.num_heads=5"]),
                          "config error", "model.num_heads")
  assert line.startswith("megajax-train: config error: model.num_heads=5:")
  assert not (tmp_path / "run").exists()  # nothing started


def test_bad_flag_value_is_one_line(tmp_path):
  one_line_failure(run_module([*TRAIN, f"--workdir={tmp_path}", "--config.model.num_heads=abc"]),
                   "flag error", "config.model.num_heads")


def test_missing_workdir_is_one_line():
  one_line_failure(run_module(TRAIN), "flag error", "workdir")


def test_unknown_config_field_is_one_line(tmp_path):
  one_line_failure(run_module([*TRAIN, f"--workdir={tmp_path}", "--config.model.num_layer=3"]),
                   "config error", "model.num_layer", "num_layers")


def test_partial_topology_flags_are_one_line(tmp_path):
  line = one_line_failure(run_module([*TRAIN, f"--workdir={tmp_path}", "--num_processes=2"]),
                          "topology error", "--coordinator_address", "--process_id")
  assert "--num_processes missing" not in line


def test_token_file_vocab_mismatch_fails_before_compiling(tmp_path):
  path = str(tmp_path / "corpus.bin")
  data.write_token_file(path, data.encode_text("hello world, " * 200), data.BYTE_VOCAB_SIZE)
  workdir = tmp_path / "run"
  one_line_failure(run_module([*TRAIN, f"--workdir={workdir}", "--config.data.source=tokens",
                               f"--config.data.path={path}"]),
                   "config error", "model.vocab_size=256", "--config.model.vocab_size=257")
  assert not (workdir / "metrics.jsonl").exists()


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
