"""Where a training step's device time goes: one row of the MFU suite traced with
jax.profiler, its GPU kernels summed by kind and by HLO op (the gpu check's `profile` part).

Kinds, from the kernel names XLA:GPU and the libraries give them: matmul (cuBLAS / cuBLASLt /
CUTLASS / nvjet GEMMs), attention (cuDNN's fused attention; our Pallas kernels, which XLA
names after the custom call), triton (XLA's Triton fusions), fusion (XLA's other fused
elementwise / reduction kernels), communication (NCCL), copy (memcpy / memset).
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import shutil
import tempfile

import jax

from megajax.launch.bench.train import CompiledStep

KINDS = (("communication", r"nccl"), ("copy", r"memcpy|memset"),
         ("attention", r"cudnn|fmha|flash|attention|_forward_kernel|_dq_kernel|_dkdv_kernel|mosaic"),
         ("matmul", r"gemm|cublas|cutlass|nvjet|sm90_xmma|wgmma"), ("triton", r"triton"), ("fusion", r"."))


def kind_of(kernel: str) -> str:
  name = kernel.lower()
  return next(kind for kind, pattern in KINDS if re.search(pattern, name))


def device_events(trace_file: str) -> list[dict]:
  """The complete ('X') events on the GPU tracks ("/device:GPU:N") of a perfetto trace."""
  with gzip.open(trace_file) as f:
    events = json.load(f)["traceEvents"]
  gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
              and re.search(r"/device:GPU:\d+", e["args"]["name"])}
  return [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu_pids and "dur" in e]


def summarize(events: list[dict], steps: int) -> dict:
  """Milliseconds per step by kind and by the 25 costliest HLO ops (kernel names as fallback)."""
  by_kind, by_op = collections.Counter(), collections.Counter()
  for e in events:
    ms = e["dur"] / 1e3 / steps
    by_kind[kind_of(e["name"])] += ms
    by_op[(e.get("args") or {}).get("hlo_op") or e["name"][:80], kind_of(e["name"])] += ms
  total = sum(by_kind.values())
  return {"busy_ms_per_step": total, "by_kind": dict(by_kind.most_common()),
          "top_ops": [{"op": op, "kind": kind, "ms": ms} for (op, kind), ms in by_op.most_common(25)]}


def profile_step(config, steps: int, keep_trace: str | None = None) -> dict:
  """Traces `steps` steps of the config's compiled step on one device (after two untraced)."""
  step = CompiledStep(config, jax.devices()[:1])
  step.run(), step.run()
  trace_dir = tempfile.mkdtemp(prefix="megajax-profile-")
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    for _ in range(steps):
      step.run()
  files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
  if not files:
    raise FileNotFoundError(f"jax.profiler wrote no *.trace.json.gz under {trace_dir}")
  if keep_trace:
    shutil.copy(files[0], keep_trace)
  return summarize(device_events(files[0]), steps)


def table(summary: dict) -> list[str]:
  busy = summary["busy_ms_per_step"]
  lines = [f"GPU busy {busy:.1f} ms per step; by kind:"]
  lines += [f"  {kind:14}{ms:10.2f} ms {100 * ms / busy:6.1f}%" for kind, ms in summary["by_kind"].items()]
  lines.append("costliest ops:")
  lines += [f"  {r['ms']:9.2f} ms {100 * r['ms'] / busy:5.1f}% {r['kind']:13} {r['op']}" for r in summary["top_ops"]]
  return lines
