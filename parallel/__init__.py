"""Parallelism over the (dp, pp, tp) mesh. Today: the axis names every later piece shares."""

from megajax.parallel.mesh import DP, MESH_AXES, PP, TP, mesh_shape

__all__ = ["DP", "MESH_AXES", "PP", "TP", "mesh_shape"]
