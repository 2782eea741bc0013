"""Sampled step traces (MegaScale 5.1, MegaScan): every `observe.trace_every` steps each process
records one step with jax.profiler into WORKDIR/traces/step_<n>/process_<i>/.

Beside the profiler's Chrome-format trace each process writes `trace_meta.json`: its devices'
(dp, pp, cp, tp) coordinates and, for every operation of the compiled step, what it is (forward,
backward, optimizer, or a collective with its mesh axis), read from the named scopes the
step's code runs under ("forward", "optimizer", "dp all-gather", "tp reduce-scatter",
"pp send-recv", ...; the backward is the forward's transpose). `megajax-trace` merges the
processes' traces on one clock and finds stragglers (megajax.observe.trace_analysis).

The always-on part costs nothing at run time: named scopes are compile-time metadata.
"""

from __future__ import annotations

import json
import os
import re

import jax

from megajax.parallel.mesh import MESH_AXES, local_device_coordinates

TRACES = "traces"
META = "trace_meta.json"
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")

# An HLO instruction line: "%name = type opcode(operands), ..., metadata={op_name="..." ...}"
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([a-z][a-z\-]*)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def classify(opcode: str, op_name: str) -> tuple[str, str]:
  """(category, kind) of one operation: category in forward / backward / optimizer /
  communication / other; kind names a collective by its mesh axis, e.g. "dp reduce-scatter"."""
  base = opcode.removesuffix("-start").removesuffix("-done")
  if base in COLLECTIVES:
    # The innermost scope that names an axis ("tp all-gather", "pp send-recv", ...); the
    # opcode says what the collective does (a backward of an all-gather is a reduce-scatter).
    axis = next((part.split()[0] for part in reversed(op_name.split("/"))
                 if part.split() and part.split()[0] in MESH_AXES), None)
    return "communication", f"{axis} {base}" if axis else base
  if "transpose(" in op_name:
    return "backward", "backward"
  if "optimizer" in op_name.split("/"):
    return "optimizer", "optimizer"
  if "forward" in op_name:
    return "forward", "forward"
  return "other", "other"


def operations(hlo_text: str) -> dict[str, dict]:
  """Every instruction of an HLO module's text -> {"opcode", "category", "kind"}."""
  ops = {}
  for line in hlo_text.splitlines():
    match = _INSTRUCTION.match(line)
    if not match:
      continue
    name, opcode = match.groups()
    op_name = _OP_NAME.search(line)
    category, kind = classify(opcode, op_name.group(1) if op_name else "")
    ops[name] = {"opcode": opcode, "category": category, "kind": kind}
  return ops


def module_name(hlo_text: str) -> str:
  match = re.match(r"HloModule\s+([\w.\-]+)", hlo_text)
  return match.group(1) if match else ""


class StepTracer:
  """Decides which steps to trace and records them (one step, every process)."""

  def __init__(self, observe, mesh, workdir: str | None):
    self.every = observe.trace_every if workdir else 0
    self.root = os.path.join(workdir, TRACES) if workdir else None
    self.mesh = mesh
    self.meta = None                 # what trace_meta.json says, built from the compiled step once
    self.active = None

  def wants(self, step: int) -> bool:
    return bool(self.every) and step % self.every == 0

  def describe(self, compiled) -> None:
    """The compiled step's operations and this process's devices (for trace_meta.json)."""
    text = compiled.as_text()
    self.meta = {"process": jax.process_index(), "module": module_name(text),
                 # Trace events name a device by its id (CPU: args.device_ordinal) or its local
                 # ordinal (GPU: the "/device:GPU:<ordinal>" track).
                 "devices": [{"ordinal": i, **d} for i, d in enumerate(local_device_coordinates(self.mesh))],
                 "ops": operations(text)}

  def start(self, step: int) -> None:
    path = os.path.join(self.root, f"step_{step}", f"process_{jax.process_index()}")
    os.makedirs(path, exist_ok=True)
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0      # device and runtime events only: smaller, cheaper
    jax.profiler.start_trace(path, create_perfetto_trace=True, profiler_options=options)
    self.active = (step, path)

  def stop(self) -> str:
    step, path = self.active
    jax.profiler.stop_trace()
    with open(os.path.join(path, META), "w") as f:
      json.dump({**self.meta, "step": step}, f)
    self.active = None
    return path
