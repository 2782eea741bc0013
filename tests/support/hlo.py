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


def collective_counts(text: str, mesh) -> collections.Counter:
  """(op, axis, phase) -> count; phase is forward / backward from the ops' jvp metadata."""
  axes = {frozenset(map(frozenset, mesh_groups(mesh, a))): a for a in mesh.axis_names if mesh.shape[a] > 1}
  counts = collections.Counter()
  for line in text.splitlines():
    op = re.search(r"= [^=]*? (all-gather|reduce-scatter|all-reduce|collective-permute)(?:-start)?\(", line)
    if not op:
      continue
    phase = "backward" if "transpose(" in line else "forward" if "jvp(" in line else "other"
    groups = replica_groups(line) or permute_groups(line, mesh)
    axis = axes.get(frozenset(groups), "other") if groups else "other"
    counts[op.group(1), axis, phase] += 1
  return counts


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
