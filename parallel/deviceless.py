"""The GPU without a GPU: XLA's whole GPU compiler, run on this machine for described GPUs.

`jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...)` gives a
compile-only client whose devices are the GPUs a target config describes; jitting over a mesh
of them and compiling runs what a GPU host would: SPMD partitioning, GPU fusion, Triton GEMM
and Pallas fusions, the latency-hiding scheduler, buffer assignment, LLVM -> PTX -> cubin. The
executable runs nowhere, but its scheduled module (`as_text()`) and its buffers
(`memory_analysis()`) are the real ones: which collectives overlap which compute, what is
copied, how many bytes a device needs.

It needs the CUDA plugin's two wheels (jax-cuda12-plugin and jax-cuda12-pjrt at jaxlib's
version, no nvidia-* wheels, no driver), kept out of the environment's import path in their own
folder (`plugin_dir()`; `megajax-gpu-compiler --install` puts them there): installed beside jax,
every process that imports jax would load them and print the CUDA stub's "Could not find cuda
drivers" lines on stderr. `topology()` loads them from there when first asked, and registers
the plugin with jax's CPU backend already running.

What it cannot say: how fast anything runs (nothing executes, and without a GPU XLA does not
autotune: Triton GEMMs take default tiles, cuDNN gets no workspace), nor what a Mosaic GPU
kernel holds (a custom call that stays opaque until a GPU's runtime compiles it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import math
import os
import sys
import time

import jax
from jax.experimental import topologies
import ml_collections

from megajax.config import ConfigError
from megajax.model import GPT, ModelConfig
from megajax.parallel.mesh import make_mesh
from megajax.parallel.step import ParallelStep


@dataclasses.dataclass(frozen=True)
class GpuTarget:
  """What XLA's GPU compiler needs to know of a device (its GpuTargetConfigProto), from
  NVIDIA's datasheets and the CUDA programming guide's compute-capability table."""
  device_kind: str            # what jax.Device.device_kind reads on one
  compute_capability: tuple[int, int]
  sms: int
  memory_bytes: int           # what the driver reports (nvidia-smi's MiB)
  memory_bandwidth: float     # bytes/s
  l2_cache_bytes: int
  clock_ghz: float            # boost clock
  shared_memory_per_sm: int   # bytes
  shared_memory_per_block_optin: int
  cudnn_version: tuple[int, int, int] = (9, 10, 0)    # the cuDNN a current jax wheel set loads

  def target_config(self) -> str:
    """The GpuTargetConfigProto, as text."""
    major, minor = self.compute_capability
    return "\n".join([
        "gpu_device_info {",
        "  threads_per_block_limit: 1024", "  threads_per_warp: 32", "  shared_memory_per_block: 49152",
        f"  shared_memory_per_core: {self.shared_memory_per_sm}", "  threads_per_core_limit: 2048",
        f"  core_count: {self.sms}", "  fpus_per_core: 128",
        "  block_dim_limit_x: 2147483647", "  block_dim_limit_y: 65535", "  block_dim_limit_z: 65535",
        f"  memory_bandwidth: {int(self.memory_bandwidth)}", f"  l2_cache_size: {self.l2_cache_bytes}",
        f"  clock_rate_ghz: {self.clock_ghz}", f"  device_memory_size: {self.memory_bytes}",
        f"  shared_memory_per_block_optin: {self.shared_memory_per_block_optin}",
        f"  cuda_compute_capability {{ major: {major} minor: {minor} }}",
        "  registers_per_core_limit: 65536", "  registers_per_block_limit: 65536",
        "}",
        'platform_name: "CUDA"',
        "dnn_version_info {{ major: {} minor: {} patch: {} }}".format(*self.cudnn_version),
        f'device_description_str: "{self.device_kind}"',
    ]) + "\n"


MIB = 2 ** 20
# Keyed like the planner's hardware (megajax.parallel.planner.hardware.HARDWARE). Both are GH100
# SXM parts (132 SMs, 50 MB L2, 228 KiB shared memory per SM, 227 KiB per block opted in); they
# differ in memory: H100 80 GB HBM3 at 3.35 TB/s (81559 MiB reported), H200 141 GB HBM3e at
# 4.8 TB/s (143771 MiB reported).
GPU_TARGETS = {
    "h100-80g": GpuTarget("NVIDIA H100 80GB HBM3", (9, 0), 132, 81559 * MIB, 3.35e12, 50 * MIB, 1.98,
                          228 * 1024, 227 * 1024),
    "h200-141g": GpuTarget("NVIDIA H200", (9, 0), 132, 143771 * MIB, 4.8e12, 50 * MIB, 1.98,
                           228 * 1024, 227 * 1024),
}
GPUS_PER_HOST = 8


def with_memory(target: str, memory_bytes: int) -> str:
  """`target` described with `memory_bytes` of memory: XLA:GPU schedules (and rematerializes)
  to fit the device it compiles for, so compiling for a smaller one asks whether a program fits
  there, not just what it holds when the device has room to spare."""
  return f"{target}@{int(memory_bytes) // MIB}MiB"


def described(name: str) -> GpuTarget:
  """The GpuTarget named `name`: a GPU_TARGETS key, or one with_memory made."""
  base, _, memory = name.partition("@")
  if base not in GPU_TARGETS or (memory and not (memory.endswith("MiB") and memory[:-3].isdigit())):
    raise ConfigError("target", name, "no such deviceless GPU",
                      f"use one of {', '.join(GPU_TARGETS)}, optionally with @<N>MiB of memory")
  spec = GPU_TARGETS[base]
  return dataclasses.replace(spec, memory_bytes=int(memory[:-3]) * MIB) if memory else spec


class DevicelessUnavailable(RuntimeError):
  """The CUDA plugin's wheels are not installed: nothing can compile for a GPU here."""


