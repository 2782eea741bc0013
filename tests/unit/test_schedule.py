"""Pipeline schedules: every dependency holds, the bubble equals the formulas exactly."""

from fractions import Fraction

import pytest

from megajax.config import TRAVERSAL_CHOICES
from megajax.parallel.pipeline import schedule as pipeline

GRID = [(p, v, m) for p in (2, 4, 8) for v in (1, 2, 4) for m in (p, 2 * p, 4 * p)]


@pytest.mark.parametrize("traversal", TRAVERSAL_CHOICES)
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


def test_1f1b_holds_a_bounded_number_of_microbatches_gpipe_all_of_them():
  # 2(p - s) - 1 on stage s: the interleaved warm-up depth the paired executor needs.
  assert pipeline.in_flight(pipeline.simulate("1f1b", 4, 1, 32)) == [7, 5, 3, 1]
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


@pytest.mark.parametrize("name,p,v,m", [("1f1b", 4, 1, 8), ("1f1b", 8, 1, 32), ("interleaved_1f1b", 4, 2, 8),
                                        ("interleaved_1f1b", 2, 4, 4), ("gpipe", 4, 2, 8)])
def test_paired_ticks_keep_orders_and_cost_no_more_than_an_asynchronous_runtime(name, p, v, m):
  """The executor's ticks (one forward slot, one backward slot) keep each stage's order, and
  for uniform chunks their lockstep time equals an asynchronous runtime's."""
  schedule = pipeline.simulate(name, p, v, m)
  pairs = pipeline.paired_timeline(schedule)
  for s in range(p):
    ran = [op for tick in pairs[s] for op in tick if op is not None]
    assert tuple(ran) == schedule.orders[s]
    assert all(f is None or f.kind == pipeline.FORWARD for f, _ in pairs[s])
    assert all(b is None or b.kind == pipeline.BACKWARD for _, b in pairs[s])
  for forward, backward in ((1, 2), (1, 3)):
    lockstep, asynchronous = pipeline.makespans(schedule, forward, backward)
    assert lockstep == asynchronous


def test_classic_1f1b_warmup_would_leave_the_paired_ticks_idle():
  """Why 1f1b warms up 2(p-s-1) deep: with p-s-1 the lockstep ticks cost 64 vs 44."""
  p, m = 4, 8
  forwards = [pipeline.Op(pipeline.FORWARD, i, 0) for i in range(m)]
  backwards = [pipeline.Op(pipeline.BACKWARD, i, 0) for i in range(m)]
  orders = []
  for s in range(p):
    warmup = p - s - 1
    steady = [op for i in range(m - warmup) for op in (forwards[warmup + i], backwards[i])]
    orders.append(tuple(forwards[:warmup] + steady + backwards[m - warmup:]))
  classic = pipeline.simulate_orders("1f1b", p, 1, m, tuple(orders))
  assert pipeline.makespans(classic, 1, 3) == (64, 44)
  assert pipeline.makespans(pipeline.simulate("1f1b", p, 1, m), 1, 3) == (44, 44)
