"""Reading a compiled program's HLO text: its collectives (which, over which mesh axis, in which
phase, how many bytes) and the FLOPs its matmuls execute.

The text is `jitted.lower(...).compile().as_text()`. XLA's own `compiled.cost_analysis()` counts
a while loop's body once and a conditional as its most expensive branch, which says nothing
about a scan of microbatches or the pipeline's scan of ticks, each a lax.switch per slot; here
every computation is weighed by how often one run of the program executes it
(`computation_runs`): a while body by its known trip count, a conditional's branches by the
weights given for it (the pipeline's from its tables: `pipeline_branch_weights`).
"""

from __future__ import annotations

import collections
import re

import numpy as np

from megajax.parallel.pipeline.executor import BACKWARD_SLOT, FORWARD_SLOT


def replica_groups(line: str):
  """The replica groups of one HLO collective, as a set of frozensets of device ids."""
  match = re.search(r"replica_groups=\{(\{[\d,{} ]*\})\}", line)
  if match:
    return {frozenset(map(int, g.split(","))) for g in re.findall(r"\{([\d, ]+)\}", match.group(1))}
  match = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
  if match:  # iota form: [groups, size] <= [dims] transposed by perm
    groups, size, dims, perm = match.groups()
    ids = np.arange(int(groups) * int(size)).reshape([int(d) for d in dims.split(",")])
    if perm:
      ids = ids.transpose([int(p) for p in perm.split(",")])
    return {frozenset(row) for row in ids.reshape(int(groups), int(size)).tolist()}
  match = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
  if match:  # mesh form (XLA:GPU after Shardy): mesh['a'=2,'b'=4] {'b'}: groups along the named axes
    axes = re.findall(r"'([^']+)'=(\d+)", match.group(1))
    names, sizes = [name for name, _ in axes], [int(size) for _, size in axes]
    along = [names.index(name) for name in re.findall(r"'([^']+)'", match.group(2))]
    ids = np.arange(int(np.prod(sizes))).reshape(sizes)
    moved = ids.transpose([i for i in range(len(sizes)) if i not in along] + along)
    return {frozenset(row) for row in moved.reshape(-1, int(np.prod([sizes[i] for i in along]))).tolist()}
  return None


def permute_groups(line: str, mesh):
  """A collective-permute's axis, as the groups of that axis if every pair stays inside one."""
  pairs = re.findall(r"\{(\d+),(\d+)\}", line.split("source_target_pairs=", 1)[-1].split("}}", 1)[0] + "}")
  if "source_target_pairs=" not in line or not pairs:
    return None
  for axis in mesh.axis_names:
    groups = mesh_groups(mesh, axis)
    if all(any({int(a), int(b)} <= g for g in groups) for a, b in pairs):
      return groups
  return None


def mesh_groups(mesh, axis):
  """The device-id groups of one mesh axis, in the logical ids the HLO uses."""
  ids = np.arange(mesh.size).reshape(mesh.devices.shape)
  moved = np.moveaxis(ids, mesh.axis_names.index(axis), -1)
  return {frozenset(row) for row in moved.reshape(-1, moved.shape[-1]).tolist()}


# An instruction's result type, then the collective: the type may be a tuple, whose long forms
# number their elements ("/*index=5*/"), so it may hold "=".
COLLECTIVE = re.compile(r"= (.*?) (all-gather|reduce-scatter|all-reduce|collective-permute|all-to-all)(?:-start)?\(")


DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f64": 8, "s8": 1, "u8": 1, "pred": 1}


def result_bytes(result_type: str) -> int:
  """Bytes of an instruction's result type, e.g. "f32[2,8,32]{2,0,1}" or a tuple of them."""
  return sum(DTYPE_BYTES.get(dtype, 0) * int(np.prod([int(d) for d in dims.split(",") if d]))
             for dtype, dims in re.findall(r"([a-z]+[0-9]*)\[([\d,]*)\]", result_type))


def collective_counts(text: str, mesh, executed: bool = False, by_dtype: bool = False,
                      nbytes: bool = False, branch_weights: dict | None = None) -> collections.Counter:
  """(op, axis, phase) -> count; phase is forward / backward from the ops' jvp metadata.

  executed=False counts the collectives written in the program (a loop body's once);
  executed=True those one run of it executes: each weighted by how often its computation
  runs (a while body: its known trip count, e.g. the microbatch scan's m). by_dtype=True adds
  the result's element type to the key: (op, axis, phase, dtype). nbytes=True sums the
  results' bytes per device instead of counting. `branch_weights`: computation_runs' (a
  collective inside the pipeline's slots, e.g. grad_sync="microbatch"'s reduce-scatters)."""
  axes = {frozenset(map(frozenset, mesh_groups(mesh, a))): a for a in mesh.axis_names if mesh.shape[a] > 1}
  runs = computation_runs(text, branch_weights) if executed else {}
  counts = collections.Counter()
  for name, body in computations(text).items():
    for line in body.splitlines():
      op = COLLECTIVE.search(line)
      if not op:
        continue
      phase = "backward" if "transpose(" in line else "forward" if "jvp(" in line else "other"
      groups = replica_groups(line) or permute_groups(line, mesh)
      axis = axes.get(frozenset(groups), "other") if groups else "other"
      key = (op.group(2), axis, phase) + ((re.match(r"\(?([a-z]+[0-9]*)", op.group(1)).group(1),) if by_dtype else ())
      counts[key] += (runs.get(name, 1) if executed else 1) * (result_bytes(op.group(1)) if nbytes else 1)
  return counts


