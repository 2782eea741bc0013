"""MegaFBD in the planner (parallel/planner/fbd.py): each stage from the 3D model's operation
times, the transfer from the residuals' bytes, MFU over both groups' peaks, the search's plans."""

import dataclasses

import pytest

from megajax import flops
from megajax.config import load_config
from megajax.model import ModelConfig
from megajax.parallel.planner import HARDWARE, fbd, memory
from megajax.parallel.planner.cost_model import apply_switches

A100, H100 = HARDWARE["a100-80g"], HARDWARE["h100-80g"]


@pytest.fixture(scope="module")
def model():
  return ModelConfig.from_config(load_config("configs/gpt_1p3b.py").model)


def _plan(forward_dp=4, forward_tp=8, backward_dp=8, backward_tp=1, micro_batch=16, batch=128, forward_hw=A100):
  return fbd.FbdPlan(fbd.Group(forward_hw, forward_dp, forward_tp), fbd.Group(H100, backward_dp, backward_tp),
                     micro_batch, batch)


def test_a_step_is_three_pipelined_stages_and_mfu_counts_both_groups(model):
  plan = _plan()
  t = fbd.fbd_time(model, plan, "full")
  slowest = max(t.forward, t.transfer, t.backward)
  assert t.total == pytest.approx(t.weights + t.forward + t.transfer + t.backward + 7 * slowest + t.optimizer
                                  + t.straggler)
  peaks = (32 * A100.peak_tflops + 8 * H100.peak_tflops) * 1e12
  model_flops = flops.training_flops_per_token(apply_switches(model, fbd.FBD_SWITCHES)) * 128 * model.seq_len
  assert t.mfu == pytest.approx(model_flops / (t.total * peaks))


def test_the_transfer_follows_the_residuals_the_remat_policy_keeps(model):
  """remat full keeps each layer's input alone; dots the projections too; none everything."""
  plan = _plan()
  transfers = [fbd.fbd_time(model, plan, remat).transfer for remat in ("full", "dots", "none")]
  assert transfers[0] < transfers[1] < transfers[2]
  whole = dataclasses.replace(plan.group_plan(plan.forward), dp=1, tp=1, micro_batch=16)
  nics = min(32 * A100.nic_busbw_gbps, 8 * H100.nic_busbw_gbps) * 1e9
  assert transfers[1] == pytest.approx(memory.fbd_residual_bytes(model, whole, "dots") / nics, rel=1e-3)


def test_each_stage_runs_on_its_own_group(model):
  """The forward shrinks with more forward devices or a faster GPU, and leaves the backward as
  it was; the weights go to every forward dp replica."""
  base = fbd.fbd_time(model, _plan(forward_dp=2), "full")
  more = fbd.fbd_time(model, _plan(forward_dp=4), "full")
  faster = fbd.fbd_time(model, _plan(forward_dp=2, forward_hw=H100), "full")
  assert more.forward < base.forward and faster.forward < base.forward
  assert more.backward == base.backward == faster.backward
  assert more.weights > base.weights


def test_the_search_returns_fitting_even_plans_fastest_first(model):
  found = fbd.search(model, A100, 32, H100, 8, 128, "full")
  assert found and all(x.fits for x in found)
  assert [x.time.total for x in found] == sorted(x.time.total for x in found)
  for x in found:
    p = x.plan
    assert p.forward.gpus == 32 and p.backward.gpus == 8
    assert 128 % p.micro_batch == 0 and p.micro_batch % p.forward.dp == 0 and p.micro_batch % p.backward.dp == 0
  assert "--config.parallel.fbd.enabled=True" in fbd.config_overrides(found[0].plan)
