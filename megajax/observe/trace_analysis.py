"""Sampled step traces -> one rank-aligned Chrome trace, a per-rank heat map, and stragglers.

MegaScale 5 and MegaScan (../shared/reference): each process traced the same step on its own
clock (megajax.observe.traces). Here:
  1. `load_ranks`: every device's operations of the step, named by their (dp, pp, cp, tp) rank
     and classified (forward / backward / optimizer / communication with its mesh axis).
  2. `align`: the participants of one collective finish together, so every collective
     instance that spans two processes is an anchor; each process is shifted onto the
     reference process's clock, piecewise linearly from anchor to anchor (clock drift stays
     bounded by the gap between two anchors).
  3. `merged_trace`: one Chrome/Perfetto trace, one track per rank `DP{d}-PP{p}-TP{t}`
     (`DP{d}-PP{p}-CP{c}-TP{t}` in a job with parallel.cp > 1).
  4. `heat_map` and `find_stragglers`: per-rank forward / backward / communication time;
     a straggler is slow in every group it joins (its data- and context-parallel peers,
     which run the same operations, and its tensor-parallel group), and arrives last at
     their collectives; ranks that merely wait for it (long communication, normal compute)
     are its victims.
  5. `analyse(workdir)`: all of it for a run's traced steps, written to
     WORKDIR/traces/analysis/ (merged_trace.json.gz, heatmap.csv / .png, stragglers.json),
     which megajax-report reads.
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import glob
import gzip
import json
import os
import re

import numpy as np

from megajax.observe.traces import META, TRACES
from megajax.parallel.mesh import MESH_AXES

CONTAINERS = ("while", "conditional", "call")   # their bodies' operations are traced themselves
CATEGORIES = ("forward", "backward", "optimizer", "communication")


@dataclasses.dataclass
class TracedOp:
  name: str           # the HLO instruction
  category: str
  kind: str
  start: float        # microseconds, on the rank's process clock until aligned
  end: float


@dataclasses.dataclass
class Rank:
  coords: tuple[int, int, int, int]   # (dp, pp, cp, tp): MESH_AXES' order
  process: int
  ops: list[TracedOp]
  with_cp: bool = False               # the job's mesh has cp > 1: the label names the cp rank

  @property
  def label(self) -> str:
    return rank_label(self.coords, self.with_cp)


def mesh_coords(coords) -> tuple[int, int, int, int]:
  """(dp, pp, cp, tp) of a device's recorded coordinates; a trace from before the cp axis
  recorded (dp, pp, tp): cp 0."""
  coords = tuple(int(c) for c in coords)
  return (*coords[:2], 0, coords[2]) if len(coords) == 3 else coords


def rank_label(coords, with_cp: bool = False) -> str:
  """A rank's name: "DP{d}-PP{p}-TP{t}", or "DP{d}-PP{p}-CP{c}-TP{t}" in a job whose mesh has
  cp > 1 (`with_cp`; a cp rank above 0 is always named). (dp, pp, cp, tp) or (dp, pp, tp) coords."""
  dp, pp, cp, tp = mesh_coords(coords)
  return f"DP{dp}-PP{pp}-CP{cp}-TP{tp}" if with_cp or cp else f"DP{dp}-PP{pp}-TP{tp}"


def latest_step_dir(traces_dir: str) -> str:
  steps = sorted(glob.glob(os.path.join(traces_dir, "step_*")), key=lambda p: int(p.rsplit("_", 1)[1]))
  if not steps:
    raise FileNotFoundError(f"no traced step in {traces_dir}: train with --config.observe.trace_every=N")
  return steps[-1]


def trace_file(process_dir: str) -> str:
  """The newest jax.profiler trace (*.trace.json.gz) under `process_dir`."""
  files = glob.glob(os.path.join(process_dir, "**", "*.trace.json.gz"), recursive=True)
  if not files:
    raise FileNotFoundError(f"no *.trace.json.gz under {process_dir} (was the trace stopped?)")
  return max(files, key=os.path.getmtime)


def _device_ordinal(event: dict, process_names: dict) -> int | None:
  """CPU thunks carry args.device_ordinal (the device id); GPU kernels sit in a
  "/device:GPU:<local ordinal>" track."""
  ordinal = (event.get("args") or {}).get("device_ordinal")
  if ordinal is not None:
    return int(ordinal)
  match = re.search(r"/device:[A-Z]+:(\d+)", process_names.get(event.get("pid"), ""))
  return int(match.group(1)) if match else None


def load_process(process_dir: str) -> list[Rank]:
  """One process's traced step: its ranks, each with its classified operations in time order."""
  with open(os.path.join(process_dir, META)) as f:
    meta = json.load(f)
  with gzip.open(trace_file(process_dir)) as f:
    events = json.load(f)["traceEvents"]
  process_names = {e["pid"]: e["args"]["name"] for e in events
                   if e.get("ph") == "M" and e.get("name") == "process_name"}
  # CPU events name the device by its id, GPU tracks by the local ordinal.
  ranks = [Rank(mesh_coords(d["coords"]), meta["process"], []) for d in meta["devices"]]
  by_ordinal = {d["ordinal"]: rank for d, rank in zip(meta["devices"], ranks)}
  by_ordinal.update({d["id"]: rank for d, rank in zip(meta["devices"], ranks)})
  ops = meta["ops"]
  for event in events:
    args = event.get("args") or {}
    name = args.get("hlo_op")
    if event.get("ph") != "X" or name not in ops or args.get("hlo_module", meta["module"]) != meta["module"]:
      continue
    op = ops[name]
    if op["opcode"] in CONTAINERS:
      continue
    rank = by_ordinal.get(_device_ordinal(event, process_names))
    if rank is not None:
      start = float(event["ts"])
      rank.ops.append(TracedOp(name, op["category"], op["kind"], start, start + float(event.get("dur", 0.0))))
  for rank in ranks:
    rank.ops.sort(key=lambda op: op.start)
  return ranks


