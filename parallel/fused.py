"""A block's fused matmul operands: the kernels its sharded forward multiplies as one matrix.

MegaScale's fused operators: the parallel block multiplies N(x) by its [Q|K|V|MLP-in]
kernels side by side in one column-parallel matmul, and its attention and MLP activations
by the two output kernels stacked in one row-parallel matmul (megajax.parallel.tensor_parallel).
These operands are not parameters (the model's pytree keeps one leaf per kernel:
megajax.model) but the form the forward reads a layer in, its compute form: the layer's
parameters with each operand under its own key (OPERANDS) and its member kernels removed
from their modules (biases and norms stay where they are).

  columns  [hidden, features]: the members [hidden, ...] side by side, in order;
  rows     [groups, rows / groups, hidden]: each member [..., hidden] cut into `groups`
           blocks of rows, block g of every member (in order) in block g of the operand.

ZeRO splits each member over dp on its first dimension (megajax.parallel.sharding): then one
all-gather of every device's members packed side by side (pack) is the columns operand, and
one of them packed on top of each other is the rows operand with groups = dp. The gathered
buffer is the operand, no copy made; its gradient is reduce-scattered as it is and unpacked
into the members' shards. The activations that multiply a rows operand are laid out like its
rows (interleave); groups = 1 is the plain stack of the members.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from megajax.layers import BLOCK_FAMILIES, MLP_FAMILIES, families
from megajax.model import ModelConfig


@dataclasses.dataclass(frozen=True)
class Operand:
  """One fused matmul operand of a block: its key in the compute form, whether it stacks its
  members' rows (a row-parallel matmul) or puts their columns side by side, and the members:
  (module, linear) of each kernel, e.g. ("attention", "query")."""
  name: str
  rows: bool
  members: tuple[tuple[str, str], ...]


def _members(group: str, c: ModelConfig) -> tuple[tuple[str, str], ...]:
  """The (module, linear) kernels of one of families' member groups (the MLP's inputs by c.mlp)."""
  return {families.QKV: (("attention", "query"), ("attention", "key"), ("attention", "value")),
          families.MLP_IN: tuple(("mlp", name) for name in MLP_FAMILIES[c.mlp].inputs),
          families.ATTENTION_OUT: (("attention", "out"),), families.MLP_OUT: (("mlp", "wo"),)}[group]


def operands(c: ModelConfig) -> dict[str, Operand]:
  """The fused operands of c.block's layers (families.BLOCK_FAMILIES), by name, in the order
  the forward uses them."""
  return {name: Operand(name, rows, sum((_members(group, c) for group in groups), ()))
          for name, rows, groups in BLOCK_FAMILIES[c.block].operands}


def member_widths(operand: Operand, c: ModelConfig, tp: int) -> list[int]:
  """Each member's features (columns) or rows in the operand on one of `tp` ranks: heads x
  head_dim for the attention's linears, the mlp units for the MLP's."""
  per_module = {"query": c.num_heads, "out": c.num_heads, "key": c.num_kv_heads, "value": c.num_kv_heads}
  return [per_module[linear] * c.head_dim // tp if module == "attention" else c.mlp_dim // tp
          for module, linear in operand.members]


def kernels(layer: dict, operand: Operand) -> list:
  return [layer[module][linear]["kernel"] for module, linear in operand.members]


def columns(members: list):
  """[hidden, ...] each -> [hidden, features]."""
  return jnp.concatenate([k.reshape(k.shape[0], -1) for k in members], axis=1)


def rows(members: list, groups: int):
  """[..., hidden] each -> [groups, rows / groups, hidden]."""
  return jnp.concatenate([k.reshape(groups, -1, k.shape[-1]) for k in members], axis=1)


def interleave(parts: list, groups: int):
  """Activations [b, s, rows of member m] -> [b, s, rows], laid out as `rows(members, groups)`
  lays out the kernels they multiply (one concatenation, as the plain stack would be)."""
  b, s = parts[0].shape[:2]
  return jnp.concatenate([p.reshape(b, s, groups, -1) for p in parts], axis=-1).reshape(b, s, -1)


def to_compute_form(layer: dict, c: ModelConfig, whole: dict | None = None, groups: dict | None = None) -> dict:
  """A layer's parameters (the model's pytree) -> its compute form: the member kernels
  removed, each operand added, from `whole` (name -> the operand, e.g. as ZeRO gathered it)
  or else from the members (a copy: once per step, not per microbatch), with groups[name]
  (default 1) for a rows operand. Dtypes are the members'; the forward casts."""
  whole, groups = whole or {}, groups or {}
  found = operands(c)
  out = {name: dict(module) if isinstance(module, dict) else module for name, module in layer.items()}
  for operand in found.values():
    for module, linear in operand.members:
      out[module][linear] = {k: v for k, v in layer[module][linear].items() if k != "kernel"}
  for name, operand in found.items():
    if name in whole:
      out[name] = whole[name]
    else:
      members = kernels(layer, operand)
      out[name] = rows(members, groups.get(name, 1)) if operand.rows else columns(members)
  return out


def from_compute_form(form: dict, like: dict, c: ModelConfig) -> dict:
  """to_compute_form's transpose (groups = 1): a layer's compute form -> its parameters, each
  operand cut into its members, shaped like `like`'s kernels (the layer's parameters or
  their shapes). What the gradients w.r.t. a compute form go through to become the layer's."""
  found = operands(c)
  out = {name: dict(module) if isinstance(module, dict) else module
         for name, module in form.items() if name not in found}
  for name, operand in found.items():
    for (module, linear), member in zip(operand.members, unpack(operand, form[name], kernels(like, operand))):
      out[module][linear] = {**out[module][linear], "kernel": member}
  return out


def pack(operand: Operand, shards: list):
  """The members' dp shards (each split on its first dimension) -> what one device adds to the
  operand's all-gather: [hidden / dp, features] side by side, or [rows / dp, hidden] stacked."""
  if operand.rows:
    return jnp.concatenate([s.reshape(-1, s.shape[-1]) for s in shards], axis=0)
  return jnp.concatenate([s.reshape(s.shape[0], -1) for s in shards], axis=1)


def unpack(operand: Operand, packed, like: list) -> list:
  """pack's inverse: a packed buffer (or a whole operand of groups = 1, as [hidden, features]
  or [rows, hidden]) -> the members, shaped like `like`."""
  if operand.rows:
    packed = packed.reshape(-1, packed.shape[-1])
    sizes, axis = [x.size // x.shape[-1] for x in like], 0
  else:
    sizes, axis = [x.size // x.shape[0] for x in like], 1
  offsets = [sum(sizes[:i]) for i in range(1, len(sizes))]
  return [piece.reshape(x.shape) for piece, x in zip(jnp.split(packed, offsets, axis=axis), like)]
