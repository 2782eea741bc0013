"""Reading a W&B run's local file (WORKDIR/wandb/*/run-<id>.wandb, written in offline mode) the
way `wandb sync` does: a LevelDB-style log (a 7-byte header, then 32 KiB blocks of records, each
with a 7-byte header: checksum, length, type full / first / middle / last) of protobuf Records."""

import json
import struct

from wandb.proto import wandb_internal_pb2

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path) -> list:
  """The file's wandb_internal_pb2.Record messages, in order."""
  data = open(path, "rb").read()
  assert data[:4] == b":W&B", path
  position, fragments, out = HEADER, b"", []
  while position + HEADER <= len(data):
    left = BLOCK - position % BLOCK
    if left < HEADER:                  # a block's tail too short for a header: padding
      position += left
      continue
    _, length, kind = struct.unpack("<IHB", data[position:position + HEADER])
    if length == 0 and kind == 0:      # zero padding at the block's end
      position += left
      continue
    payload = data[position + HEADER:position + HEADER + length]
    position += HEADER + length
    fragments = payload if kind in (FULL, FIRST) else fragments + payload
    if kind in (FULL, LAST):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(fragments)
      out.append(record)
  return out


def history(path) -> list[dict]:
  """The logged rows: {key: value} each."""
  return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
          for r in records(path) if r.WhichOneof("record_type") == "history"]


def config(path) -> dict:
  """The run's config as the run record holds it: {top-level key: value}."""
  for r in records(path):
    if r.WhichOneof("record_type") == "run":
      return {item.key: json.loads(item.value_json) for item in r.run.config.update}
  return {}
