"""Every test process: 8 CPU devices, a shared compilation cache, the folder markers, the tiny config.

  tests/unit/         one module at a time, in process: no subprocess, no sleep (the quick loop)
  tests/integration/  in process but compile-heavy: the 3D step against the single-device
                      reference on every mesh shape, the kernels at every shape in the
                      interpreter, training runs restored onto other meshes
  tests/e2e/          processes: the launcher, multi-process jobs, checkpoints across
                      kills, the fault and straggler drills, the command lines, the benchmarks
  tests/gpu/          the kernels compiled on a GPU and the step on one: run with
                      MEGAJAX_TESTS_ON=gpu on a GPU host (`python -m megajax.launch.bench gpu`)

The suite is a CPU suite on any host: unless MEGAJAX_TESTS_ON=gpu, JAX (and every process a
test starts) is pinned to the CPU platform, so a GPU host runs the same 8-device tests.
With MEGAJAX_TESTS_ON=gpu the tests marked `cpu_only` are skipped, the reason shown.
"""

import gc
import os
import tempfile

import pytest

from tests.support import COMPILE_FLAGS, xla_flags   # (imports no jax: XLA_FLAGS are set below first)

# Eight CPU devices in every test process (set before jax starts its backend), so every mesh
# shape of the 3D step is testable; single-device tests pass devices=jax.devices()[:1].
TEST_DEVICES = 8
TESTS_ON = os.environ.get("MEGAJAX_TESTS_ON", "cpu")
if TESTS_ON not in ("cpu", "gpu"):
  raise pytest.UsageError(f"MEGAJAX_TESTS_ON={TESTS_ON!r}: use cpu (the default) or gpu")
# numpy's OpenBLAS on one thread (set before numpy loads; the processes the tests start inherit
# it): its worker threads spin after threaded calls, and in a profile of the whole suite on
# 2 cores that spinning (`blas_thread_server`) took 13 s of CPU from the other xdist worker.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
if TESTS_ON == "cpu":
  os.environ["JAX_PLATFORMS"] = "cpu"
_XLA_FLAGS = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _XLA_FLAGS:
  _XLA_FLAGS = f"{_XLA_FLAGS} --xla_force_host_platform_device_count={TEST_DEVICES}".strip()
# The in-process tests compile hundreds of training programs of tiny models and run each a
# few steps: XLA:CPU's compile time is what counts there, not its kernels' speed.
# - LLVM -O0: LLVM's optimizations of the kernels cost more than they save (a 2-layer step:
#   31 s -> 18 s to compile).
# - XLA:CPU's classic (elemental) kernel emitters instead of its MLIR fusion emitters: about
#   half the compile time again (the dp2-pp2-tp2 interleaved step on 2 busy cores: 22.4 ->
#   11.0 s; tests/unit/test_parallel.py and test_probes.py from a cold cache: 164 -> 114 s).
# - The kernels' LLVM module compiled as one, not split into 32 parts for parallel codegen:
#   each part pays the module's and the target machine's set-up again, and a test worker has
#   one core (2 workers on 2 cores) to run the parts on (the dp2-tp4 step 2.7 -> 2.0 s of CPU
#   to compile, dp2-pp2-tp2 2.6 -> 2.2, dp8 1.65 -> 1.3). Codegen only: the same kernels.
#   It also keeps the one bitwise check across programs (a pipeline's sharded init, its layers
#   stacked, = the single-device reference's init) exact with the classic emitters: split in
#   parts, the two programs' random normals differed by an ulp in a few elements.
# Values may differ from XLA's default by rounding only (fused multiply-adds, the emitters' own
# roundings); every comparison is between programs of this process or to a tolerance, and the
# reference is compiled like what it checks. Processes the tests start
# (the launcher, the drills, the benchmarks) get the same flags (tests.support.processes.child_env)
# unless they ask for XLA's default (the default job's 70 full-width steps).
# (tests.support.COMPILE_FLAGS; a flag already in XLA_FLAGS keeps its value.)
if TESTS_ON == "cpu":
  missing = {name: value for name, value in COMPILE_FLAGS.items() if name not in _XLA_FLAGS}
  _XLA_FLAGS = f"{_XLA_FLAGS} {xla_flags(missing)}".strip()
os.environ["XLA_FLAGS"] = _XLA_FLAGS

import jax  # noqa: E402  (after XLA_FLAGS)

