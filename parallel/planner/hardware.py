"""What a GPU and its links do, from published micro-benchmarks: the cost model's measured half.

Every number here is a datasheet figure or a published measurement, cited where it is set;
none is fitted to a training run (the few the cost model fits live in cost_model.Calibration,
fitted on published.calibration_set(), apart from the validation runs). Per-operation times
scale with the work: a GEMM by its shape (tile and wave quantization, roofline), a collective
by its bytes (latency + bytes / bus bandwidth), a streaming kernel by the bytes it moves.

H100 / H200 rows carry their datasheet figures and the A100's measured fractions (GEMM of
peak, NCCL bus bandwidth of line rate) until a GPU measures them: `python -m
megajax.launch.bench gpu` is the place (issue: GPU bring-up).
"""

from __future__ import annotations

import dataclasses
import math

from megajax import flops

GB = 1e9

# GEMM: the best measured A100 SXM bf16 matmul, 271.2 of 312 TFLOP/s (86.9%) at
# m x n x k = 1024 x 10240 x 5120 (S. Bekman, "Machine Learning Engineering", compute/accelerator,
# "maximum achievable matmul FLOPS" table; torch 2.6 / CUDA 12.6). Divided by that shape's own wave
# efficiency (below: 320 tiles in 3 waves of 108, 0.988) it is the fraction a full wave reaches.
MEASURED_GEMM_FRACTION = 271.2 / 312.0
MEASURED_GEMM_SHAPE = (1024, 10240)
# Tile and wave quantization (NVIDIA, "Matrix Multiplication Background User's Guide", sections
# 2.3 and 3: cuBLAS tiles of 256 x 128 outputs, one tile per SM per wave; A100 has 108 SMs, H100
# SXM 132). A GEMM whose tiles leave the last wave part-empty runs at tiles / (waves x SMs).
GEMM_TILE = (256, 128)

# Fused attention (FlashAttention-2, Dao 2023, arXiv 2307.08691, abstract: "reaching 50-73% of the
# theoretical maximum FLOPs/s on A100"): the range's low end for causal forward + backward at head
# dim 128 and 2k tokens (its Fig. 4), FLOPs counted the paper's way (backward 2.5x forward).
FLASH_ATTENTION_FRACTION = 0.50

# NCCL bus bandwidth. Inside a DGX A100 (NVLink 3 through NVSwitch): "~230GB/s" all-reduce busbw
# for 8 GPUs at large sizes (S. Jeaugey, NVIDIA, nccl-tests issue 149; 232.5 GB/s measured in
# nccl issue 1048). Between DGX A100 nodes (8 x 200 Gb/s HDR): "we measure 192GB/s AllReduce
# BusBW" per node (AddyLaddy, NVIDIA, nccl issues 812 / 1576), 24 GB/s per GPU and NIC ("the
# peak for 200G HDR is 24GB/s", nccl issue 412). Latency floor of a small collective: 10.14 us
# (2 x A100 SXM4, nccl issue 583).
A100_NVLINK_BUSBW_GBPS = 230.0
A100_NIC_BUSBW_GBPS = 24.0
COLLECTIVE_LATENCY_S = 10e-6

# Slow machines: "a minor fraction of machines (approximately 0.5%) exhibit substantially slower
# performance during training ... The training efficiency is predominantly determined by the
# slowest machine's performance" (MegaScale, NSDI '24, section 5.1, its performance heat map;
# section 6.3: such hosts took "approximately 10% more time" for the same forward computation).
# A synchronous step waits for its slowest machine, so the chance that a job holds one grows with
# its machines: 1 - (1 - 0.005)^nodes, and the step is then that machine's 10% longer (the
# measured figure, taken for the whole step: the slowest stage sets a pipeline's pace). Not
# fitted (2026-12-06; it was fitted on Narayanan et al.'s Table 2 before, 8.1%: NVIDIA's cluster,
# whose slow machines no source counts, carrying ByteDance's fraction). Not reconciled: the same
# section 6.3 saw "an approximate 0.7% improvement in MFU" once such hosts were removed from a
# production job of more than 10,000 GPUs, where this term charges ~10% of the step; that job's
# setup and what else changed are not given, the per-host measurement is direct.
SLOW_MACHINE_FRACTION = 0.005
SLOW_MACHINE_SLOWDOWN = 0.10

# Compute under a hidden collective is not free: "overlapping computation and communication can
# result in an average computational slowdown of 18.9%, with a maximum of 40.0%" against the same
# compute alone (Lee et al. 2025, Characterizing Compute-Communication Overlap in GPU-Accelerated
# Distributed Deep Learning, arXiv 2507.03114, abstract; A100 and H100, GPT and LLaMA models):
# the NCCL kernels hold SMs and HBM bandwidth. Every hidden collective costs this share of its time.
OVERLAP_SLOWDOWN = 0.189


@dataclasses.dataclass(frozen=True)
class Hardware:
  name: str
  peak_tflops: float        # bf16 dense tensor-core peak per GPU (datasheet)
  memory_gb: float          # HBM per GPU (datasheet)
  hbm_gbps: float           # HBM bandwidth per GPU, GB/s (datasheet)
  nvlink_busbw_gbps: float  # NCCL bus bandwidth inside a node, GB/s (measured, above)
  nic_busbw_gbps: float     # NCCL bus bandwidth between nodes per GPU, GB/s (measured, above)
  gpus_per_node: int
  sms: int                  # streaming multiprocessors (tile waves)


