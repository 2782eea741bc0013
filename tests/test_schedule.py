"""Pipeline schedules: every dependency holds, the bubble equals the formulas exactly."""

from fractions import Fraction

import pytest

from megajax.parallel import schedule as pipeline
from tests.conftest import run_module

GRID = [(p, v, m) for p in (2, 4, 8) for v in (1, 2, 4) for m in (p, 2 * p, 4 * p)]


@pytest.mark.parametrize("traversal", pipeline.TRAVERSALS)
@pytest.mark.parametrize("p,v,m", GRID)
def test_interleaved_1f1b_bubble_is_p_minus_1_over_v_m(p, v, m, traversal):
  name = "interleaved_1f1b" if v > 1 else "1f1b"
  timeline = pipeline.simulate(name, p, v, m, traversal)
  assert Fraction(timeline.bubble_ticks, 2 * m * v) == Fraction(p - 1, v * m)
  assert timeline.ticks == 2 * m * v + 2 * (p - 1)


@pytest.mark.parametrize("p,m", [(2, 2), (4, 4), (4, 16), (8, 8), (8, 32), (4, 3)])
def test_gpipe_bubble_is_p_minus_1_over_m(p, m):
  timeline = pipeline.simulate("gpipe", p, 1, m)
  assert Fraction(timeline.bubble_ticks, 2 * m) == Fraction(p - 1, m)


def test_1f1b_holds_at_most_p_microbatches_gpipe_all_of_them():
  assert pipeline.in_flight(pipeline.simulate("1f1b", 4, 1, 32)) == [4, 3, 2, 1]
  assert pipeline.in_flight(pipeline.simulate("gpipe", 4, 1, 32)) == [32] * 4
  depth = pipeline.in_flight(pipeline.simulate("interleaved_1f1b", 4, 2, 32, "depth_first"))
  breadth = pipeline.in_flight(pipeline.simulate("interleaved_1f1b", 4, 2, 32, "breadth_first"))
  assert depth == pipeline.in_flight(pipeline.simulate("interleaved_1f1b", 4, 2, 8, "depth_first"))  # bounded in m
  assert all(b > d for b, d in zip(breadth, depth))  # breadth-first holds more: only where memory allows


def test_every_dependency_is_checked():
  # Megatron's interleaved order for p=2, v=2, m=2, with stage 1's first backward moved first:
  # it needs forwards that stage 1 itself has not run yet.
  good = pipeline.stage_orders("interleaved_1f1b", 2, 2, 2)
  early = list(good[1])
  first_backward = next(i for i, op in enumerate(early) if op.kind == pipeline.BACKWARD)
  early.insert(0, early.pop(first_backward))
  orders = (good[0], tuple(early))
  pipeline.simulate_orders("interleaved_1f1b", 2, 2, 2, good)  # the real order runs
  with pytest.raises(AssertionError, match="deadlock"):
    pipeline.simulate_orders("interleaved_1f1b", 2, 2, 2, orders)


@pytest.mark.parametrize("args,message", [
    (("interleaved_1f1b", 4, 2, 6), "microbatches=6: interleaved 1F1B needs a multiple of the 4 stages; use 8"),
    (("1f1b", 4, 2, 8), "virtual_stages=2: 1f1b has one chunk per stage"),
    (("zigzag", 4, 1, 8), "schedule='zigzag': unknown"),
])
def test_impossible_schedules_are_refused(args, message):
  with pytest.raises(ValueError, match=message.replace("(", r"\(")):
    pipeline.simulate(*args)


def test_the_picture_command(tmp_path):
  out = tmp_path / "s.png"
  result = run_module(["-m", "megajax.launch.schedule", "--pp", "4", "--vpp", "2", "--microbatches", "8",
                       f"--out={out}"], timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "stage 0:  F0a  F1a  F2a  F3a  F0b" in result.stdout
  assert "bubble: 6 idle ticks per stage = 0.1875 of ideal" in result.stdout
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
