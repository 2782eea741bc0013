"""Tokenizes text files into a megajax token file (.bin + .json sidecar), offline, byte-level;
or checks one.

  megajax-prepare-data --input 'books/*.txt' --input notes.md --output data/books.bin
  megajax-prepare-data --verify data/books.bin      # sidecar, checksum and every id, once

Then train with the printed overrides, e.g.
  --config.data.source=tokens --config.data.path=data/books.bin --config.model.vocab_size=257

A glob matching nothing, a directory, inputs with no text, an output that cannot be written,
or a bad file to verify: one line `megajax-prepare-data: <kind>: <message>`, exit code 2.
"""

from absl import app
from absl import flags

from megajax.config import ConfigError
from megajax.launch.cli import fail, flags_parser
from megajax.token_files import BYTE_VOCAB_SIZE, PrepareError, prepare_text_files, verify_token_file

PROGRAM = "megajax-prepare-data"
_INPUT = flags.DEFINE_multi_string("input", None, "Text file or glob; repeat for more.")
_OUTPUT = flags.DEFINE_string("output", None, "Token file to write; must end with .bin.")
_EOS = flags.DEFINE_bool("eos", True, "Append the EOS token after each file.")
_VERIFY = flags.DEFINE_string("verify", None, "Check this token file (sidecar, checksum, every id) and exit.")


def main(argv):
  if len(argv) > 1:
    fail(PROGRAM, "usage error", f"unexpected arguments: {' '.join(argv[1:])}")
  if _VERIFY.value:
    try:
      meta = verify_token_file(_VERIFY.value)
    except ConfigError as error:
      fail(PROGRAM, "bad token file", error)
    print(f"{_VERIFY.value}: ok: {meta}")
    return
  if not _INPUT.value:
    fail(PROGRAM, "usage error", "pass at least one --input (or --verify=FILE)")
  if not _OUTPUT.value or not _OUTPUT.value.endswith(".bin"):
    fail(PROGRAM, "usage error", "--output must be a path ending with .bin")
  try:
    meta, paths = prepare_text_files(_INPUT.value, _OUTPUT.value, _EOS.value)
  except PrepareError as error:
    fail(PROGRAM, error.kind, error)
  print(f"wrote {meta['num_tokens']} tokens, {meta['num_documents']} document(s) from {len(paths)} file(s), "
        f"to {_OUTPUT.value} ({meta['checksum']})")
  print(f"train with: --config.data.source=tokens --config.data.path={_OUTPUT.value} "
        f"--config.model.vocab_size={BYTE_VOCAB_SIZE}")


def run():
  app.run(main, flags_parser=flags_parser(PROGRAM))


if __name__ == "__main__":
  run()