def load_ranks(step_dir: str) -> list[Rank]:
  processes = sorted(glob.glob(os.path.join(step_dir, "process_*")), key=lambda p: int(p.rsplit("_", 1)[1]))
  if not processes:
    raise FileNotFoundError(f"no process_* traces in {step_dir}")
  ranks = [rank for p in processes for rank in load_process(p)]
  with_cp = any(r.coords[2] for r in ranks)       # the job's cp > 1: every label names the cp rank
  for rank in ranks:
    rank.with_cp = with_cp
  empty = [r.label for r in ranks if not r.ops]
  if empty:
    raise ValueError(f"no operations of the traced step for {', '.join(empty)} in {step_dir}")
  return sorted(ranks, key=lambda r: r.coords)


# --- Collective instances and clock alignment.

def _group(coords, kind: str):
  """Who takes part in a collective on this axis with the rank at `coords`."""
  axis = kind.split()[0] if " " in kind else None
  if axis not in MESH_AXES:
    return ("all",)
  return (axis, *(c for a, c in zip(MESH_AXES, coords) if a != axis))


def collective_instances(ranks: list[Rank]) -> dict[tuple, list[tuple[Rank, TracedOp]]]:
  """(group, instruction, occurrence) -> its participants' (rank, op): the k-th run of one
  collective instruction by the members of one group is one collective."""
  instances = collections.defaultdict(list)
  for rank in ranks:
    seen = collections.Counter()
    for op in rank.ops:
      if op.category == "communication":
        instances[(_group(rank.coords, op.kind), op.name, seen[op.name])].append((rank, op))
        seen[op.name] += 1
  return {key: members for key, members in instances.items() if len(members) > 1}


