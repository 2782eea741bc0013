"""Pipeline schedules: which (forward|backward, microbatch, chunk) each stage runs, tick by tick.

Pure Python. The model's layers are cut into p * v chunks; stage s holds chunks s, s+p,
s+2p, ... (Megatron's round-robin), so local chunk c of stage s is global chunk c*p + s.

  gpipe             every forward, then every backward (v chunks walked breadth-first)
  1f1b              v = 1: warm-up forwards, then one forward / one backward, then cool-down
  interleaved_1f1b  Megatron's interleaved order over v chunks per stage

Stage s warms up with 2(p - s - 1) + (v - 1) * group forwards: Megatron's interleaved depth,
used for v = 1 too (classic 1F1B warms up with p - s - 1). The executor runs one forward
and one backward per tick (`paired_timeline`), and a message takes a whole tick to hop a
stage; with the classic depth its ticks would idle (p=4, m=8, backward = 3 forwards:
lockstep time 64 instead of 44). The price: stage s holds up to 2(p - s) - 1 stashed
inputs instead of p - s, still independent of m. The bubble is the same.

Traversal (MegaDPP): the order in which a stage walks (microbatch, chunk) pairs.
  depth_first    groups of p microbatches go through chunk 0, then chunk 1, ... (Megatron):
                 the fewest microbatches in flight.
  breadth_first  all m microbatches go through chunk 0, then chunk 1, ...: more activations
                 held at once, fewer chunk switches; use it only where memory allows.

`simulate` turns the per-stage orders into a lockstep timeline (every op one tick, a result
usable by another stage at the next tick), checking every dependency on the way; the idle
cells are the bubble. With unit ticks the bubble over the ideal time is exactly
(p - 1) / (v * m) for (interleaved) 1F1B and (p - 1) / m for GPipe.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from megajax.config import SCHEDULE_CHOICES, TRAVERSAL_CHOICES

FORWARD, BACKWARD = "F", "B"


@dataclasses.dataclass(frozen=True)
class Op:
  kind: str        # FORWARD or BACKWARD
  microbatch: int
  chunk: int       # local chunk on its stage, 0 .. v-1

  def __str__(self):
    return f"{self.kind}{self.microbatch}{chr(ord('a') + self.chunk)}"


@dataclasses.dataclass(frozen=True)
class Schedule:
  name: str
  stages: int             # p
  virtual_stages: int     # v, chunks per stage
  microbatches: int       # m
  orders: tuple           # per stage: tuple of Op, in execution order
  timeline: np.ndarray    # object [stages, ticks]: the Op each stage runs at each tick, or None

  @property
  def ticks(self) -> int:
    return self.timeline.shape[1]

  @property
  def bubble_ticks(self) -> int:
    """Idle ticks per stage (the same on every stage for these schedules: the maximum)."""
    return int(max(sum(op is None for op in row) for row in self.timeline))

  @property
  def bubble_fraction(self) -> float:
    """Bubble time over ideal time (Megatron's definition): idle ticks / busy ticks per stage."""
    return self.bubble_ticks / (2 * self.microbatches * self.virtual_stages)

  def global_chunk(self, stage: int, chunk: int) -> int:
    return chunk * self.stages + stage


def _pairs(microbatches: int, virtual_stages: int, group: int, reverse_chunks: bool):
  """(microbatch, chunk) in traversal order: `group` microbatches through each chunk in turn."""
  pairs = []
  for first in range(0, microbatches, group):
    members = range(first, min(first + group, microbatches))
    chunks = range(virtual_stages - 1, -1, -1) if reverse_chunks else range(virtual_stages)
    pairs.extend((mb, c) for c in chunks for mb in members)
  return pairs


def stage_orders(name: str, stages: int, virtual_stages: int, microbatches: int,
                 traversal: str = "depth_first") -> tuple:
  """Each stage's ordered ops."""
  check(name, stages, virtual_stages, microbatches, traversal)
  p, v, m = stages, virtual_stages, microbatches
  group = p if traversal == "depth_first" else m
  if name == "gpipe":
    group = m
  forwards = [Op(FORWARD, mb, c) for mb, c in _pairs(m, v, group, reverse_chunks=False)]
  backwards = [Op(BACKWARD, mb, c) for mb, c in _pairs(m, v, group, reverse_chunks=True)]
  orders = []
  for s in range(p):
    if name == "gpipe":
      orders.append(tuple(forwards + backwards))
      continue
    # Warm-up: enough forwards that the first backward (microbatch 0, last chunk) can arrive.
    warmup = min((p - s - 1) * 2 + (v - 1) * group, m * v)
    order = forwards[:warmup]
    for i in range(m * v - warmup):          # steady state: one forward, one backward
      order += [forwards[warmup + i], backwards[i]]
    order += backwards[m * v - warmup:]      # cool-down
    orders.append(tuple(order))
  return tuple(orders)


def check(name: str, stages: int, virtual_stages: int, microbatches: int, traversal: str) -> None:
  """Raises ValueError (naming the option and the fix) for a combination with no valid schedule."""
  if name not in SCHEDULE_CHOICES:
    raise ValueError(f"schedule={name!r}: unknown; choose one of {', '.join(SCHEDULE_CHOICES)}")
  if traversal not in TRAVERSAL_CHOICES:
    raise ValueError(f"traversal={traversal!r}: unknown; choose one of {', '.join(TRAVERSAL_CHOICES)}")
  for label, value in (("stages", stages), ("virtual_stages", virtual_stages), ("microbatches", microbatches)):
    if value < 1:
      raise ValueError(f"{label}={value}: must be >= 1")
  if name == "1f1b" and virtual_stages != 1:
    raise ValueError(f"virtual_stages={virtual_stages}: 1f1b has one chunk per stage; "
                     "use interleaved_1f1b for more")
  if name == "interleaved_1f1b" and virtual_stages > 1 and microbatches % stages:
    raise ValueError(f"microbatches={microbatches}: interleaved 1F1B needs a multiple of the {stages} stages; "
                     f"use {-(-microbatches // stages) * stages}")


def _dependencies(op: Op, stage: int, p: int, v: int):
  """(stage, op) pairs that must finish before `op` runs on `stage`."""
  g = op.chunk * p + stage
  last = p * v - 1
  if op.kind == FORWARD:
    return [] if g == 0 else [((g - 1) % p, Op(FORWARD, op.microbatch, (g - 1) // p))]
  deps = [(stage, Op(FORWARD, op.microbatch, op.chunk))]
  if g < last:
    deps.append(((g + 1) % p, Op(BACKWARD, op.microbatch, (g + 1) // p)))
  return deps


def simulate(name: str, stages: int, virtual_stages: int, microbatches: int,
             traversal: str = "depth_first") -> Schedule:
  """The lockstep timeline of a named schedule."""
  orders = stage_orders(name, stages, virtual_stages, microbatches, traversal)
  return simulate_orders(name, stages, virtual_stages, microbatches, orders)


def simulate_orders(name: str, stages: int, virtual_stages: int, microbatches: int, orders) -> Schedule:
  """Each tick every stage runs its next op if its inputs have arrived; an order that waits on
  an op its producer runs later (a broken dependency) ends in an AssertionError."""
  p, v = stages, virtual_stages
  for s, order in enumerate(orders):
    expected = {Op(k, mb, c) for k in (FORWARD, BACKWARD) for mb in range(microbatches) for c in range(v)}
    if len(order) != len(expected) or set(order) != expected:
      raise AssertionError(f"stage {s}: the order does not run every op exactly once")
  done = {}                                   # (stage, op) -> tick it ran
  position = [0] * p
  columns = []
  while any(position[s] < len(orders[s]) for s in range(p)):
    tick = len(columns)
    column = [None] * p
    for s in range(p):
      if position[s] == len(orders[s]):
        continue
      op = orders[s][position[s]]
      if all(done.get(dep, tick) < tick for dep in _dependencies(op, s, p, v)):
        column[s] = op
    if not any(column):
      stuck = {s: str(orders[s][position[s]]) for s in range(p) if position[s] < len(orders[s])}
      raise AssertionError(f"{name}: deadlock at tick {tick}, waiting: {stuck}")
    for s, op in enumerate(column):
      if op is not None:
        done[s, op] = tick
        position[s] += 1
    columns.append(column)
  timeline = np.empty((p, len(columns)), dtype=object)
  for t, column in enumerate(columns):
    for s, op in enumerate(column):
      timeline[s, t] = op
  return Schedule(name, p, v, microbatches, orders, timeline)


def in_flight(schedule: Schedule) -> list[int]:
  """Per stage, the most microbatch-chunks forwarded and not yet backwarded (stashed inputs)."""
  peaks = []
  for row in schedule.timeline:
    live = peak = 0
    for op in row:
      if op is not None:
        live += 1 if op.kind == FORWARD else -1
        peak = max(peak, live)
    peaks.append(peak)
  return peaks


def paired_timeline(schedule: Schedule) -> np.ndarray:
  """The executor's ticks: object [stages, ticks, 2], each tick one forward slot then one
  backward slot per stage, every stage's order kept.

  A stage runs its next op in the forward slot if it is a forward whose input was sent in
  an earlier tick, then its next op in the backward slot if it is a backward whose
  cotangent was sent in an earlier tick. Messages move at the end of a tick, so a
  forward's send overlaps the backward that follows it (decoupled send/recv), and in the
  steady state of 1F1B every tick holds one forward and one backward on every stage.
  """
  p, v = schedule.stages, schedule.virtual_stages
  done, position, columns = {}, [0] * p, []
  while any(position[s] < len(order) for s, order in enumerate(schedule.orders)):
    tick = len(columns)
    column = [[None, None] for _ in range(p)]
    for slot, kind in enumerate((FORWARD, BACKWARD)):
      for s, order in enumerate(schedule.orders):
        if position[s] == len(order):
          continue
        op = order[position[s]]
        ready = all(done.get(dep, tick) < tick or dep[0] == s for dep in _dependencies(op, s, p, v))
        if op.kind == kind and ready:
          column[s][slot] = op
          done[s, op] = tick
          position[s] += 1
    if not any(any(cell) for cell in column):
      raise AssertionError(f"{schedule.name}: deadlock at tick {tick}")
    columns.append(column)
  pairs = np.empty((p, len(columns), 2), dtype=object)
  for t, column in enumerate(columns):
    for s, cell in enumerate(column):
      pairs[s, t] = cell
  return pairs


def makespans(schedule: Schedule, forward: float, backward: float) -> tuple[float, float]:
  """(lockstep, asynchronous) time of one step when a forward takes `forward` and a backward
  `backward` (communication free).

  lockstep:      the executor's paired ticks: every stage moves through the same ticks, so
                 a tick lasts its slowest forward plus its slowest backward.
  asynchronous:  each stage runs its order back to back, an op starting as soon as its
                 inputs exist (a multi-program runtime such as Megatron's).
  """
  cost = lambda op: forward if op.kind == FORWARD else backward
  pairs = paired_timeline(schedule)
  lockstep = sum(max((cost(op) for op in pairs[:, t, slot] if op is not None), default=0.0)
                 for t in range(pairs.shape[1]) for slot in range(2))
  p, v = schedule.stages, schedule.virtual_stages
  finish, free, position = {}, [0.0] * p, [0] * p
  moved = True
  while moved:
    moved = False
    for s, order in enumerate(schedule.orders):
      while position[s] < len(order):
        op = order[position[s]]
        deps = _dependencies(op, s, p, v)
        if not all(dep in finish for dep in deps):
          break
        start = max([free[s]] + [finish[dep] for dep in deps])
        finish[s, op] = free[s] = start + cost(op)
        position[s] += 1
        moved = True
  assert all(position[s] == len(order) for s, order in enumerate(schedule.orders)), "deadlocked order"
  return lockstep, max(free)


def ascii_timeline(schedule: Schedule) -> str:
  """Stages as rows, ticks as columns: F3a = forward of microbatch 3 on local chunk a; . idle."""
  lines = [f"{schedule.name}: p={schedule.stages} v={schedule.virtual_stages} m={schedule.microbatches}, "
           f"{schedule.ticks} ticks, bubble {schedule.bubble_fraction:.3f} of ideal"]
  for s, row in enumerate(schedule.timeline):
    lines.append(f"stage {s}: " + " ".join(f"{str(op) if op else '.':>4}" for op in row))
  return "\n".join(lines)


def ascii_paired_timeline(schedule: Schedule) -> str:
  """The executor's ticks (`paired_timeline`): each cell is forward slot|backward slot."""
  pairs = paired_timeline(schedule)
  lines = [f"executor: {pairs.shape[1]} ticks of one forward slot | one backward slot"]
  for s in range(schedule.stages):
    cells = [f"{str(f) if f else '.':>4}|{str(b) if b else '.':<4}" for f, b in pairs[s]]
    lines.append(f"stage {s}: " + " ".join(cells))
  return "\n".join(lines)


def render_png(schedule: Schedule, path: str, paired: bool = False) -> None:
  """A timeline picture: forwards blue, backwards orange (darker per chunk), microbatch numbers.
  paired=True draws the executor's ticks: each stage row split into its forward slot (top)
  and backward slot (bottom)."""
  import matplotlib  # Only the picture needs it.
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  if paired:   # cells: (tick, row bottom, height, op)
    grid = paired_timeline(schedule)
    cells = [(t, schedule.stages - 1 - s + 0.5 * (1 - slot), 0.5, grid[s, t, slot])
             for s in range(schedule.stages) for t in range(grid.shape[1]) for slot in range(2)]
    ticks, what = grid.shape[1], "executor: forward slot over backward slot"
  else:
    cells = [(t, schedule.stages - 1 - s, 1.0, schedule.timeline[s, t])
             for s in range(schedule.stages) for t in range(schedule.ticks)]
    ticks, what = schedule.ticks, f"bubble {schedule.bubble_fraction:.3f} of ideal"
  p = schedule.stages
  fig, ax = plt.subplots(figsize=(max(6, ticks * 0.35), 0.6 * p + 1.2))
  blues, oranges = plt.get_cmap("Blues"), plt.get_cmap("Oranges")
  for t, bottom, height, op in cells:
    if op is None:
      continue
    shade = 0.45 + 0.4 * op.chunk / max(1, schedule.virtual_stages - 1)
    color = (blues if op.kind == FORWARD else oranges)(shade)
    ax.add_patch(plt.Rectangle((t, bottom), 1, height, facecolor=color, edgecolor="white"))
    ax.text(t + 0.5, bottom + height / 2, str(op.microbatch), ha="center", va="center", fontsize=7)
  ax.set_xlim(0, ticks)
  ax.set_ylim(0, p)
  ax.set_yticks([p - 0.5 - s for s in range(p)], [f"stage {s}" for s in range(p)])
  ax.set_xlabel("tick")
  ax.set_title(f"{schedule.name}  p={p} v={schedule.virtual_stages} m={schedule.microbatches}  "
               f"{what} (forward blue, backward orange)")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