# Tests compile many identical programs (a mesh's state initialization for every schedule,
# the reference steps): JAX's persistent compilation cache, shared by the xdist workers,
# compiles each once. Keys are the program, the options and the jax version.
jax.config.update("jax_compilation_cache_dir", os.path.join(tempfile.gettempdir(), "megajax-tests-jax-cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

FOLDERS = ("unit", "integration", "e2e", "gpu")

# Where a test can hold: `gpu` tests need a GPU (the kernels compiled for real, tests/gpu);
# `cpu_only` ones state what only holds on CPU (the interpreter, CPU-only refusals).
ON_GPU = jax.devices()[0].platform == "gpu"
NEEDS_GPU = pytest.mark.skip(reason="needs a GPU and MEGAJAX_TESTS_ON=gpu: `python -m megajax.launch.bench gpu "
                                    "--parts=tests` runs them on one")
CPU_ONLY = pytest.mark.skip(reason="holds on CPU only (see the test's docstring); this host has a GPU")


def pytest_collection_modifyitems(items):
  """Each test is marked by its folder (`-m unit`, `-m "not e2e"`, ...); `gpu` tests are
  skipped without a GPU and `cpu_only` ones with one, the reason shown."""
  for item in items:
    folder = os.path.basename(os.path.dirname(str(item.fspath)))
    if folder in FOLDERS:
      item.add_marker(getattr(pytest.mark, folder))
    if "gpu" in item.keywords and not ON_GPU:
      item.add_marker(NEEDS_GPU)
    if "cpu_only" in item.keywords and ON_GPU:
      item.add_marker(CPU_ONLY)


# With `-n`, the e2e tests run one after another on one xdist worker while the others take the
# in-process tests (and, once it is done, what is left). Their jobs are processes whose
# collectives (gloo on CPU) wait for their peers: two such jobs side by side on 2 cores keep
# descheduling each other's peers, and each wait burns CPU that the other worker's compiles need.
PROCESS_TESTS = "tests/e2e/"


# A unit module runs on one worker: its module fixtures (compiled steps, models) are made once
# and its tests meet the programs their neighbours compiled in memory (the unit folder: 223 -> 208
# CPU-s with -n 2). The integration tests stay one unit each: a module of them is minutes of work.
UNIT_TESTS = "tests/unit/"
# Integration modules whose tests read programs one fixture compiles (each compile is 15-25 s):
# one worker, so each is compiled once.
ONE_WORKER_MODULES = ("tests/integration/test_gpu_compile.py",)


def pytest_xdist_make_scheduler(config, log):
  """xdist's default `load` scheduling, but the e2e folder is one unit of work (one worker),
  and so is each unit-test module and each of ONE_WORKER_MODULES."""
  if config.getvalue("dist") != "load":
    return None             # a --dist the user chose
  from xdist.scheduler import LoadScopeScheduling

  class ScopesOnOneWorker(LoadScopeScheduling):
    def _split_scope(self, nodeid: str) -> str:
      if nodeid.startswith(PROCESS_TESTS):
        return PROCESS_TESTS
      module = nodeid.split("::")[0]
      return module if nodeid.startswith(UNIT_TESTS) or module in ONE_WORKER_MODULES else nodeid

  return ScopesOnOneWorker(config, log)


# Python's cyclic garbage collector, not XLA, took a sixth of the unit tests' time: tracing
# allocates millions of objects, and every few tests the heap (the compiled programs, jaxprs
# and caches kept so far: 300-500k objects) had grown enough for a full collection to walk it
# all again, finding next to nothing (tests/unit/test_parallel.py and test_model.py with a
# warm compilation cache: 33 -> 28 s of CPU; the whole suite's unit folder 266 -> 223
# worker-s, the compile-bound integration folder 658 -> 637). The automatic collections are
# off; every FULL_COLLECTION_EVERY tests one full collection frees what died in cycles since,
# so a worker's memory stays bounded (one costs 0.3-0.5 s).
FULL_COLLECTION_EVERY = 50
gc.disable()
_tests_since_full_collection = 0


def pytest_collection_finish(session):
  """Collection imported every test module (jax, flax, orbax, megajax) and made the items:
  their objects (314,000 after collecting the whole suite) live as long as the worker, so
  they leave the full collections' walks (gc.freeze; each walked them again: 0.43 s), as in
  the commands (megajax.launch.cli.freeze_imported_objects)."""
  gc.freeze()


def pytest_runtest_logfinish(nodeid, location):
  global _tests_since_full_collection
  _tests_since_full_collection += 1
  if _tests_since_full_collection >= FULL_COLLECTION_EVERY:
    _tests_since_full_collection = 0
    gc.collect()


@pytest.fixture(scope="session", autouse=True)
def _run_tmp_path_factory(tmp_path_factory):
  """tests.support.once's results made once per run, also for helpers without fixtures."""
  from tests.support import once
  once.RUN_TMP_PATH_FACTORY = tmp_path_factory


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