def collectives_by_group_size(text: str, devices: int) -> collections.Counter:
  """(kind, devices per group) -> how many the compiled program holds; a permute's "group" is
  its number of source -> target pairs. A group of 1 moves nothing."""
  counts = collections.Counter()
  for line in text.splitlines():
    op = COLLECTIVE.search(line)
    if not op:
      continue
    if op.group(2) == "collective-permute":
      pairs = line.split("source_target_pairs=", 1)[-1].split("}}", 1)[0]
      counts[(op.group(2), len(re.findall(r"\{\d+,\d+", pairs)))] += 1
    else:
      groups = replica_groups(line)   # None: replica_groups={}, every device in one group
      counts[(op.group(2), len(next(iter(groups))) if groups else devices)] += 1
  return counts


def xla_cost(compiled) -> dict:
  """XLA's cost_analysis of a compiled program, per device: {"flops", "bytes"} (it counts a
  loop body once: executed_dot_flops counts what runs)."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost    # (a list on older jax)
  return {"flops": float(cost.get("flops", float("nan"))), "bytes": float(cost.get("bytes accessed", float("nan")))}


def computations(text: str) -> dict:
  """name -> body text of each computation of an HLO module ("ENTRY" for the entry one)."""
  found, name, lines = {}, None, []
  for line in text.splitlines():
    header = re.match(r"(ENTRY )?%?([\w.-]+) .*\{$", line)
    if header and not line.startswith(" "):
      name, lines = ("ENTRY" if header.group(1) else header.group(2)), []
    elif line == "}" and name is not None:
      found[name], name = "\n".join(lines), None
    elif name is not None:
      lines.append(line)
  return found


def computation_runs(text: str, branch_weights: dict | None = None) -> dict:
  """name -> how many times one run of the module runs each computation reachable from the
  entry: a while body its caller's count times the loop's known trip count; a called or
  applied computation its caller's count.

  A conditional's branch i: its caller's count times `branch_weights[marker][i]`, the mean
  executions of branch i per execution of the conditional, where `marker` is the innermost
  named scope (jax.named_scope) of the conditional's metadata op_name ("…/marker/cond", not a
  conditional nested further inside); otherwise its caller's count (what it runs at most)."""
  bodies = computations(text)
  calls = {name: [] for name in bodies}
  for name, body in bodies.items():
    for line in body.splitlines():
      trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
      for kind, callee in re.findall(r"(body|condition|calls|to_apply)=%([\w.-]+)", line):
        calls[name].append((callee, int(trips.group(1)) if kind == "body" and trips else 1))
      op_name = re.search(r'op_name="([^"]*)"', line)
      weights = next((w for marker, w in (branch_weights or {}).items()
                      if op_name and re.search(re.escape(marker) + r"/[^/]*$", op_name.group(1))), None)
      weight = lambda i: 1 if weights is None else weights[i]
      branches = re.search(r"branch_computations=\{([^}]*)\}", line)
      for i, callee in enumerate(re.findall(r"%([\w.-]+)", branches.group(1)) if branches else ()):
        calls[name].append((callee, weight(i)))
      for kind, callee in re.findall(r"(true_computation|false_computation)=%([\w.-]+)", line):
        calls[name].append((callee, weight(1 if kind == "true_computation" else 0)))
  runs = collections.Counter()

  def visit(name, count):
    runs[name] += count
    for callee, times in calls.get(name, ()):
      visit(callee, count * times)
  visit("ENTRY", 1)
  return runs


def instructions(computation: str) -> dict:
  """name -> (opcode, operand names) of one HLO computation's instructions."""
  found = {}
  for line in computation.splitlines():
    match = re.match(r"\s*(?:ROOT )?%?([\w.-]+) = .*? ([a-z][a-z0-9-]*)\((.*)", line)
    if match:
      found[match.group(1)] = (match.group(2), set(re.findall(r"%([\w.-]+)", match.group(3))))
  return found


_ARRAY = r"[a-z]+[0-9]*\[([\d,]*)\]"
# "%name = f32[128,32]{1,0} dot(%a, %b), ..." (an array result: no spaces in its type).
_DEFINITION = re.compile(rf"\s*(?:ROOT )?%?([\w.-]+) = {_ARRAY}(?:\{{[^}}]*\}})? ([a-z][a-z0-9-]*)\((.*)")


def _dims(text: str) -> list[int]:
  return [int(d) for d in text.split(",") if d]


