"""The run's JSON-lines files in WORKDIR, one place for their names, writing and reading.

  metrics.jsonl      training metrics: one record per logged step, plus a record per
                     checkpoint save ({"step", "ckpt_blocking_s"}, {"step", "ckpt_total_s"})
                     and per start ({"step", "startup_s", ...})   (written by metrics.MetricsWriter)
  activations.jsonl  captured activation statistics, one record per (step, point)  (probes.ActivationLog)
  incidents.jsonl    the supervisor's incidents, one per failure  (megajax.launch.supervisor)

Every record has a "step" (incidents: "last_step"). A run that resumes from the checkpoint
of step n first drops the records of steps after n (`drop_after`): a restart re-runs those
steps, so a file holds each step's records once, from the trajectory the run kept. Readers
skip a line that does not parse: a process killed mid-write leaves half a line at the end.
"""

from __future__ import annotations

import json
import os
import threading

METRICS = "metrics.jsonl"
ACTIVATIONS = "activations.jsonl"
INCIDENTS = "incidents.jsonl"


def read_jsonl(path: str) -> list[dict]:
  """The JSON objects of a .jsonl file, in order; a line that does not parse is skipped."""
  records = []
  with open(path) as f:
    for line in f:
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        continue
      if isinstance(record, dict):
        records.append(record)
  return records


def append_jsonl(path: str, records: list[dict]) -> None:
  with open(path, "a") as f:
    f.writelines(json.dumps(record) + "\n" for record in records)


def drop_after(path: str, step: int) -> int:
  """Rewrites `path` (atomically) without the records of steps after `step`, and without
  half lines; returns how many records were dropped. A missing file stays missing."""
  if not os.path.exists(path):
    return 0
  records = read_jsonl(path)
  kept = [r for r in records if not isinstance(r.get("step"), int) or r["step"] <= step]
  write_atomically(path, "".join(json.dumps(record) + "\n" for record in kept))
  return len(records) - len(kept)


def write_atomically(path: str, text: str) -> None:
  """`text` as the whole of `path`: a reader sees the old file or the new one, never half. The
  temporary file is this writer's own (process and thread), beside `path`."""
  temporary = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
  with open(temporary, "w") as f:
    f.write(text)
  os.replace(temporary, path)
