"""Reading the compiled step: which collectives it runs, over which mesh axis, in which phase.

The readers live in megajax.observe.hlo (the benchmarks use them too); what needs the tests'
reference model stays here."""

import functools

from megajax.observe.hlo import (COLLECTIVE, DTYPE_BYTES, collective_counts, computation_runs, computations,
                                 executed_dot_flops, instructions, mesh_groups, permute_groups, replica_groups,
                                 result_bytes)
from tests.support.reference import parallel_step_for, parallel_config

__all__ = ["COLLECTIVE", "DTYPE_BYTES", "collective_counts", "compiled_step_text", "computation_runs", "computations",
           "executed_dot_flops", "instructions", "mesh_groups", "permute_groups", "replica_groups", "result_bytes"]


@functools.cache
def compiled_step_text(dp, tp, block, mode, layers):
  """(the 3D step, its compiled HLO text) of tests.support.reference's model (cached)."""
  parallel_step = parallel_step_for(parallel_config(dp, tp, block, mode, layers=layers))
  return parallel_step, parallel_step.train_step().lower(*parallel_step.abstract_inputs()).compile().as_text()
