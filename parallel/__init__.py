"""Parallelism over the (dp, pp, tp) mesh: the mesh, tensor + sequence parallel layers,
collective matmul, ZeRO sharding, pipeline schedules and their executor, and the
one-shard_map training step."""

from megajax.parallel.collective_matmul import (OVERLAP_MODES, all_gather_matmul, column_parallel_linear,
                                                matmul_reduce_scatter, row_parallel_linear)
from megajax.parallel.mesh import (DP, MESH_AXES, PP, TP, batch_sharding, local_batch_slice,
                                   local_device_coordinates, make_mesh,
                                   mesh_shape)
from megajax.parallel.pipeline import Tables, pipeline_gradients, to_model_params, to_pipeline_params
from megajax.parallel.schedule import SCHEDULES, TRAVERSALS, paired_timeline, simulate
from megajax.parallel.sharding import Layout, param_layouts
from megajax.parallel.step import ParallelPlan
from megajax.parallel.tensor_parallel import Overlap, loss_sums

__all__ = [
    "DP", "Layout", "MESH_AXES", "OVERLAP_MODES", "Overlap", "PP", "ParallelPlan", "SCHEDULES", "TP",
    "TRAVERSALS", "Tables", "all_gather_matmul",
    "batch_sharding", "column_parallel_linear", "local_batch_slice", "local_device_coordinates", "loss_sums",
    "make_mesh",
    "matmul_reduce_scatter", "mesh_shape", "paired_timeline", "param_layouts", "pipeline_gradients",
    "row_parallel_linear", "simulate", "to_model_params", "to_pipeline_params",
]
