"""Sampled traces in process: operations classified by their scopes, and a workdir without
traces. (The 2-process straggler drill: tests/e2e/test_straggler_drill.py.)"""

import pytest

from megajax.observe.trace_analysis import analyse
from megajax.observe.traces import classify, operations


def test_operations_are_classified_from_their_scopes():
  assert classify("reduce-scatter", "jit(step)/transpose(jvp(forward))/dp all-gather/all_gather") == \
      ("communication", "dp reduce-scatter")
  assert classify("all-gather-start", "jit(step)/forward/tp all-gather/all_gather") == ("communication", "tp all-gather")
  assert classify("all-reduce", "jit(step)/psum") == ("communication", "all-reduce")
  assert classify("fusion", "jit(step)/transpose(jvp(forward))/dot_general") == ("backward", "backward")
  assert classify("fusion", "jit(step)/optimizer/mul") == ("optimizer", "optimizer")
  assert classify("dot", "jit(step)/forward/dot_general") == ("forward", "forward")
  hlo = ('HloModule jit_step\n  %ag.1 = f32[8]{0} all-gather(f32[4]{0} %p), dimensions={0}, '
         'metadata={op_name="jit(step)/forward/dp all-gather/all_gather"}\n'
         '  ROOT %fusion.2 = f32[8]{0} fusion(f32[8]{0} %ag.1), kind=kLoop, '
         'metadata={op_name="jit(step)/optimizer/add"}\n')
  assert operations(hlo) == {"ag.1": {"opcode": "all-gather", "category": "communication", "kind": "dp all-gather"},
                             "fusion.2": {"opcode": "fusion", "category": "optimizer", "kind": "optimizer"}}


def test_a_workdir_without_traces_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="trace_every"):
    analyse(str(tmp_path))
