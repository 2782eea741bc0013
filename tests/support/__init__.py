"""What several test files share: processes (run_module, launch_two_processes), the 3D step
against the single-device reference, compiled-HLO collective counts, kernel comparisons,
trained checkpoints. REPO is the repository's root (configs/, README.md)."""

import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# XLA:CPU compile settings of the test processes and the processes they start (why each:
# tests/conftest.py): flag name -> value.
COMPILE_FLAGS = {"xla_backend_optimization_level": "0", "xla_cpu_use_fusion_emitters": "false",
                 "xla_cpu_parallel_codegen_split_count": "1"}


def xla_flags(flags: dict) -> str:
  """{"name": "value"} -> "--name=value ..." (XLA_FLAGS' form)."""
  return " ".join(f"--{name}={value}" for name, value in flags.items())


# The multi-process tests' small program, quick to compile: 1 layer, dp=2 x tp=2 without the
# overlap rings, no pipeline (with 2 processes, the data-parallel replicas are the processes and
# each holds a tp group of 2 devices). One layer: what these tests check (restarts, restores,
# reads, drills) is per state, not per layer, and a second layer cost a fifth of their CPU time
# (the fault drills and tests/e2e/test_checkpoint.py: 159 -> 131 s). tp=2, not 4: on CPU every
# collective of a multi-process job goes through gloo, also within a process, and 4 device
# threads per process on 2 cores made a step 5x slower (~0.5 s vs ~0.1 s, the job's 2 x 4
# threads polling for each other).
SMALL_MESH = {"parallel.dp": 2, "parallel.pp": 1, "parallel.virtual_stages": 1, "parallel.tp": 2,
              "parallel.tp_overlap": "none", "model.num_layers": 1}


def config_flags(overrides: dict) -> list[str]:
  """{"parallel.tp": 4} -> ["--config.parallel.tp=4"]: config overrides as launcher flags."""
  return [f"--config.{field}={value}" for field, value in overrides.items()]
