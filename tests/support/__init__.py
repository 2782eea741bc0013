"""What several test files share: processes (run_module, launch_two_processes), the 3D step
against the single-device reference, compiled-HLO collective counts, kernel comparisons,
trained checkpoints. REPO is the repository's root (configs/, README.md)."""

import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The multi-process tests' small program, quick to compile: 2 layers, dp=2 x tp=4 without the
# overlap rings, no pipeline (with 2 processes, the data-parallel replicas are the processes).
SMALL_MESH = {"parallel.dp": 2, "parallel.pp": 1, "parallel.virtual_stages": 1, "parallel.tp": 4,
              "parallel.tp_overlap": "none", "model.num_layers": 2}


def config_flags(overrides: dict) -> list[str]:
  """{"parallel.tp": 4} -> ["--config.parallel.tp=4"]: config overrides as launcher flags."""
  return [f"--config.{field}={value}" for field, value in overrides.items()]