# H100 / H200 SXM: NVLink 4 is 450 GB/s per direction (A100: 300), NICs 8 x 400 Gb/s (A100: 200):
# the A100's measured busbw scaled by the line rates (not measured on them: see the docstring).
HARDWARE = {
    "a100-80g": Hardware("a100-80g", flops.PEAK_BF16_TFLOPS["a100"], 80.0, 2039.0, A100_NVLINK_BUSBW_GBPS,
                         A100_NIC_BUSBW_GBPS, 8, 108),
    "h100-80g": Hardware("h100-80g", flops.PEAK_BF16_TFLOPS["h100"], 80.0, 3350.0, A100_NVLINK_BUSBW_GBPS * 1.5,
                         A100_NIC_BUSBW_GBPS * 2, 8, 132),
    "h200-141g": Hardware("h200-141g", flops.PEAK_BF16_TFLOPS["h200"], 141.0, 4800.0, A100_NVLINK_BUSBW_GBPS * 1.5,
                          A100_NIC_BUSBW_GBPS * 2, 8, 132),
}

# Rows whose step times no run on that device measured or validated: what megajax-plan says
# beside every figure it prints for them.
EXTRAPOLATED = {name: ("extrapolated, not measured: datasheet peak, HBM and link rates with the A100's measured GEMM "
                       "fraction and NCCL bus bandwidth per line rate (hardware.py); no published run on it validates "
                       "the model") for name in ("h100-80g", "h200-141g")}


def wave_efficiency(m: int, n: int, sms: int, batch: int = 1) -> float:
  """Busy share of the SMs over a GEMM's waves: `batch` GEMMs of m x n outputs in GEMM_TILE tiles."""
  tiles = batch * math.ceil(m / GEMM_TILE[0]) * math.ceil(n / GEMM_TILE[1])
  return tiles / (math.ceil(tiles / sms) * sms)


# The fraction of peak a GEMM of full waves reaches: the measured one over its shape's wave
# efficiency on the A100 it was measured on (applied to every device until a GPU measures its own).
FULL_WAVE_GEMM_FRACTION = MEASURED_GEMM_FRACTION / wave_efficiency(*MEASURED_GEMM_SHAPE, HARDWARE["a100-80g"].sms)


def gemm_seconds(m: int, n: int, k: int, hw: Hardware, hbm_efficiency: float, batch: int = 1,
                 itemsize: int = 2, sustained: float = 1.0) -> float:
  """`batch` GEMMs [m, k] x [k, n]: tensor-core time at the shape's wave efficiency (times the
  share of the micro-benchmark's rate a run `sustained`), or the time to move its operands and
  result through HBM when that is longer (the roofline)."""
  rate = hw.peak_tflops * 1e12 * FULL_WAVE_GEMM_FRACTION * sustained * wave_efficiency(m, n, hw.sms, batch)
  compute = batch * 2 * m * n * k / rate
  return max(compute, streaming_seconds(batch * (m * k + k * n + m * n) * itemsize, hw, hbm_efficiency))


def streaming_seconds(nbytes: float, hw: Hardware, hbm_efficiency: float) -> float:
  """A memory-bound kernel (norm, activation, dropout, optimizer) that moves `nbytes` through HBM."""
  return nbytes / (hw.hbm_gbps * GB * hbm_efficiency)


def collective_seconds(nbytes: float, group: int, busbw_gbps: float, kind: str = "all_gather") -> float:
  """One NCCL ring collective over `group` GPUs of a `nbytes` tensor (the full, gathered one):
  all-gather / reduce-scatter move (n-1)/n of it per GPU, all-reduce twice that (nccl-tests'
  bus-bandwidth convention), after the latency floor."""
  if group <= 1:
    return 0.0
  factor = 2 if kind == "all_reduce" else 1
  return COLLECTIVE_LATENCY_S + factor * (group - 1) / group * nbytes / (busbw_gbps * GB)


def overlapped_seconds(seconds: float, exposed: float) -> float:
  """What a collective of `seconds` costs the step when all but `exposed` of it runs under compute:
  the exposed part, and the compute it slows while hidden (OVERLAP_SLOWDOWN)."""
  return exposed + OVERLAP_SLOWDOWN * max(0.0, seconds - exposed)


def nodes(gpus: int, hw: Hardware) -> int:
  """The machines a job on `gpus` GPUs occupies."""
  return math.ceil(gpus / hw.gpus_per_node)


def slow_machine_chance(gpus: int, hw: Hardware) -> float:
  """The chance that a job on `gpus` GPUs holds at least one slow machine."""
  return 1.0 - (1.0 - SLOW_MACHINE_FRACTION) ** nodes(gpus, hw)


def link_busbw(group_span: int, hw: Hardware) -> float:
  """The bus bandwidth of a collective whose group spans `group_span` GPUs of consecutive ranks:
  NVLink when they sit in one node, the NICs otherwise."""
  return hw.nvlink_busbw_gbps if group_span <= hw.gpus_per_node else hw.nic_busbw_gbps
