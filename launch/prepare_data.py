"""Tokenizes text files into a megajax token file (.bin + .json), offline, byte-level.

  megajax-prepare-data --input 'books/*.txt' --input notes.md --output data/books.bin

Then train with the printed overrides, e.g.
  --config.data.source=tokens --config.data.path=data/books.bin --config.model.vocab_size=257
"""

import glob

from absl import app
from absl import flags
import numpy as np

from megajax import data

_INPUT = flags.DEFINE_multi_string("input", None, "Text file or glob; repeat for more.")
_OUTPUT = flags.DEFINE_string("output", None, "Token file to write; must end with .bin.")
_EOS = flags.DEFINE_bool("eos", True, "Append the EOS token after each file.")


def _expand(patterns):
  paths = []
  for pattern in patterns:
    matches = sorted(glob.glob(pattern))  # Sorted: the same inputs give the same file.
    if not matches:
      raise app.UsageError(f"--input={pattern!r} matches no file")
    paths.extend(matches)
  return paths


def _file_tokens(paths, eos: bool):
  for path in paths:
    with open(path, "rb") as f:
      # Byte-level: the raw bytes are the tokens, so no decode/encode round trip.
      tokens = np.frombuffer(f.read(), dtype=np.uint8)
    yield tokens
    if eos:
      yield np.array([data.EOS], dtype=np.int32)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not _INPUT.value:
    raise app.UsageError("pass at least one --input")
  if not _OUTPUT.value or not _OUTPUT.value.endswith(".bin"):
    raise app.UsageError("--output must be a path ending with .bin")
  paths = _expand(_INPUT.value)
  num_tokens = data.write_token_file(_OUTPUT.value, _file_tokens(paths, _EOS.value), data.BYTE_VOCAB_SIZE)
  print(f"wrote {num_tokens} tokens from {len(paths)} files to {_OUTPUT.value}")
  print(f"train with: --config.data.source=tokens --config.data.path={_OUTPUT.value} "
        f"--config.model.vocab_size={data.BYTE_VOCAB_SIZE}")


def run():
  app.run(main)


if __name__ == "__main__":
  run()
