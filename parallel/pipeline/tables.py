"""A schedule compiled into the static int32 tables the executor reads each tick.

Per tick and stage: a forward slot and a backward slot (schedule.paired_timeline), each
with its branch (idle, or a chunk program's forward / backward), microbatch, local chunk and
the stash / cotangent buffer slots it reads; and where the tick's arrivals are written. A
chunk program is (embeds?, ends in the loss?, the windows of its k layers): one compiled
body per distinct program, so every window stays static (the Pallas kernels need that).
Slots are assigned in Python, greedily, so the buffers are as small as the schedule allows.

Two ways to run a backward (parallel.pipeline_recompute):
  False (the default)  the forward slot keeps the chunk's residuals (residuals.py) in a
                       residual slot until its backward: an input waits in its stash slot from
                       arrival to its forward only.
  True                 the backward reruns the forward from the stashed input, which waits
                       from arrival to the backward; no residual slots.
The last chunk's forward slot idles either way: its backward runs the loss's forward and
backward together, and counts the statistics there.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from megajax.model import ModelConfig
from megajax.parallel.pipeline.schedule import BACKWARD, FORWARD, Schedule, paired_timeline
from megajax.parallel.pipeline.stacking import stacked_layer_order


@dataclasses.dataclass(frozen=True)
class Program:
  """What one chunk computes; chunks with equal programs share one compiled body."""
  first: bool                      # embeds the tokens
  last: bool                       # ends in the head and the loss
  windows: tuple                   # each layer's attention window (None: global)


@dataclasses.dataclass(frozen=True)
class Tables:
  """A schedule compiled for the executor: its paired ticks (one forward slot, then one
  backward slot per stage) as int32 tables [ticks, stages], and the buffer sizes."""
  schedule: Schedule
  layers_per_chunk: int
  programs: tuple                  # branch i + 1 of either slot runs program i
  stash_slots: int                 # activation slots (plus one trash slot)
  cotangent_slots: int             # cotangent slots (plus one trash slot)
  residual_slots: int              # residual slots (plus one trash slot); 0 when recomputing
  recompute: bool                  # parallel.pipeline_recompute
  per_stage: dict                  # f_/b_ branch, microbatch, chunk, in_slot; b_ct_slot; recv_fwd, recv_bwd;
                                   # f_res_slot, b_res_slot

  @property
  def ticks(self) -> int:
    return self.per_stage["f_branch"].shape[0]

  @classmethod
  def build(cls, schedule: Schedule, c: ModelConfig, recompute: bool = False) -> "Tables":
    p, v = schedule.stages, schedule.virtual_stages
    chunks = p * v
    k = len(stacked_layer_order(c.num_layers, p, v)) // chunks   # (checks the cut)
    program_of = {g: Program(g == 0, g == chunks - 1, tuple(c.layer_window(g * k + j) for j in range(k)))
                  for g in range(chunks)}
    programs = tuple(sorted(set(program_of.values()), key=lambda pr: (not pr.first, pr.last, str(pr.windows))))
    pairs = paired_timeline(schedule)                          # [p, ticks, 2]
    ticks = pairs.shape[1]
    when = {(s, op): t for s in range(p) for t in range(ticks) for op in pairs[s, t] if op is not None}

    names = ("f_branch", "f_microbatch", "f_chunk", "f_in_slot", "b_branch", "b_microbatch", "b_chunk",
             "b_in_slot", "b_ct_slot", "recv_fwd", "recv_bwd", "f_res_slot", "b_res_slot")
    tables = {name: np.zeros((ticks, p), np.int32) for name in names}
    stash_slots = cotangent_slots = 1
    residual_slots = 0
    for s in range(p):
      # Per tick: the slots its ops read, the slots freed after them, the arrival at its end.
      stash, cotangents, residuals = _SlotEvents(ticks), _SlotEvents(ticks), _SlotEvents(ticks)
      for t in range(ticks):
        forward, backward = pairs[s, t]
        for prefix, op in (("f_", forward), ("b_", backward)):
          if op is None:
            continue
          g = op.chunk * p + s
          key = (op.microbatch, op.chunk)
          # The last chunk's forward slot idles: its backward runs the loss's forward anyway
          # and counts the statistics there.
          if not (op.kind == FORWARD and g == chunks - 1):
            tables[prefix + "branch"][t, s] = 1 + programs.index(program_of[g])
          tables[prefix + "microbatch"][t, s], tables[prefix + "chunk"][t, s] = key
          # The input is last read by the forward, unless the backward reruns it (or runs
          # the last chunk's forward).
          keeps_input = recompute or g == chunks - 1
          if g > 0 and (op.kind == FORWARD or keeps_input):  # reads its stashed input
            stash.reads[t].append((prefix + "in_slot", key))
          if op.kind == FORWARD and g > 0:                   # the input arrives from stage s-1
            stash.arrivals[when[(s - 1) % p, dataclasses.replace(op, chunk=(g - 1) // p)]] = key
          if g > 0 and (op.kind == BACKWARD) == keeps_input:
            stash.frees[t].append(key)
          if not keeps_input:                                # the residuals: forward -> backward
            if op.kind == FORWARD:
              residuals.arrivals[t] = key
            else:
              residuals.reads[t].append(("b_res_slot", key))
              residuals.frees[t].append(key)
          if op.kind == BACKWARD and g < chunks - 1:         # its cotangent arrives from stage s+1
            cotangents.reads[t].append(("b_ct_slot", key))
            cotangents.frees[t].append(key)
            cotangents.arrivals[when[(s + 1) % p, dataclasses.replace(op, chunk=(g + 1) // p)]] = key
      stash_slots = max(stash_slots, stash.assign(s, tables, "recv_fwd"))
      cotangent_slots = max(cotangent_slots, cotangents.assign(s, tables, "recv_bwd"))
      residual_slots = max(residual_slots, residuals.assign(s, tables, "f_res_slot"))
    # Ticks with no arrival write to the trash slot, one past the last real one.
    for name, trash in (("recv_fwd", stash_slots), ("recv_bwd", cotangent_slots), ("f_res_slot", residual_slots)):
      tables[name][tables[name] < 0] = trash
    return cls(schedule, k, programs, stash_slots, cotangent_slots, residual_slots, recompute, tables)

  def first_chunk_only_ticks(self) -> tuple[int, int]:
    """(leading, trailing) ticks in which no stage runs an op of any chunk but its first
    (local chunk 0): the warm-up's start and the cool-down's end, where the executor moves
    the other chunks' dp collectives (dp_pieces)."""
    ps = self.per_stage
    only_first = (((ps["f_branch"] == 0) | (ps["f_chunk"] == 0)) & ((ps["b_branch"] == 0) | (ps["b_chunk"] == 0))).all(1)
    if only_first.all():
      return self.ticks, self.ticks
    return int(np.argmin(only_first)), int(np.argmin(only_first[::-1]))


