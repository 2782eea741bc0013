"""The JSON-lines files a run leaves, read strictly: unlike megajax.observe.records.read_jsonl
(which skips the half line a killed writer leaves), every line must parse, so a half line
that survived a resume fails the test."""

import json

from megajax.observe.records import INCIDENTS, METRICS


def jsonl(path) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f.read().splitlines()]


def metrics(workdir) -> list[dict]:
  return jsonl(workdir / METRICS)


def incidents(workdir) -> list[dict]:
  """The supervisor's incidents.jsonl; none yet: []."""
  path = workdir / INCIDENTS
  return jsonl(path) if path.exists() else []
