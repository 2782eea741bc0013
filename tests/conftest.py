"""Every test process: 8 CPU devices, a shared compilation cache, the folder markers, the tiny config.

  tests/unit/         one module at a time, in process: no subprocess, no sleep (the quick loop)
  tests/integration/  in process but compile-heavy: the 3D step against the single-device
                      reference on every mesh shape, the kernels at every shape in the
                      interpreter, training runs restored onto other meshes
  tests/e2e/          processes: the launcher, multi-process jobs, checkpoints across
                      kills, the fault and straggler drills, the command lines, the benchmarks
"""

import os
import tempfile

import pytest

# Eight CPU devices in every test process (set before jax starts its backend), so every mesh
# shape of the 3D step is testable; single-device tests pass devices=jax.devices()[:1].
TEST_DEVICES = 8
_XLA_FLAGS = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _XLA_FLAGS:
  os.environ["XLA_FLAGS"] = f"{_XLA_FLAGS} --xla_force_host_platform_device_count={TEST_DEVICES}".strip()

import jax  # noqa: E402  (after XLA_FLAGS)

# Tests compile many identical programs (a mesh's state initialization for every schedule,
# the reference steps): JAX's persistent compilation cache, shared by the xdist workers,
# compiles each once. Keys are the program, the options and the jax version.
jax.config.update("jax_compilation_cache_dir", os.path.join(tempfile.gettempdir(), "megajax-tests-jax-cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

FOLDERS = ("unit", "integration", "e2e")


def pytest_collection_modifyitems(items):
  """Each test is marked by its folder (`-m unit`, `-m "not e2e"`, ...)."""
  for item in items:
    folder = os.path.basename(os.path.dirname(str(item.fspath)))
    if folder in FOLDERS:
      item.add_marker(getattr(pytest.mark, folder))


@pytest.fixture
def tiny_config():
  """A fresh, valid, fast config (tests mutate it freely)."""
  from megajax.config import default_config
  config = default_config()
  config.model.num_layers = 2
  config.model.hidden_dim = 32
  config.model.num_heads = 4
  config.model.seq_len = 16
  config.model.vocab_size = 64
  config.model.compute_dtype = "float32"
  config.train.batch_size = 4
  config.train.steps = 10
  config.optimizer.warmup_steps = 2
  return config


@pytest.fixture
def two_checkpoints(tmp_path, tmp_path_factory, tiny_config):
  """A one-device run of 6 steps with checkpoints 3 and 6 (a copy: damage it freely):
  (workdir, config, its 3D step)."""
  from tests.support.checkpoints import train_two_checkpoints
  return train_two_checkpoints(tmp_path, tiny_config, tmp_path_factory)