def clock_offsets(ranks: list[Rank], reference: int = 0) -> dict[int, tuple[np.ndarray, np.ndarray]]:
  """Process -> (anchor times on its clock, offsets to add there), from collective ends."""
  # One anchor per run of a collective instruction: the mean end of its participants on each
  # process (the instruction's groups run together, e.g. the dp reduce-scatter of every tp rank).
  ends = collections.defaultdict(lambda: collections.defaultdict(list))
  for (_, name, occurrence), members in collective_instances(ranks).items():
    for rank, op in members:
      ends[(name, occurrence)][rank.process].append(op.end)
  pairs = collections.defaultdict(list)        # (p, q) -> [(end on p, end on q)]
  for per_process in ends.values():
    mean_end = {p: float(np.mean(v)) for p, v in per_process.items()}
    for p in mean_end:
      for q in mean_end:
        if p != q:
          pairs[(p, q)].append((mean_end[p], mean_end[q]))
  processes = sorted({r.process for r in ranks})
  if reference not in processes:
    reference = processes[0]
  offsets = {reference: (np.zeros(1), np.zeros(1))}
  frontier = [reference]
  while frontier:                               # breadth first from the reference process
    q = frontier.pop(0)
    for p in processes:
      if p in offsets or not pairs.get((p, q)):
        continue
      anchors = sorted(pairs[(p, q)])
      t_p = np.array([a for a, _ in anchors])
      # q's own offset at its anchor time, then the step onto q's clock.
      q_times, q_offsets = offsets[q]
      t_q = np.array([b for _, b in anchors])
      offsets[p] = (t_p, t_q + np.interp(t_q, q_times, q_offsets) - t_p)
      frontier.append(p)
  missing = [p for p in processes if p not in offsets]
  if missing:
    raise ValueError(f"processes {missing} share no collective with process {reference}: cannot align them")
  return offsets


def align(ranks: list[Rank], reference: int = 0) -> dict[int, float]:
  """Shifts every rank's operations onto the reference process's clock (in place); returns
  each process's median shift in microseconds."""
  offsets = clock_offsets(ranks, reference)
  for rank in ranks:
    times, shifts = offsets[rank.process]
    for op in rank.ops:       # one shift per operation (at its middle): durations are kept
      shift = float(np.interp((op.start + op.end) / 2, times, shifts))
      op.start, op.end = op.start + shift, op.end + shift
  return {p: float(np.median(shifts)) for p, (_, shifts) in offsets.items()}


def collective_end_spreads(ranks: list[Rank]) -> np.ndarray:
  """For every collective that spans processes, the gap (microseconds) between its first and
  last participant's end: how well the clocks agree after `align`."""
  spreads = [max(op.end for _, op in members) - min(op.end for _, op in members)
             for members in collective_instances(ranks).values()
             if len({rank.process for rank, _ in members}) > 1]
  return np.array(spreads)


# --- Outputs.

def merged_trace(ranks: list[Rank]) -> dict:
  """A Chrome/Perfetto trace: one process per rank named by its label (DP{d}-PP{p}-TP{t}), a
  compute and a communication thread in each."""
  events = []
  for pid, rank in enumerate(ranks):
    events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": rank.label}})
    events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}})
    for tid, thread in ((0, "compute"), (1, "communication")):
      events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": thread}})
    for op in rank.ops:
      events.append({"ph": "X", "pid": pid, "tid": int(op.category == "communication"),
                     "name": op.kind, "cat": op.category, "ts": op.start, "dur": op.end - op.start,
                     "args": {"hlo_op": op.name, "process": rank.process}})
  return {"traceEvents": events, "displayTimeUnit": "ms"}


def heat_map(ranks: list[Rank]) -> list[dict]:
  """Per rank: milliseconds of forward, backward, optimizer and communication in the step."""
  rows = []
  for rank in ranks:
    totals = collections.Counter()
    for op in rank.ops:
      totals[op.category] += (op.end - op.start) / 1e3
    rows.append({"rank": rank.label, **dict(zip(MESH_AXES, rank.coords)), "process": rank.process,
                 **{f"{c}_ms": round(totals[c], 3) for c in CATEGORIES}})
  return rows


def mean_heat_map(per_step: list[list[dict]]) -> list[dict]:
  """Several steps' heat maps (same ranks, same order) -> their mean."""
  keys = [f"{c}_ms" for c in CATEGORIES]
  return [{**rows[0], **{k: round(float(np.mean([r[k] for r in rows])), 3) for k in keys}}
          for rows in zip(*per_step)]


