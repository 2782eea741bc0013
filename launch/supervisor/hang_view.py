"""The 3D hang view (MegaScale 5.2): every device's (dp, pp, cp, tp) cell with its process's last
phase, the processes that went silent first named as suspects, the live ones stuck behind
them (waiting in a collective) as victims.
"""

from __future__ import annotations

import numpy as np


def classify_hang(last_seen: dict[int, float], last_progress: dict[int, float], now: float,
             heartbeat_timeout: float) -> tuple[list[int], list[int]]:
  """(suspects, victims) from the supervisor's own clock readings per process.

  last_seen: when a new beat of the process last appeared; last_progress: when its step or
  phase last changed. A process silent for longer than the heartbeat timeout is a suspect
  (the earliest silent first). If every process still beats, the ones whose progress stopped
  first are the suspects (within a heartbeat interval of the earliest); the rest are victims.
  """
  silent = sorted((p for p, seen in last_seen.items() if now - seen > heartbeat_timeout), key=last_seen.get)
  if silent:
    return silent, sorted(p for p in last_seen if p not in silent)
  if not last_progress:
    return [], []
  first = min(last_progress.values())
  suspects = sorted(p for p, t in last_progress.items() if t - first <= heartbeat_timeout / 2)
  return suspects, sorted(p for p in last_progress if p not in suspects)


def format_hang_view(beats: dict[int, dict], mesh_shape: tuple[int, int, int, int], suspects: list[int],
                     victims: list[int]) -> str:
  """One block per dp replica: rows are pipeline stages (with cp > 1, a row per stage and cp
  rank), columns tensor-parallel ranks. `mesh_shape`: (dp, pp, cp, tp), MESH_AXES' order."""
  dp, pp, cp, tp = mesh_shape
  cells = np.full(mesh_shape, "?", dtype=object)       # a device no beat describes stays "?"
  for process, beat in beats.items():
    mark = "S" if process in suspects else "V" if process in victims else " "
    for device in beat.get("devices", ()):
      coords = tuple(device["coords"])
      if len(coords) == len(mesh_shape) and all(0 <= c < n for c, n in zip(coords, mesh_shape)):
        cells[coords] = f"{mark} p{process} {beat.get('phase', '?')}"
  width = max(len(str(c)) for c in cells.flat)
  rows = [(s, c, f"  pp {s}" + (f" cp {c}" if cp > 1 else "") + ": ") for s in range(pp) for c in range(cp)]
  indent = max(len(label) for *_, label in rows)
  shape = f"dp={dp} x pp={pp}" + (f" x cp={cp}" if cp > 1 else "") + f" x tp={tp}"
  lines = [f"{'3D' if cp == 1 else '4D'} hang view: {shape}; S = suspect (silent or stopped first), "
           "V = victim (alive, waiting on a collective)"]
  for d in range(dp):
    lines.append(f"dp {d}:")
    lines.append(" " * indent + " | ".join(f"tp {t}".ljust(width) for t in range(tp)))
    for s, c, label in rows:
      lines.append(label.ljust(indent) + " | ".join(str(cells[d, s, c, t]).ljust(width) for t in range(tp)))
  hosts = lambda ps: ", ".join(f"process {p} ({beats[p].get('host', '?')}, step {beats[p].get('step')})"  # noqa: E731
                               if p in beats else f"process {p} (no heartbeat)" for p in ps)
  lines.append(f"suspects: {hosts(suspects) or 'none'}")
  lines.append(f"victims: {hosts(victims) or 'none'}")
  return "\n".join(lines)
