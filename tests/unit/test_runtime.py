"""megajax.launch.runtime: XLA flag presets and checks, NCCL settings, the compilation cache.

Nothing here starts a jax backend or changes this test process's environment or its
compilation cache: configure_runtime gets an environment dict and a stubbed jax.config.
"""

import os

import pytest

from megajax.config import default_config
from megajax.launch import runtime

VERSION = runtime.jaxlib_version()
BOGUS = "--xla_gpu_flag_that_does_not_exist=true"


@pytest.fixture
def jax_options(monkeypatch):
  """Records configure_runtime's jax.config updates instead of applying them."""
  updates = {}
  monkeypatch.setattr(runtime, "_set_jax_option", updates.__setitem__)
  return updates


def _config(**runtime_fields):
  config = default_config()
  config.runtime.update(runtime_fields)
  return config


def _names(flags: str) -> list[str]:
  return [runtime.flag_name(f) for f in runtime.split_flags(flags)]


def test_known_xla_flag_reads_the_installed_xla():
  assert runtime.xla_libraries(), "no XLA library found in jaxlib"
  assert runtime.known_xla_flag("xla_force_host_platform_device_count")
  assert runtime.known_xla_flag("--xla_dump_to=/tmp/x")
  assert not runtime.known_xla_flag(BOGUS)
  # A removed flag whose name survives only as a (reserved) DebugOptions proto field.
  assert not runtime.known_xla_flag("xla_gpu_enable_async_all_gather")


def test_table_fallback_when_no_library_is_readable(monkeypatch):
  monkeypatch.setattr(runtime, "xla_libraries", lambda: ("/nonexistent/libxla.so",))
  assert runtime.known_xla_flag("xla_gpu_enable_pipelined_all_gather", "0.10.2")
  assert not runtime.known_xla_flag("xla_gpu_enable_pipelined_all_gather", "0.4.16")   # before it existed
  assert not runtime.known_xla_flag("xla_gpu_enable_async_all_gather", "0.10.2")       # removed
  assert runtime.known_xla_flag("xla_gpu_enable_async_all_gather", "0.4.20")


def test_unknown_flags_are_dropped_and_reported():
  kept, dropped = runtime.xla_flags_for(False, VERSION, f"--xla_dump_to=/tmp/d {BOGUS}")
  assert kept == ["--xla_dump_to=/tmp/d"] and dropped == [BOGUS]
  kept, dropped = runtime.xla_flags_for(True, "0.4.10", "")       # an older jaxlib: its table rows only
  assert [runtime.flag_name(f) for f in kept] == ["xla_gpu_enable_latency_hiding_scheduler"]


def test_merge_precedence_and_no_duplicates():
  preset = ["--xla_a=1", "--xla_b=1", "--xla_c=1"]
  merged = runtime.merge_xla_flags("--xla_b=env --xla_d=env --xla_c=env", preset, ["--xla_c=user", "--xla_e=user"])
  assert merged.split() == ["--xla_a=1", "--xla_b=env", "--xla_d=env", "--xla_c=user", "--xla_e=user"]
  assert runtime.merge_xla_flags("", ["--xla_a=1", "--xla_a=2"], []) == "--xla_a=2"
  assert runtime.split_flags('--xla_a="x y" --xla_b=1') == ['--xla_a="x y"', "--xla_b=1"]


def test_configure_runtime_on_a_gpu_machine(monkeypatch, jax_options, tmp_path):
  monkeypatch.setattr(runtime, "gpu_available", lambda environ=None: True)
  environ = {"XLA_FLAGS": "--xla_gpu_enable_pipelined_all_gather=false --xla_force_host_platform_device_count=8",
             "NCCL_IB_TIMEOUT": "18"}
  config = _config(xla_flags=f"--xla_gpu_enable_latency_hiding_scheduler=false {BOGUS}")
  applied = runtime.configure_runtime(config, str(tmp_path), environ=environ)
  flags = environ["XLA_FLAGS"].split()
  names = _names(environ["XLA_FLAGS"])
  assert len(names) == len(set(names)) == len(runtime.GPU_PRESET) + 1
  assert "--xla_gpu_enable_pipelined_all_gather=false" in flags                  # the environment beat the preset
  assert "--xla_gpu_enable_latency_hiding_scheduler=false" in flags             # runtime.xla_flags beat both
  assert "--xla_gpu_enable_pipelined_reduce_scatter=true" in flags              # the preset
  assert BOGUS not in environ["XLA_FLAGS"] and applied["dropped"] == [BOGUS]
  assert environ["NCCL_IB_TIMEOUT"] == "18"                                     # the user's value stays
  assert environ["NCCL_IB_RETRY_CNT"] == runtime.NCCL_PRESET["NCCL_IB_RETRY_CNT"][0]
  assert applied["nccl"] == {"NCCL_IB_RETRY_CNT": environ["NCCL_IB_RETRY_CNT"]}