def compute_ms(row: dict) -> float:
  return row["forward_ms"] + row["backward_ms"] + row["optimizer_ms"]


def _last_to_start(ranks: list[Rank]) -> dict[str, dict[str, float]]:
  """Rank -> {axis: fraction of its collectives on that axis it started last} (aligned clocks)."""
  counts = collections.defaultdict(collections.Counter)
  for (group, _, _), members in collective_instances(ranks).items():
    last = max(members, key=lambda m: m[1].start)[0]
    for rank, _ in members:
      counts[rank.label][group[0] + " total"] += 1
    counts[last.label][group[0] + " last"] += 1
  return {label: {axis.split()[0]: c[axis.split()[0] + " last"] / n for axis, n in c.items() if axis.endswith("total")}
          for label, c in counts.items()}


# The groups whose members run the same operations, so that one's compute is compared with the
# others': dp peers (other rows), cp peers (other positions of the same rows: the dual-chunk
# layout balances the causal attention's work) and the tp group (other slices of the weights).
# Pipeline stages run other layers.
PEER_AXES = ("dp", "cp", "tp")


def find_stragglers(ranks: list[Rank], threshold: float = 1.5, rows: list[dict] | None = None) -> dict:
  """Root causes and victims (MegaScan's heuristic, on per-rank totals of the traced step).

  A rank is a straggler when, in every group it joins that has other members (PEER_AXES: its
  dp peers, its cp peers and its tp group), its compute time is the group's largest and at
  least `threshold` x the others' median. Its victims are the other members of those groups,
  whose extra communication time is the wait for it.
  """
  rows = {row["rank"]: row for row in rows or heat_map(ranks)}
  groups = collections.defaultdict(list)
  for row in rows.values():
    for axis in PEER_AXES:
      groups[(axis, *(row[a] for a in MESH_AXES if a != axis))].append(row["rank"])
  lateness = _last_to_start(ranks)
  stragglers, victims = [], {}
  for label, row in rows.items():
    joined = [(kind, members) for (kind, *_), members in groups.items() if label in members and len(members) > 1]
    evidence = {"compute_ms": round(compute_ms(row), 3), "communication_ms": row["communication_ms"]}
    slow_everywhere = bool(joined)
    for kind, members in joined:
      others = [compute_ms(rows[m]) for m in members if m != label]
      ratio = compute_ms(row) / max(float(np.median(others)), 1e-9)
      evidence[f"{kind}_group_compute_ratio"] = round(ratio, 3)
      evidence[f"{kind}_group"] = sorted(members)
      slow_everywhere &= ratio >= threshold and compute_ms(row) >= max(others)
    evidence["last_to_start_fraction"] = {k: round(v, 3) for k, v in lateness.get(label, {}).items()}
    if slow_everywhere:
      stragglers.append({"rank": label, **{a: row[a] for a in MESH_AXES}, "process": row["process"],
                         "evidence": evidence})
      for _, members in joined:
        for m in members:
          if m != label and rows[m]["communication_ms"] > row["communication_ms"]:
            victims[m] = {"rank": m, **{a: rows[m][a] for a in MESH_AXES}, "process": rows[m]["process"],
                          "evidence": {"waits_for": label, "compute_ms": round(compute_ms(rows[m]), 3),
                                       "communication_ms": rows[m]["communication_ms"],
                                       "extra_communication_ms": round(rows[m]["communication_ms"]
                                                                       - row["communication_ms"], 3)}}
  victims = [v for label, v in sorted(victims.items()) if label not in {s["rank"] for s in stragglers}]
  return {"threshold": threshold, "stragglers": stragglers, "victims": victims}


# --- The whole analysis of a workdir (megajax-trace).

HEATMAP_PANELS = ("forward_ms", "backward_ms", "communication_ms")
# What `analyse` writes in WORKDIR/traces/analysis/ (megajax-report reads them).
MERGED_TRACE, HEATMAP_CSV, HEATMAP_PNG, STRAGGLERS = ("merged_trace.json.gz", "heatmap.csv", "heatmap.png",
                                                      "stragglers.json")


def analysis_dir(workdir: str) -> str:
  return os.path.join(workdir, TRACES, "analysis")


