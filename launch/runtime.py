"""Start-up settings for megajax-train: XLA GPU flag presets, NCCL settings, compilation cache.

`configure_runtime(config, workdir)` runs before jax starts its backend (XLA reads XLA_FLAGS
once, when the first client starts):

- GPU (a CUDA PJRT plugin installed and an NVIDIA device node or nvidia-smi present, and
  JAX_PLATFORMS not excluding cuda), `runtime.xla_preset="auto"`: the `GPU_PRESET` flags below
  join XLA_FLAGS. Precedence: `runtime.xla_flags` > flags already in XLA_FLAGS > the preset;
  one entry per flag name. NCCL variables in `NCCL_PRESET` are set unless already set.
- Every platform: `runtime.xla_flags` joins XLA_FLAGS; the persistent compilation cache is
  `runtime.compilation_cache_dir` ("" -> $JAX_COMPILATION_CACHE_DIR if set, else
  WORKDIR/jax_cache; "none" -> off) with no minimum compile time, so a restart loads every
  program of the step instead of compiling it.

XLA aborts the process on a flag name it does not define, and flags come and go between
releases, so every flag (preset or the user's) is checked against the installed XLA first
(`known_xla_flag`) and dropped with a warning when unknown.

Persistent cache facts (jax 0.10.2, jax/_src/compilation_cache.py, compiler.py, cache_key.py):
CPU, GPU and TPU are cached, no switch needed (`is_cache_used`); donated shard_map programs are
cached (checked); programs with host callbacks (jax.debug.print) never are; only process 0
writes entries, compressed with zstd (zstandard, a dependency for this: 7x less CPU than
jax's zlib fallback on a step's executables). Multi-process CPU jobs: only process 0 hits, the
others compile every time (the key hashes the CPU topology's fingerprint, which differs per
process; checked, no jax option changes it). On GPU jax strips the device assignment from the
key so that processes agree (not checked here). `jax_enable_compilation_cache` is the master
switch; `jax_persistent_cache_enable_xla_caches` (default "xla_gpu_per_fusion_autotune_cache_dir")
keeps XLA:GPU's autotuning results in the same directory, so a warm start skips autotuning too.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import importlib.util
import mmap
import os
import re
import shutil

from absl import logging


@dataclasses.dataclass(frozen=True)
class XlaFlag:
  """One XLA flag with the jaxlib releases that define it: since <= version < until."""
  name: str
  value: str
  since: str              # first jaxlib release with the flag (from XLA's history, +- a release)
  until: str | None       # first jaxlib release without it; None: defined in the newest checked
  why: str

  def valid_in(self, version: str) -> bool:
    v = _version_tuple(version)
    return _version_tuple(self.since) <= v and (self.until is None or v < _version_tuple(self.until))


# Checked against jaxlib 0.10.2 (the flag names in libjax_common.so, and XLA_FLAGS accepted).
GPU_PRESET = (
    XlaFlag("xla_gpu_enable_latency_hiding_scheduler", "true", "0.4.1", None,
            "schedule async collectives (ZeRO gathers, gradient reduce-scatters, pipeline sends) under compute"),
    XlaFlag("xla_gpu_enable_pipelined_all_gather", "true", "0.4.20", None,
            "start the next scan iteration's all-gathers in this one (default off)"),
    XlaFlag("xla_gpu_enable_pipelined_reduce_scatter", "true", "0.4.20", None,
            "finish a microbatch's gradient reduce-scatter during the next one (XLA's default already)"),
    XlaFlag("xla_gpu_enable_pipelined_all_reduce", "true", "0.4.20", None,
            "same for the all-reduces of leaves no dimension of which divides by dp (default off)"),
    XlaFlag("xla_gpu_enable_while_loop_double_buffering", "true", "0.4.25", None,
            "unroll the microbatch / pipeline-tick loops by two so one iteration's collectives overlap the next"),
    XlaFlag("xla_gpu_threshold_for_windowed_einsum_mib", "0", "0.4.24", None,
            "auto-sharded (jit, not shard_map) einsums become windowed collective matmuls; the manual 3D "
            "step sets this per program with tp_overlap='xla'"),
    XlaFlag("xla_gpu_multi_streamed_windowed_einsum", "true", "0.4.29", None,
            "run the windowed einsum's partial matmuls on several streams"),
)
# Collective combine thresholds are left to XLA: since 2025 it sizes combined collectives itself
# when they are unset (xla_gpu_experimental_enable_heuristic_collective_combining); a fixed
# threshold turns that off. Set them with runtime.xla_flags when profiling says so.

# Flags once recommended for training that XLA has removed (never preset; the table fallback).
RETIRED = (
    XlaFlag("xla_gpu_enable_pipelined_collectives", "true", "0.4.14", "0.10.2",
            "umbrella flag, split into the three pipelined_* flags (removal release not pinned; unknown in 0.10.2)"),
    *(XlaFlag(f"xla_gpu_enable_async_{op}", "true", "0.4.1", "0.4.27",
              "async is the default since XLA PR 11422; opt out with --xla_gpu_disable_async_collectives")
      for op in ("collectives", "all_gather", "reduce_scatter", "all_reduce", "collective_permute")),
)

# NCCL over InfiniBand / RoCE: a link flap (a port going down and up, MegaScale section 6) kills
# a queue pair once it has retransmitted IB_RETRY_CNT times, each after 4.096 us * 2^IB_TIMEOUT.
# NCCL's defaults (20, 7) give up after ~35 s; 22 rides out flaps of ~2.3 min (8 x 17 s), about
# the supervisor's hang timeout, after which a restart is cheaper than waiting.
NCCL_PRESET = {
    "NCCL_IB_TIMEOUT": ("22", "4.096 us * 2^22 = 17 s per retransmission attempt (NCCL default 20: 4.3 s)"),
    "NCCL_IB_RETRY_CNT": ("7", "the most the 3-bit IB field allows; set so a site nccl.conf cannot lower it"),
}


def _version_tuple(version: str) -> tuple[int, ...]:
  return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def jaxlib_version() -> str:
  import jaxlib.version
  return jaxlib.version.__version__


def flag_name(flag: str) -> str:
  """'--xla_foo=1' -> 'xla_foo'."""
  return flag.lstrip("-").split("=", 1)[0]


def split_flags(flags: str) -> list[str]:
  """XLA_FLAGS tokens: whitespace-separated, a double-quoted value may hold spaces."""
  return re.findall(r'(?:[^\s"]|"[^"]*")+', flags or "")


def xla_libraries() -> tuple[str, ...]:
  """The shared libraries holding an XLA that parses XLA_FLAGS: jaxlib's own and PJRT plugins'."""
  found = []
  for package in ("jaxlib", "jax_plugins"):
    spec = importlib.util.find_spec(package)
    for root in (spec.submodule_search_locations or []) if spec else []:
      for path in sorted(glob.glob(os.path.join(root, "*.so")) + glob.glob(os.path.join(root, "*", "*.so"))):
        if os.path.getsize(path) >= 32 << 20:      # XLA itself is hundreds of MiB; skip the stubs
          found.append(path)
  return tuple(found)


@functools.lru_cache(maxsize=None)
def _library_defines(path: str, name: str) -> bool:
  # A defined flag's name is a C string literal of its own ("\0name\0") in the library; a name that
  # is only a DebugOptions proto field (a removed flag) or a reserved field is never \0-delimited.
  with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
    return data.find(b"\0" + name.encode() + b"\0") >= 0


def _table_knows(name: str, version: str) -> bool:
  for entry in GPU_PRESET + RETIRED:
    if entry.name == name:
      return entry.valid_in(version)
  return True        # not in the table: cannot tell without the library; trust the user


def known_xla_flag(name: str, version: str | None = None) -> bool:
  """Whether the installed XLA defines flag `name` ('--name=value' works too): its name as a
  C string in every XLA library of jaxlib and the plugins; the version table if none is readable."""
  name = flag_name(name)
  answers = []
  for path in xla_libraries():
    try:
      answers.append(_library_defines(path, name))
    except (OSError, ValueError):
      continue
  if answers:
    return all(answers)
  return _table_knows(name, version or jaxlib_version())


def xla_flags_for(platform_is_gpu: bool, jax_version: str, extra: str = "") -> tuple[list[str], list[str]]:
  """(kept, dropped) flags: the preset for this jaxlib version (GPU only), then `extra`
  (runtime.xla_flags), each kept only if this XLA defines it."""
  candidates = [f"--{entry.name}={entry.value}" for entry in GPU_PRESET
                if platform_is_gpu and entry.valid_in(jax_version)] + split_flags(extra)
  kept, dropped = [], []
  for flag in candidates:
    (kept if known_xla_flag(flag, jax_version) else dropped).append(flag)
  return kept, dropped


def merge_xla_flags(existing: str, preset: list[str], extra: list[str]) -> str:
  """XLA_FLAGS with one entry per name: `extra` wins over `existing`, which wins over `preset`."""
  def by_name(flags):
    return {flag_name(f): f for f in flags}      # the last of a repeated name wins
  extra_, existing_ = by_name(extra), by_name(split_flags(existing))
  merged = [f for n, f in by_name(preset).items() if n not in existing_ and n not in extra_]
  merged += [f for n, f in existing_.items() if n not in extra_] + list(extra_.values())
  return " ".join(merged)


def nccl_environment(environ) -> dict[str, str]:
  """The NCCL_PRESET variables this environment does not set yet (the environment wins)."""
  return {name: value for name, (value, _) in NCCL_PRESET.items() if name not in environ}


def cuda_plugin_installed() -> bool:
  for module in ("jax_cuda13_plugin", "jax_cuda12_plugin"):
    if importlib.util.find_spec(module) is not None:
      return True
  spec = importlib.util.find_spec("jax_plugins")
  roots = (spec.submodule_search_locations or []) if spec else []
  return any(glob.glob(os.path.join(root, "xla_cuda*")) for root in roots)


def gpu_available(environ=None) -> bool:
  """An NVIDIA GPU jax will use, decided without starting a jax backend."""
  environ = os.environ if environ is None else environ
  platforms = [p.strip().lower() for p in environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
  if platforms and not {"cuda", "gpu"} & set(platforms):
    return False
  return cuda_plugin_installed() and (bool(glob.glob("/dev/nvidia[0-9]*")) or shutil.which("nvidia-smi") is not None)


def cpu_without_a_gpu(environ=None) -> bool:
  """With the CUDA plugin installed (the test extra brings it, for the deviceless GPU compile)
  but no NVIDIA GPU and JAX_PLATFORMS unset, jax's platforms set to the CPU before any backend
  starts: the plugin then skips its CUDA check, which on such a machine logs a traceback
  ("Unable to load CUDA") before jax falls back to the CPU anyway. True when it did."""
  environ = os.environ if environ is None else environ
  if environ.get("JAX_PLATFORMS") or not cuda_plugin_installed() or gpu_available(environ):
    return False
  _set_jax_option("jax_platforms", "cpu")
  return True


def compilation_cache_path(setting: str, workdir: str, environ=None) -> tuple[str | None, str]:
  """(directory or None for off, where it came from) for runtime.compilation_cache_dir."""
  environ = os.environ if environ is None else environ
  if setting.strip().lower() == "none":
    return None, "off (runtime.compilation_cache_dir='none')"
  if setting:
    return os.path.abspath(os.path.expanduser(setting)), "runtime.compilation_cache_dir"
  if environ.get("JAX_COMPILATION_CACHE_DIR"):
    return environ["JAX_COMPILATION_CACHE_DIR"], "$JAX_COMPILATION_CACHE_DIR"
  return os.path.abspath(os.path.join(workdir, "jax_cache")), "WORKDIR/jax_cache"


def _can_create_directory(path: str) -> bool:
  """`path` is a writable directory, or its nearest existing ancestor is one."""
  while not os.path.exists(path) and os.path.dirname(path) != path:
    path = os.path.dirname(path)
  return os.path.isdir(path) and os.access(path, os.W_OK)


def _set_jax_option(name: str, value) -> None:
  import jax
  jax.config.update(name, value)


def configure_runtime(config, workdir: str, environ=None) -> dict:
  """Applies the start-up settings (before jax starts a backend); returns and logs what it set."""
  environ = os.environ if environ is None else environ
  runtime, version = config.runtime, jaxlib_version()
  gpu = gpu_available(environ)
  preset, dropped_preset = xla_flags_for(gpu and runtime.xla_preset == "auto", version)
  extra, dropped_extra = xla_flags_for(False, version, runtime.xla_flags)
  before = environ.get("XLA_FLAGS", "")
  merged = merge_xla_flags(before, preset, extra)
  if merged != before:
    environ["XLA_FLAGS"] = merged
  nccl = nccl_environment(environ) if gpu and runtime.xla_preset == "auto" else {}
  environ.update(nccl)
  for flag in dropped_extra:
    logging.warning("runtime.xla_flags: %s dropped: jaxlib %s's XLA does not define %s (it would abort the "
                    "launch)", flag, version, flag_name(flag))

  path, source = compilation_cache_path(runtime.compilation_cache_dir, workdir, environ)
  if path is None:
    _set_jax_option("jax_enable_compilation_cache", False)
  else:
    # Not made here: jax makes it at the first compile, so a run refused before that (a config
    # that cannot fit its devices) leaves no WORKDIR/jax_cache behind. jax warns on each failed
    # write and compiles on: not fatal, but said once here.
    if not _can_create_directory(path):
      logging.warning("compilation cache directory %s: not writable, nothing will be cached", path)
    if source != "$JAX_COMPILATION_CACHE_DIR":       # jax read the variable itself at import
      _set_jax_option("jax_compilation_cache_dir", path)
    _set_jax_option("jax_persistent_cache_min_compile_time_secs", 0)
  applied = {"gpu": gpu, "jaxlib": version, "xla_flags": merged, "preset": preset,
             "dropped": dropped_preset + dropped_extra, "nccl": nccl, "compilation_cache_dir": path,
             "compilation_cache_source": source}
  logging.info("start-up: %s, jaxlib %s; XLA preset %s%s%s; NCCL %s", "GPU" if gpu else "no GPU", version,
               f"{len(preset)} flags" if preset else "not applied", f" ({len(dropped_preset)} unknown here, dropped)"
               if dropped_preset else "", f"; runtime.xla_flags {' '.join(extra)}" if extra else "",
               " ".join(f"{k}={v}" for k, v in nccl.items()) or "unchanged")
  logging.info("start-up: persistent compilation cache %s (%s)", path or "off", source)
  return applied
