"""Pipeline parallelism inside the one shard_map step.

  schedule.py  which (forward | backward, microbatch, chunk) each stage runs, tick by tick:
               gpipe, 1f1b, interleaved_1f1b; depth- or breadth-first traversal; pure Python
  stacking.py  the parameter layout: the blocks stacked into one `layers` tree split over pp
  tables.py    a schedule compiled into the int32 tables the executor reads each tick
  executor.py  the tick scan (head, steady, tail): decoupled send / recv rings, dp pieces
  slots.py     a chunk program's forward and backward branch of a tick's slots, and the
               gradients a backward slot returns
  residuals.py a chunk's forward split at its vjp residuals: kept ones packed for the
               backward slot, weight-only ones rebuilt there (no forward runs twice)
  baseline.py  GPipe by autodiff, the baseline the executor is measured against
  forward.py   the forward alone (the eval step): loss sums through the stages, no backward
"""

from megajax.parallel.pipeline.executor import pipeline_gradients, stage_params, sum_over_stages
from megajax.parallel.pipeline.forward import pipeline_loss_sums
from megajax.parallel.pipeline.schedule import Schedule, paired_timeline, simulate
from megajax.parallel.pipeline.stacking import (LAYERS, pipeline_layouts, stacked_layer_order, to_model_params,
                                                to_pipeline_params)
from megajax.parallel.pipeline.tables import Program, Tables

__all__ = ["LAYERS", "Program", "Schedule", "Tables", "paired_timeline", "pipeline_gradients", "pipeline_layouts",
           "pipeline_loss_sums",
           "simulate", "stacked_layer_order", "stage_params", "sum_over_stages", "to_model_params",
           "to_pipeline_params"]