PLUGIN_WHEELS = ("jax-cuda12-plugin", "jax-cuda12-pjrt")


def plugin_dir() -> str:
  """Where the CUDA plugin's wheels live for this environment: $MEGAJAX_GPU_COMPILER, or
  <sys.prefix>/megajax-gpu-compiler (inside the virtual environment)."""
  return os.environ.get("MEGAJAX_GPU_COMPILER") or os.path.join(sys.prefix, "megajax-gpu-compiler")


def _register_cuda_plugin() -> None:
  """jax's CUDA plugin registered from plugin_dir() if jax has none (a GPU host's own install
  is used as it is). Its CUDA version check is skipped: there is no CUDA here, nor needed."""
  from jax._src import xla_bridge
  if "cuda" in xla_bridge._topology_factories:        # registered at jax's start (a GPU host)
    return
  folder = plugin_dir()
  if not os.path.isdir(os.path.join(folder, "jax_plugins")):
    raise DevicelessUnavailable(
        f"the deviceless GPU compile needs the CUDA plugin's wheels in {folder}: run megajax-gpu-compiler "
        f"--install (pip installs {' and '.join(PLUGIN_WHEELS)} at jaxlib's version there, no driver needed)")
  if folder not in sys.path:
    sys.path.append(folder)
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  xla_bridge._discover_and_register_pjrt_plugins()     # jax's own discovery, if it has not run yet
  if "cuda" not in xla_bridge._topology_factories:     # it ran before the folder was on the path
    importlib.import_module("jax_plugins.xla_cuda12").initialize()


@functools.cache
def topology(target: str = "h100-80g", devices: int = GPUS_PER_HOST):
  """`devices` described GPUs in hosts of 8 (a process index each, as on a cluster)."""
  spec = described(target)
  hosts = math.ceil(devices / GPUS_PER_HOST)
  if devices > GPUS_PER_HOST and devices % GPUS_PER_HOST:
    raise ConfigError("devices", devices, f"more than one host of {GPUS_PER_HOST} GPUs must fill whole hosts",
                      f"use a multiple of {GPUS_PER_HOST}")
  _register_cuda_plugin()
  return topologies.get_topology_desc(platform="cuda", target_config=spec.target_config(),
                                      topology=f"1x{hosts}x{min(devices, GPUS_PER_HOST)}")


def gpu_devices(target: str = "h100-80g", devices: int = GPUS_PER_HOST) -> list:
  """The compile-only devices of `topology(target, devices)`."""
  return list(topology(target, devices).devices)


