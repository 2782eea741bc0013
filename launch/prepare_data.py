"""Tokenizes text corpora into a megajax token file (.bin + .idx document index + .json
sidecar, the tokenizer file beside them), offline; or checks one.

  megajax-prepare-data --input 'books/*.txt' --input notes.md --output data/books.bin   # bytes
  megajax-prepare-data --input 'web/*.jsonl.gz' --text-field=text --tokenizer=gpt2/tokenizer.json \
      --output data/web.bin
  megajax-prepare-data --input 'wiki/*.parquet' --train-tokenizer=bpe --vocab-size=32768 \
      --output data/wiki.bin                     # trains a byte-level BPE: data/wiki.tokenizer.json
  megajax-prepare-data --input corpus.txt --documents=blank_line --tokenizer=spm.model --output d.bin
  megajax-prepare-data --verify data/books.bin   # sidecar, checksums, document index, every id

Then train with the printed overrides, e.g.
  --config.data.source=tokens --config.data.path=data/books.bin --config.model.vocab_size=257

A glob matching nothing, a directory, inputs with no text, a bad row or file, a tokenizer
that does not load, conflicting flags, an output that cannot be written, or a bad file to
verify: one line `megajax-prepare-data: <kind>: <message>`, exit code 2, nothing written.
"""

from absl import app
from absl import flags

from megajax.config import ConfigError
from megajax.launch.cli import fail, flags_parser
from megajax.text_inputs import DOCUMENT_MODES, prepare_text_files
from megajax.token_files import PrepareError, verify_token_file

PROGRAM = "megajax-prepare-data"
_INPUT = flags.DEFINE_multi_string("input", None, "Input file or glob (.txt and any other text, .jsonl, "
                                   ".jsonl.gz, .parquet); repeat for more.")
_OUTPUT = flags.DEFINE_string("output", None, "Token file to write; must end with .bin.")
_EOS = flags.DEFINE_bool("eos", True, "Append the tokenizer's EOS after each document.")
_VERIFY = flags.DEFINE_string("verify", None, "Check this token file (sidecar, checksums, document index, every id) "
                              "and exit.")
_TOKENIZER = flags.DEFINE_string("tokenizer", "bytes", "'bytes' (UTF-8 bytes, vocab 257), a Hugging Face "
                                 "tokenizer.json, or a sentencepiece .model file.")
_TRAIN = flags.DEFINE_string("train-tokenizer", None, "'bpe': train a byte-level BPE on the inputs (with "
                             "--vocab-size), saved beside the output as NAME.tokenizer.json.")
_VOCAB = flags.DEFINE_integer("vocab-size", None, "Vocabulary of the BPE that --train-tokenizer trains.")
_DOCUMENTS = flags.DEFINE_string("documents", "file", "Plain text: one document per 'file', or per 'blank_line'-"
                                 "separated block.")
_TEXT_FIELD = flags.DEFINE_string("text-field", "text", "The text of a .jsonl row or a .parquet column.")
_WORKERS = flags.DEFINE_integer("workers", None, "Processes tokenizing files (default: min(CPUs, files)).")


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
  if _DOCUMENTS.value not in DOCUMENT_MODES:
    fail(PROGRAM, "usage error", f"--documents={_DOCUMENTS.value}: one of {', '.join(DOCUMENT_MODES)}")
  if _TRAIN.value is not None and flags.FLAGS["tokenizer"].present:
    fail(PROGRAM, "usage error", "pass --tokenizer or --train-tokenizer, not both")
  try:
    meta, paths, stats = prepare_text_files(
        _INPUT.value, _OUTPUT.value, tokenizer=_TOKENIZER.value, train_tokenizer=_TRAIN.value,
        vocab_size=_VOCAB.value, documents=_DOCUMENTS.value, text_field=_TEXT_FIELD.value, eos=_EOS.value,
        workers=_WORKERS.value)
  except PrepareError as error:
    fail(PROGRAM, error.kind, error)
  tokenizer = meta["tokenizer"]
  print(f"wrote {meta['num_tokens']} tokens, {meta['num_documents']} document(s) from {len(paths)} file(s), "
        f"to {_OUTPUT.value} ({meta['checksum']}); tokenizer {tokenizer['kind']}"
        f"{' ' + tokenizer['file'] if tokenizer['file'] else ''}, vocab {meta['vocab_size']}, EOS {tokenizer['eos_id']}")
  print(f"{stats['documents']} documents, {stats['tokens']} tokens in {stats['seconds']:.2f} s "
        f"({stats['tokens'] / max(stats['seconds'], 1e-9):.0f} tokens/s, {stats['workers']} worker(s))")
  print(f"train with: --config.data.source=tokens --config.data.path={_OUTPUT.value} "
        f"--config.model.vocab_size={meta['vocab_size']}")


def run():
  app.run(main, flags_parser=flags_parser(PROGRAM))


if __name__ == "__main__":
  run()
