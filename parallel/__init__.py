"""Parallelism over the (dp, pp, tp) mesh: the mesh, tensor + sequence parallel layers,
collective matmul, ZeRO sharding, the one-shard_map training step and pipeline schedules."""

from megajax.parallel.collective_matmul import (OVERLAP_MODES, all_gather_matmul, column_parallel_linear,
                                                matmul_reduce_scatter, row_parallel_linear)
from megajax.parallel.mesh import (DP, MESH_AXES, PP, TP, batch_sharding, local_batch_slice, make_mesh,
                                   mesh_shape)
from megajax.parallel.schedule import SCHEDULES, TRAVERSALS, simulate
from megajax.parallel.sharding import Layout, param_layouts
from megajax.parallel.step import ParallelPlan
from megajax.parallel.tensor_parallel import Overlap, loss_sums

__all__ = [
    "DP", "Layout", "MESH_AXES", "OVERLAP_MODES", "Overlap", "PP", "ParallelPlan", "SCHEDULES", "TP",
    "TRAVERSALS", "all_gather_matmul",
    "batch_sharding", "column_parallel_linear", "local_batch_slice", "loss_sums", "make_mesh",
    "matmul_reduce_scatter", "mesh_shape", "param_layouts", "row_parallel_linear", "simulate",
]
