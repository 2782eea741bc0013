"""The runtime: parallelism over the (dp, pp, tp) mesh, and the planner that chooses a mesh.

  mesh.py               the (dp, pp, tp) mesh and the axis names every spec and collective uses
  sharding.py           each parameter's layout (tp, then ZeRO's dp split); whole-tensor norms
  zero.py               ZeRO inside the step: the parameters' all-gathers, the gradients' reduce-scatters
  fused.py              a block's fused matmul operands: the compute form its forward reads a layer in
  collective_matmul.py  the parallel linears, with the collective fused into the matmul
  tensor_parallel.py    the model's forward pass on one device's shards (what trains)
  context_parallel.py   attention over positions split across devices (cp): halo exchange for
                        sliding-window layers, ring attention for global ones (not yet in the step)
  pipeline/             pipeline schedules, the stacked layout, the tick executor, the baseline
  step.py               ParallelStep: the one jitted shard_map training step
  fbd.py                MegaFBD: the forward and the backward on separate device groups (FbdStep)
  planner/              the cost model, its calibration and the 3D-parallelism search
  deviceless.py         XLA's GPU compiler for described H100s / H200s, on a machine without one
"""

from megajax.parallel.collective_matmul import (all_gather_matmul, column_parallel_linear, matmul_reduce_scatter,
                                                row_parallel_linear)
from megajax.parallel.context_parallel import (dual_chunk_halo_attention, dual_chunk_order, halo_attention,
                                               ring_attention)
from megajax.parallel.fbd import FbdStep
from megajax.parallel.mesh import (CP, DP, MESH_AXES, PP, TP, batch_sharding, local_batch_slice,
                                   local_device_coordinates, make_mesh)
from megajax.parallel.pipeline import Tables, pipeline_gradients, simulate, to_model_params, to_pipeline_params
from megajax.parallel.sharding import Layout, param_layouts
from megajax.parallel.step import ParallelStep
from megajax.parallel.tensor_parallel import Overlap, loss_sums

__all__ = [
    "CP", "DP", "FbdStep", "Layout", "MESH_AXES", "Overlap", "PP", "ParallelStep", "TP", "Tables", "all_gather_matmul",
    "batch_sharding", "column_parallel_linear", "dual_chunk_halo_attention", "dual_chunk_order", "halo_attention", "local_batch_slice",
    "local_device_coordinates", "loss_sums", "make_mesh", "matmul_reduce_scatter", "param_layouts", "pipeline_gradients",
    "ring_attention", "row_parallel_linear", "simulate", "to_model_params", "to_pipeline_params",
]
