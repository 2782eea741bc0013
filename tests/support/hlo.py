"""Reading the compiled step: which collectives it runs, over which mesh axis, in which phase."""

import collections
import functools
import re

import numpy as np

from tests.support.reference import parallel_step_for, parallel_config


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


COLLECTIVE = re.compile(r"= ([^=]*?) (all-gather|reduce-scatter|all-reduce|collective-permute)(?:-start)?\(")


DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f64": 8, "s8": 1, "u8": 1, "pred": 1}


def result_bytes(result_type: str) -> int:
  """Bytes of an instruction's result type, e.g. "f32[2,8,32]{2,0,1}" or a tuple of them."""
  return sum(DTYPE_BYTES.get(dtype, 0) * int(np.prod([int(d) for d in dims.split(",") if d]))
             for dtype, dims in re.findall(r"([a-z]+[0-9]*)\[([\d,]*)\]", result_type))


def collective_counts(text: str, mesh, executed: bool = False, by_dtype: bool = False,
                      nbytes: bool = False) -> collections.Counter:
  """(op, axis, phase) -> count; phase is forward / backward from the ops' jvp metadata.

  executed=False counts the collectives written in the program (a loop body's once);
  executed=True those one run of it executes: each weighted by how often its computation
  runs (a while body: its known trip count, e.g. the microbatch scan's m). by_dtype=True adds
  the result's element type to the key: (op, axis, phase, dtype). nbytes=True sums the
  results' bytes per device instead of counting."""
  axes = {frozenset(map(frozenset, mesh_groups(mesh, a))): a for a in mesh.axis_names if mesh.shape[a] > 1}
  runs = computation_runs(text) if executed else {}
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


def computation_runs(text: str) -> dict:
  """name -> how many times one run of the module runs each computation reachable from the
  entry: a while body its caller's count times the loop's known trip count; a called,
  conditional-branch or applied computation its caller's count (a branch: at most)."""
  bodies = computations(text)
  calls = {name: [] for name in bodies}
  for name, body in bodies.items():
    for line in body.splitlines():
      trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
      for kind, callee in re.findall(r"(body|condition|calls|to_apply|true_computation|false_computation)=%([\w.-]+)",
                                     line):
        calls[name].append((callee, int(trips.group(1)) if kind == "body" and trips else 1))
      branches = re.search(r"branch_computations=\{([^}]*)\}", line)
      for callee in re.findall(r"%([\w.-]+)", branches.group(1)) if branches else ():
        calls[name].append((callee, 1))
  runs = collections.Counter()

  def visit(name, count):
    runs[name] += count
    for callee, times in calls.get(name, ()):
      visit(callee, count * times)
  visit("ENTRY", 1)
  return runs


@functools.cache
def compiled_step_text(dp, tp, block, mode, layers):
  """(the 3D step, its compiled HLO text) of tests.support.reference's model (cached)."""
  parallel_step = parallel_step_for(parallel_config(dp, tp, block, mode, layers=layers))
  return parallel_step, parallel_step.train_step().lower(*parallel_step.abstract_inputs()).compile().as_text()


def instructions(computation: str) -> dict:
  """name -> (opcode, operand names) of one HLO computation's instructions."""
  found = {}
  for line in computation.splitlines():
    match = re.match(r"\s*(?:ROOT )?%?([\w.-]+) = .*? ([a-z][a-z0-9-]*)\((.*)", line)
    if match:
      found[match.group(1)] = (match.group(2), set(re.findall(r"%([\w.-]+)", match.group(3))))
  return found