def test_preset_none_adds_nothing_on_a_gpu(monkeypatch, jax_options, tmp_path):
  monkeypatch.setattr(runtime, "gpu_available", lambda environ=None: True)
  environ = {}
  runtime.configure_runtime(_config(xla_preset="none"), str(tmp_path), environ=environ)
  assert "XLA_FLAGS" not in environ and not any(k.startswith("NCCL_") for k in environ)


def test_cpu_gets_no_gpu_flags_and_no_nccl(jax_options, tmp_path):
  environ = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  assert not runtime.gpu_available(environ)
  applied = runtime.configure_runtime(_config(xla_flags="--xla_dump_to=/tmp/d"), str(tmp_path), environ=environ)
  assert environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8 --xla_dump_to=/tmp/d"
  assert not applied["gpu"] and applied["preset"] == [] and applied["nccl"] == {}
  assert not any(k.startswith("NCCL_") for k in environ)


def test_nccl_environment_keeps_user_values():
  assert runtime.nccl_environment({"NCCL_IB_TIMEOUT": "30"}) == {
      "NCCL_IB_RETRY_CNT": runtime.NCCL_PRESET["NCCL_IB_RETRY_CNT"][0]}
  assert runtime.nccl_environment({name: "1" for name in runtime.NCCL_PRESET}) == {}


def test_compilation_cache_path(tmp_path):
  work = str(tmp_path)
  assert runtime.compilation_cache_path("", work, {}) == (os.path.join(work, "jax_cache"), "WORKDIR/jax_cache")
  assert runtime.compilation_cache_path("", work, {"JAX_COMPILATION_CACHE_DIR": "/c"})[0] == "/c"
  assert runtime.compilation_cache_path("none", work, {"JAX_COMPILATION_CACHE_DIR": "/c"})[0] is None
  assert runtime.compilation_cache_path(str(tmp_path / "x"), work, {"JAX_COMPILATION_CACHE_DIR": "/c"})[0] == str(
      tmp_path / "x")


def test_configure_runtime_sets_the_cache(jax_options, tmp_path):
  environ = {"JAX_PLATFORMS": "cpu"}
  applied = runtime.configure_runtime(_config(), str(tmp_path), environ=environ)
  assert jax_options == {"jax_compilation_cache_dir": str(tmp_path / "jax_cache"),
                         "jax_persistent_cache_min_compile_time_secs": 0}
  assert applied["compilation_cache_dir"] == str(tmp_path / "jax_cache")
  assert not (tmp_path / "jax_cache").exists()          # jax makes it at the first compile: none, none made
  jax_options.clear()                                   # the environment's directory: jax read it already
  runtime.configure_runtime(_config(), str(tmp_path), environ={"JAX_PLATFORMS": "cpu",
                                                               "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "env")})
  assert jax_options == {"jax_persistent_cache_min_compile_time_secs": 0}
  jax_options.clear()
  runtime.configure_runtime(_config(compilation_cache_dir="none"), str(tmp_path), environ={"JAX_PLATFORMS": "cpu"})
  assert jax_options == {"jax_enable_compilation_cache": False}


def test_a_machine_without_a_gpu_is_pinned_to_the_cpu_when_the_cuda_plugin_is_installed(monkeypatch, jax_options):
  """The CUDA plugin (the test extra's) with no GPU: jax_platforms=cpu before any backend, so
  the plugin skips its CUDA check (a logged traceback otherwise); never over a user's choice."""
  monkeypatch.setattr(runtime, "cuda_plugin_installed", lambda: True)
  monkeypatch.setattr(runtime, "gpu_available", lambda environ=None: False)
  assert runtime.cpu_without_a_gpu({}) and jax_options == {"jax_platforms": "cpu"}
  jax_options.clear()
  assert not runtime.cpu_without_a_gpu({"JAX_PLATFORMS": "cuda"}) and jax_options == {}
  monkeypatch.setattr(runtime, "gpu_available", lambda environ=None: True)
  assert not runtime.cpu_without_a_gpu({}) and jax_options == {}
  monkeypatch.setattr(runtime, "cuda_plugin_installed", lambda: False)
  monkeypatch.setattr(runtime, "gpu_available", lambda environ=None: False)
  assert not runtime.cpu_without_a_gpu({}) and jax_options == {}
