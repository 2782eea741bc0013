"""Mesh axis names, shared by every sharding spec and collective in megajax.

The mesh is (dp, pp, tp) with tp innermost so a tensor-parallel group stays on one host.
"""

DP = "dp"  # data parallel (ZeRO-2 shards optimizer state and gradients along it)
PP = "pp"  # pipeline stages
TP = "tp"  # tensor + sequence parallel
MESH_AXES = (DP, PP, TP)


def mesh_shape(config) -> tuple[int, int, int]:
  """The (dp, pp, tp) sizes a config asks for."""
  return (config.parallel.dp, config.parallel.pp, config.parallel.tp)