def plot_heat_map(rows: list[dict], path: str) -> None:
  """One panel per quantity; rows of each panel are (dp, pp) pairs ((dp, pp, cp) with cp > 1),
  columns tp ranks."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  dp, pp, cp, tp = (max(r[k] for r in rows) + 1 for k in MESH_AXES)
  lines = [f"DP{d}-PP{p}" + (f"-CP{c}" if cp > 1 else "") for d in range(dp) for p in range(pp) for c in range(cp)]
  fig, axes = plt.subplots(1, len(HEATMAP_PANELS), figsize=(4 + 1.2 * tp * len(HEATMAP_PANELS), 1.5 + 0.5 * len(lines)),
                           squeeze=False)
  for ax, quantity in zip(axes[0], HEATMAP_PANELS):
    grid = np.zeros((len(lines), tp))
    for r in rows:
      grid[(r["dp"] * pp + r["pp"]) * cp + r["cp"], r["tp"]] = r[quantity]
    image = ax.imshow(grid, cmap="magma", aspect="auto")
    for (i, j), value in np.ndenumerate(grid):
      ax.text(j, i, f"{value:.1f}", ha="center", va="center", color="white" if value < grid.max() / 2 else "black",
              fontsize=8)
    ax.set_title(quantity.replace("_ms", " (ms)"))
    ax.set_xticks(range(tp), [f"TP{t}" for t in range(tp)])
    ax.set_yticks(range(len(lines)), lines)
    fig.colorbar(image, ax=ax, fraction=0.046)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def analyse_step(step_dir: str, reference: int, threshold: float):
  ranks = load_ranks(step_dir)
  shifts = align(ranks, reference)
  rows = heat_map(ranks)
  return ranks, shifts, rows, find_stragglers(ranks, threshold, rows)


def analyse(workdir: str, steps: list[int] | None = None, reference: int = 0, threshold: float = 1.5) -> dict:
  """Reads WORKDIR/traces/step_<n> for each of `steps` (None: the latest traced step), writes
  WORKDIR/traces/analysis/ (the merged trace of the last of them); returns a summary (clock
  shifts, collective end spread, stragglers).

  Over several steps the heat map is their mean, and a straggler must be flagged in every one
  of them: a persistent straggler is, while a rank that one step's noise slowed is not.
  """
  traces = os.path.join(workdir, TRACES)
  step_dirs = ([os.path.join(traces, f"step_{n}") for n in steps] if steps
               else [latest_step_dir(traces)])
  per_step = [analyse_step(d, reference, threshold) for d in step_dirs]
  ranks, shifts, _, last_findings = per_step[-1]
  out = analysis_dir(workdir)
  os.makedirs(out, exist_ok=True)
  with gzip.open(os.path.join(out, MERGED_TRACE), "wt") as f:
    json.dump(merged_trace(ranks), f)
  rows = mean_heat_map([rows for _, _, rows, _ in per_step])
  with open(os.path.join(out, HEATMAP_CSV), "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
  plot_heat_map(rows, os.path.join(out, HEATMAP_PNG))
  persistent = set.intersection(*({s["rank"] for s in findings["stragglers"]} for *_, findings in per_step))
  findings = {"threshold": threshold,
              "stragglers": [s for s in last_findings["stragglers"] if s["rank"] in persistent],
              "victims": [v for v in last_findings["victims"] if v["evidence"]["waits_for"] in persistent]}
  spreads = collective_end_spreads(ranks)
  traced = [int(os.path.basename(d).split("_")[1]) for d in step_dirs]
  summary = {"step": traced[-1], "steps": traced, "ranks": len(ranks), "clock_shift_us": shifts,
             "collective_end_spread_us": {"median": float(np.median(spreads)) if spreads.size else 0.0,
                                          "max": float(spreads.max()) if spreads.size else 0.0,
                                          "collectives": int(spreads.size)}}
  with open(os.path.join(out, STRAGGLERS), "w") as f:
    json.dump({**findings, **summary}, f, indent=2)
  return {**summary, **findings, "analysis_dir": out}
