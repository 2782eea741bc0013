"""Reading a scheduled module: what runs while each asynchronous collective is in flight, and
what a loop copies.

The text is a compiled program's `as_text()` after XLA's scheduler (`is_scheduled=true`: each
computation's instructions are printed in the order they run; on a GPU, XLA's latency-hiding
scheduler). A collective is asynchronous when it is a `<kind>-start` / `<kind>-done` pair (or
an `async-start` wrapping one); it overlaps compute when a kernel (a fusion, a custom call such
as a GEMM or a Pallas kernel, a dot or convolution, or a loop, conditional or call holding them)
is scheduled between its start and its done. A start whose done sits in another iteration of a
loop (XLA's collective pipeliner) counts as overlapped: the loop's body runs in between.
"""

from __future__ import annotations

import collections
import dataclasses
import re

from megajax.observe.hlo import (computation_runs, computations, mesh_groups, permute_groups, replica_groups,
                                 result_bytes)

COLLECTIVE_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")
# Instructions that run a kernel (or computations holding kernels) on the device.
COMPUTE_OPCODES = frozenset({"fusion", "custom-call", "dot", "convolution", "while", "conditional", "call"})

# "%name = <type> opcode(operands), attributes": the type may be a tuple holding "=" in its
# element comments, so the opcode is the last word before the first "(" after " = ".
_INSTRUCTION = re.compile(r"\s*(?:ROOT )?%?([\w.-]+) = (.*?) ([a-z][a-z0-9-]*)\((.*)$")


@dataclasses.dataclass(frozen=True)
class Instruction:
  name: str
  result_type: str
  opcode: str
  rest: str             # operands, then attributes

  @property
  def operands(self) -> list[str]:
    return re.findall(r"%([\w.-]+)", self.rest.split(")", 1)[0])


@dataclasses.dataclass(frozen=True)
class AsyncCollective:
  kind: str                     # all-gather, reduce-scatter, all-reduce, collective-permute, all-to-all
  computation: str
  start: Instruction
  compute_between: int          # kernels scheduled between start and done (-1: done in a later iteration)
  axis: str = "other"           # the mesh axis its groups are, when a mesh is given

  @property
  def overlapped(self) -> bool:
    return self.compute_between != 0


def scheduled_instructions(text: str) -> dict[str, list[Instruction]]:
  """computation name -> its instructions in schedule order."""
  found = {}
  for name, body in computations(text).items():
    found[name] = [Instruction(*m.groups()) for m in map(_INSTRUCTION.match, body.splitlines()) if m]
  return found


def _wrapped_kind(start: Instruction, bodies: dict) -> str | None:
  """The collective an `async-start` wraps (its called computation's), if any."""
  called = re.search(r"calls=%([\w.-]+)", start.rest)
  for instruction in bodies.get(called.group(1), ()) if called else ():
    if instruction.opcode in COLLECTIVE_KINDS:
      return instruction.opcode
  return None


def _axis(instruction: Instruction, mesh) -> str:
  if mesh is None:
    return "other"
  line = f"{instruction.opcode}({instruction.rest}"
  groups = replica_groups(line) or permute_groups(line, mesh)
  axes = {frozenset(map(frozenset, mesh_groups(mesh, a))): a for a in mesh.axis_names if mesh.shape[a] > 1}
  return axes.get(frozenset(groups), "other") if groups else "other"


def async_collectives(text: str, mesh=None) -> list[AsyncCollective]:
  """Every asynchronous collective of a scheduled module, with the kernels run while it is in
  flight; `mesh` (the step's) names the axis of each."""
  bodies = scheduled_instructions(text)
  found = []
  for computation, instructions in bodies.items():
    for i, start in enumerate(instructions):
      kind = start.opcode[:-len("-start")] if start.opcode.endswith("-start") else None
      if start.opcode == "async-start":
        kind = _wrapped_kind(start, bodies)
      if kind not in COLLECTIVE_KINDS:
        continue
      dones = [j for j, later in enumerate(instructions)
               if later.opcode.endswith("-done") and start.name in later.operands]
      if dones:
        between = sum(instr.opcode in COMPUTE_OPCODES for instr in instructions[i + 1:dones[0]])
      else:   # its done is reached through the loop's carried tuple: a later iteration's
        between = -1
      found.append(AsyncCollective(kind, computation, start, between, _axis(start, mesh)))
  return found


def overlap_counts(text: str, mesh=None) -> dict[tuple[str, str], tuple[int, int]]:
  """(kind, axis) -> (asynchronous collectives overlapping compute, all of them) in the module;
  collectives the scheduler left synchronous (a plain `all-gather(`) count in the total."""
  counts = collections.defaultdict(lambda: [0, 0])
  for collective in async_collectives(text, mesh):
    entry = counts[(collective.kind, collective.axis)]
    entry[0] += collective.overlapped
    entry[1] += 1
  for instruction in synchronous_collectives(text):
    counts[(instruction.opcode, _axis(instruction, mesh))][1] += 1
  return {key: tuple(value) for key, value in counts.items()}


def synchronous_collectives(text: str) -> list[Instruction]:
  """The collectives the scheduler left blocking (a plain `all-gather(`), outside the
  computations an `async-start` wraps (those are counted by their start)."""
  bodies = scheduled_instructions(text)
  wrapped = {called.group(1) for instructions in bodies.values() for instruction in instructions
             if instruction.opcode == "async-start" for called in [re.search(r"calls=%([\w.-]+)", instruction.rest)]
             if called}
  return [instruction for name, instructions in bodies.items() if name not in wrapped
          for instruction in instructions if instruction.opcode in COLLECTIVE_KINDS]


def loop_copies(text: str) -> list[tuple[str, int, str]]:
  """(computation, bytes, result type) of every `copy` run inside a while loop's body (or a
  computation it calls): what a loop moves each iteration beyond its kernels' own writes."""
  runs = computation_runs(text)
  inside = _loop_computations(text)
  found = []
  for computation, instructions in scheduled_instructions(text).items():
    if computation not in inside or not runs.get(computation):
      continue
    for instruction in instructions:
      if instruction.opcode == "copy" or (instruction.opcode == "fusion" and _is_copy_fusion(instruction)):
        found.append((computation, result_bytes(instruction.result_type), instruction.result_type))
  return found


def _is_copy_fusion(instruction: Instruction) -> bool:
  return re.search(r"calls=%(?:wrapped_)?copy", instruction.rest) is not None or instruction.name.startswith("copy")


def _loop_computations(text: str) -> set[str]:
  """The computations that run inside some while loop: its bodies and everything they call."""
  calls = collections.defaultdict(set)
  bodies = set()
  for name, body in computations(text).items():
    for kind, callee in re.findall(r"(body|condition|calls|to_apply|true_computation|false_computation)=%([\w.-]+)",
                                   body):
      calls[name].add(callee)
      if kind == "body":
        bodies.add(callee)
    for branches in re.findall(r"branch_computations=\{([^}]*)\}", body):
      calls[name].update(re.findall(r"%([\w.-]+)", branches))
  inside, stack = set(), list(bodies)
  while stack:
    name = stack.pop()
    if name not in inside:
      inside.add(name)
      stack.extend(calls[name])
  return inside