def _operands(arguments: str, shapes: dict) -> list:
  """The dims of each operand of an instruction (its text after the opcode's parenthesis):
  printed inline ("f32[2,3]{1,0} %a") or, as XLA:CPU prints, the defining instruction's."""
  found = []
  for operand in arguments.split(")", 1)[0].split(","):
    inline = re.match(rf"\s*{_ARRAY}", operand)
    name = re.search(r"%([\w.-]+)", operand)
    found.append(_dims(inline.group(1)) if inline else shapes.get(name.group(1)) if name else None)
  return found


def _matmul_flops(opcode: str, result: list, arguments: str, shapes: dict) -> float:
  """2 x the multiply-adds of one dot or convolution."""
  operands = _operands(arguments, shapes)
  if opcode == "dot":
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", arguments)
    lhs = operands[0]
    if lhs is None:
      raise ValueError(f"dot: no shape for its lhs operand: {arguments[:200]}")
    return 2.0 * np.prod(result) * np.prod([lhs[d] for d in _dims(contracting.group(1))] if contracting else [1])
  # A convolution: every output element takes the kernel's elements of one output feature.
  kernel = operands[1] if len(operands) > 1 else None
  labels = re.search(r"dim_labels=[^_]*_([^-]*)->", arguments)
  if kernel is None or labels is None:
    raise ValueError(f"convolution: no kernel shape or dim_labels: {arguments[:200]}")
  return 2.0 * np.prod(result) * np.prod(kernel) / kernel[labels.group(1).index("o")]


def executed_dot_flops(text: str, branch_weights: dict | None = None) -> float:
  """FLOPs of the matmuls one run of a compiled HLO module executes, per device: every dot
  (2 x its result's elements x its contracting dims) and convolution, times how often its
  computation runs (`computation_runs`, with `branch_weights` for the conditionals)."""
  runs = computation_runs(text, branch_weights)
  total = 0.0
  for name, body in computations(text).items():
    if not runs.get(name):
      continue
    shapes, matmuls = {}, []
    for line in body.splitlines():
      definition = _DEFINITION.match(line)
      if definition:
        result, dims, opcode, arguments = definition.groups()
        shapes[result] = _dims(dims)
        if opcode in ("dot", "convolution"):
          matmuls.append((opcode, _dims(dims), arguments))
    total += runs[name] * sum(_matmul_flops(opcode, dims, arguments, shapes) for opcode, dims, arguments in matmuls)
  return total


RELAYOUT_OPS = ("copy", "transpose", "concatenate")
_FUSION_CALLEE = re.compile(r"\bfusion\(.*?calls=%([\w.-]+)")


def executed_relayout_bytes(text: str, branch_weights: dict | None = None) -> collections.Counter:
  """opcode -> bytes one run of a compiled HLO module writes, per device, by instructions that
  only move data: copy, transpose, concatenate (each unfused, or the root of a fusion: a
  concatenation fused into its consumer writes nothing of its own), times how often its
  computation runs (`computation_runs`). What a program copies that another does not is
  memory traffic neither needs for its FLOPs: a whole buffer copied per loop trip shows here."""
  bodies = computations(text)
  runs = computation_runs(text, branch_weights)
  fused = {callee for body in bodies.values() for callee in _FUSION_CALLEE.findall(body)}
  root_opcode = {}
  for name in fused & set(bodies):
    root = next((line for line in bodies[name].splitlines() if line.lstrip().startswith("ROOT ")), "")
    match = re.match(r"\s*ROOT %?[\w.-]+ = \S+ ([a-z][a-z0-9-]*)\(", root)
    root_opcode[name] = match.group(1) if match else None
  written = collections.Counter()
  for name, body in bodies.items():
    if name in fused or not runs.get(name):
      continue
    for line in body.splitlines():
      match = re.match(r"\s*(?:ROOT )?%?[\w.-]+ = (\S+) ([a-z][a-z0-9-]*)\(", line)
      if not match:
        continue
      result, opcode = match.groups()
      callee = _FUSION_CALLEE.search(line) if opcode == "fusion" else None
      opcode = root_opcode.get(callee.group(1)) if callee else opcode
      if opcode in RELAYOUT_OPS:
        written[opcode] += runs[name] * result_bytes(result)
  return written


def pipeline_branch_weights(tables) -> dict | None:
  """The executor's two per-tick switches (their named scopes) -> the mean number of times a
  tick runs each branch, over the stages (megajax.parallel.pipeline.Tables: branch 0 idles,
  branch i + 1 runs program i). Per-device executed FLOPs with these weights are the mean over
  the stages: times the devices, the whole mesh's. tables=None (no pipeline): None."""
  if tables is None:
    return None
  branches = len(tables.programs) + 1
  def weights(table):
    table = np.asarray(table)
    return [float(np.mean(table == i)) for i in range(branches)]
  return {FORWARD_SLOT: weights(tables.per_stage["f_branch"]), BACKWARD_SLOT: weights(tables.per_stage["b_branch"])}