@contextlib.contextmanager
def cudnn_as(target: str = "h100-80g"):
  """jax.nn.dot_product_attention asks the installed cuDNN and GPU at trace time (and finds
  neither on a CPU machine): answered as the target's, so the step traces the cuDNN fused
  attention calls it would there. Restored on exit."""
  from jax._src.cudnn import fused_attention_stablehlo as lowering   # jax's own answerers
  spec = described(target)
  major, minor, patch = spec.cudnn_version
  version = lambda text: tuple(int(x) for x in text.split("."))    # "9.0" -> (9, 0)
  answers = {"check_cudnn_version": lambda: major * 10000 + minor * 100 + patch,
             "check_compute_capability": lambda wanted: spec.compute_capability >= version(wanted),
             "is_cuda_compute_capability_equal": lambda wanted: spec.compute_capability == version(wanted)}
  saved = {name: getattr(lowering, name) for name in answers}
  try:
    for name, answer in answers.items():
      setattr(lowering, name, answer)
    yield
  finally:
    for name, original in saved.items():
      setattr(lowering, name, original)


@contextlib.contextmanager
def _nothing_cached():
  """jax's persistent compilation cache left out: a compile-only client cannot load what it
  would write (each read warns and fails), so writing it is only CPU and disk spent."""
  saved = jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
  try:
    yield
  finally:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", saved)


def compile_lowered(lowered):
  """(lowered.compile(), seconds it took), nothing written to the persistent cache: any program
  lowered with arguments placed on described GPUs (gpu_devices)."""
  started = time.perf_counter()
  with _nothing_cached():
    compiled = lowered.compile()
  return compiled, time.perf_counter() - started


@dataclasses.dataclass(frozen=True)
class CompiledForGpu:
  """One program compiled for described GPUs: the executable, its scheduled module, the time the
  compile took (what CI pays), and the 3D step it came from."""
  step: ParallelStep
  compiled: object            # jax.stages.Compiled (runs nowhere)
  compile_seconds: float

  @functools.cached_property
  def text(self) -> str:
    return self.compiled.as_text()

  def bytes_per_device(self) -> int:
    return bytes_per_device(self.compiled)


def bytes_per_device(compiled) -> int:
  """XLA's peak bytes on one device of a compiled program: arguments + outputs + temporaries -
  donated aliases (what must fit beside the runtime's own reservations)."""
  m = compiled.memory_analysis()
  return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def parallel_step_for_gpu(config: ml_collections.ConfigDict, target: str = "h100-80g") -> ParallelStep:
  """The config's 3D step on a mesh of described GPUs (kernels lowered for CUDA)."""
  p = config.parallel
  mesh = make_mesh(p, gpu_devices(target, p.dp * p.pp * p.cp * p.tp))
  return ParallelStep.build(config, GPT(ModelConfig.from_config(config.model)), mesh, platform="cuda")


def compile_for_gpu(config: ml_collections.ConfigDict, target: str = "h100-80g",
                    program: str = "train") -> CompiledForGpu:
  """The config's training step (program="train") or held-out eval step ("eval") compiled for
  dp * pp * cp * tp described GPUs of `target`."""
  if program not in ("train", "eval"):
    raise ValueError(f"program={program!r}: 'train' or 'eval'")
  with cudnn_as(target) if config.model.attention_impl == "cudnn" else contextlib.nullcontext():
    step = parallel_step_for_gpu(config, target)
    state, batch = step.abstract_inputs()
    jitted = step.train_step() if program == "train" else step.eval_step()
    lowered = jitted.lower(state, batch) if program == "train" else jitted.lower(state.params, batch)
  return CompiledForGpu(step, *compile_lowered(lowered))


def compile_function_for_gpu(fn, *shapes: jax.ShapeDtypeStruct, target: str = "h100-80g"):
  """`fn` (a kernel, a layer) jitted and compiled for one described GPU, its arguments placed
  there: (the compiled executable, seconds). A Triton kernel whose blocks do not fit the SM's
  shared memory fails here, as it would on the GPU."""
  device = gpu_devices(target, 1)[0]
  placed = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=jax.sharding.SingleDeviceSharding(device))
            for s in shapes]
  return compile_lowered(jax.jit(fn).lower(*placed))