def dp_pieces(rows: int, ticks: int) -> tuple[int, tuple]:
  """`rows` rows cut into equal pieces, one per tick over at most `ticks` ticks: (rows per
  piece, each piece's first row). The last piece ends at `rows` and may overlap the one
  before it (those rows are moved twice, the same values); () when there are none."""
  if rows == 0 or ticks == 0:
    return 0, ()
  size = -(-rows // ticks)
  return size, tuple(min(i * size, rows - size) for i in range(-(-rows // size)))


class _SlotEvents:
  """One stage's use of a buffer, tick by tick; `assign` gives every held message a slot."""

  def __init__(self, ticks: int):
    self.ticks = ticks
    self.reads = [[] for _ in range(ticks)]      # (table, key) read during the tick
    self.frees = [[] for _ in range(ticks)]      # keys no longer needed after the tick's reads
    self.arrivals = {}                           # tick -> key written at the tick's end

  def assign(self, s: int, tables: dict, recv_table: str) -> int:
    """Greedy assignment; a slot freed at tick t takes the arrival at t's end. Returns the slots used."""
    free, slot_of, used = [], {}, 0
    tables[recv_table][:, s] = -1
    for t in range(self.ticks):
      for table, key in self.reads[t]:
        tables[table][t, s] = slot_of[key]
      for key in self.frees[t]:
        free.append(slot_of.pop(key))
      if t in self.arrivals:
        if not free:
          free.append(used)
          used += 1
        slot_of[self.arrivals[t]] = tables[recv_table][t, s] = free.pop()
    return used
