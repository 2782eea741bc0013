"""Text corpora into token files (megajax-prepare-data's library): the readers, the tokenizer
choice, and the parallel pass that streams every document into megajax.token_files' writer.

Inputs, by suffix: `.jsonl` and `.jsonl.gz` (one JSON object per line, its `text_field` a
document), `.parquet` (its `text_field` column, one document per row), anything else plain
UTF-8 text (one document per file, or per blank-line-separated block with
documents="blank_line"). Empty documents are dropped; each document's tokens are followed by
the tokenizer's EOS. Files are tokenized in a pool of `workers` processes (one file per task);
the writer takes their results in input order, so the output is the same for any worker
count. Every bad input is a PrepareError with one line naming the file (and the line of a
.jsonl), and nothing is written.
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import itertools
import json
import multiprocessing
import os
import re
import time

from absl import logging
import numpy as np
import pyarrow
import pyarrow.parquet

from megajax.tokenizer import (TokenizerError, check_bpe_vocab_size, load_tokenizer, joined_message, sidecar_entry,
                               train_bpe)
from megajax.token_files import PrepareError, write_token_file

DOCUMENT_MODES = ("file", "blank_line")
BLANK_LINES = re.compile(r"\n(?:[ \t\r]*\n)+")
PROGRESS_SECONDS = 5.0
ENCODE_BATCH = 1024   # documents per encode_batch call


def input_paths(patterns: list[str]) -> list[str]:
  """The files `patterns` match ("**" matches any depth of folders), sorted per pattern (the same
  inputs give the same file)."""
  paths = []
  for pattern in patterns:
    matches = sorted(glob.glob(pattern, recursive=True))   # "**" descends into folders
    if not matches:
      raise PrepareError("input error", f"{pattern!r} matches no file")
    for path in matches:
      if os.path.isdir(path):
        raise PrepareError("input error", f"{path} is a directory; pass its files, e.g. '{path.rstrip('/')}/*.txt'")
      if not os.access(path, os.R_OK):
        raise PrepareError("input error", f"{path} is not readable")
    paths.extend(matches)
  if sum(os.path.getsize(path) for path in paths) == 0:
    raise PrepareError("input error", f"the {len(paths)} input file(s) are empty: no text to tokenize")
  return paths


def check_output(output: str) -> None:
  """`output` can be written: not a directory, its folder creatable and writable."""
  if os.path.isdir(output):
    raise PrepareError("output error",
                       f"{output} is a directory; name the token file, e.g. {output.rstrip('/')}/data.bin")
  folder = os.path.dirname(os.path.abspath(output))
  if os.path.exists(folder) and not os.path.isdir(folder):
    raise PrepareError("output error", f"cannot write {output}: {folder} is a file, not a folder")
  try:
    os.makedirs(folder, exist_ok=True)
  except OSError as error:
    raise PrepareError("output error", f"cannot create the folder {folder}: {error.strerror}") from None
  if not os.access(folder, os.W_OK):
    raise PrepareError("output error", f"cannot write to {folder}")


# Readers: each yields a file's documents as strings, in order.

def read_documents(path: str, documents: str = "file", text_field: str = "text", strict: bool = True):
  """The non-empty documents of one input file. `strict`: plain text must be UTF-8 (the byte
  tokenizer takes any bytes, read as surrogate escapes that encode back to themselves)."""
  if path.endswith((".jsonl", ".jsonl.gz")):
    yield from _jsonl_documents(path, text_field)
  elif path.endswith(".parquet"):
    yield from _parquet_documents(path, text_field)
  else:
    try:
      with open(path, "rb") as f:
        raw = f.read()
    except OSError as error:
      raise PrepareError("input error", f"cannot read {path}: {error.strerror}") from None
    try:
      text = raw.decode("utf-8", "strict" if strict else "surrogateescape")
    except UnicodeDecodeError as error:
      raise PrepareError("input error", f"{path} is not UTF-8 text (byte {error.start}: {error.reason}); "
                         "only --tokenizer=bytes takes any bytes") from None
    for document in (BLANK_LINES.split(text) if documents == "blank_line" else [text]):
      if document.strip() if documents == "blank_line" else document:
        yield document


def _jsonl_documents(path: str, text_field: str):
  opener = gzip.open if path.endswith(".gz") else open
  line_number = 0
  try:
    with opener(path, "rt", encoding="utf-8") as f:
      for line_number, line in enumerate(f, start=1):
        if not line.strip():
          continue
        try:
          row = json.loads(line)
        except ValueError as error:
          raise PrepareError("input error", f"{path}:{line_number} is not JSON ({error})") from None
        if not isinstance(row, dict):
          raise PrepareError("input error", f"{path}:{line_number} holds a {type(row).__name__}, not a JSON object")
        if text_field not in row:
          raise PrepareError("input error", f"{path}:{line_number} has no {text_field!r} field (its fields: "
                             f"{', '.join(map(repr, row)) or 'none'}); name the text with --text-field")
        if not isinstance(text := row[text_field], str):
          raise PrepareError("input error", f"{path}:{line_number} has {text_field}={_short(text)}, not a string")
        if text:
          yield text
  except (OSError, EOFError, UnicodeDecodeError) as error:   # gzip.BadGzipFile is an OSError
    raise PrepareError("input error", f"cannot read {path} (line {line_number + 1}): {joined_message(error)}") from None


def _parquet_documents(path: str, text_field: str):
  try:
    parquet = pyarrow.parquet.ParquetFile(path)
  except (pyarrow.ArrowException, OSError) as error:
    raise PrepareError("input error", f"{path} is not a readable Parquet file ({joined_message(error)})") from None
  schema = parquet.schema_arrow
  if text_field not in schema.names:
    raise PrepareError("input error", f"{path} has no column {text_field!r} (its columns: "
                       f"{', '.join(map(repr, schema.names))}); name the text with --text-field")
  kind = schema.field(text_field).type
  if not (pyarrow.types.is_string(kind) or pyarrow.types.is_large_string(kind)):
    raise PrepareError("input error", f"{path}'s column {text_field!r} holds {kind}, not strings")
  try:
    for batch in parquet.iter_batches(batch_size=ENCODE_BATCH, columns=[text_field]):
      yield from (text for text in batch.column(0).to_pylist() if text)   # null and "" are no document
  except (pyarrow.ArrowException, OSError) as error:
    raise PrepareError("input error", f"cannot read {path} ({joined_message(error)})") from None


# Tokenizing one file (in a worker process, or in this one).

_WORKER = {}


def _start_worker(tokenizer_spec: str, documents: str, text_field: str, eos: bool, dtype: str) -> None:
  _WORKER.update(tokenizer=load_tokenizer(tokenizer_spec), documents=documents, text_field=text_field,
                 eos=eos, dtype=dtype)


def _tokenize_file(path: str) -> tuple[np.ndarray, np.ndarray]:
  """One file's documents as (their tokens back to back, each one's length), EOS included."""
  tokenizer, eos = _WORKER["tokenizer"], _WORKER["eos"]
  reader = read_documents(path, _WORKER["documents"], _WORKER["text_field"], strict=tokenizer.kind != "bytes")
  pieces = []
  while batch := list(itertools.islice(reader, ENCODE_BATCH)):
    try:
      pieces.extend(tokenizer.encode_batch(batch))
    except Exception as error:   # a lone surrogate from a JSON escape, say: the tokenizers raise their own types
      raise PrepareError("input error", f"cannot tokenize a document of {path} ({joined_message(error)})") from None
  if eos:
    pieces = [np.append(piece, np.int32(tokenizer.eos_id)) for piece in pieces]
  lengths = np.array([len(piece) for piece in pieces], dtype=np.int64)
  tokens = np.concatenate(pieces) if pieces else np.zeros(0, np.int32)
  return tokens.astype(_WORKER["dtype"]), lengths


def _tokenized(paths: list[str], workers: int, initargs: tuple):
  """Every file's result, in input order: a pool's imap, or this process for one worker."""
  if workers == 1:
    _start_worker(*initargs)
    yield from map(_tokenize_file, paths)
    return
  # fork: the workers start at once (no re-import); the parent never started a JAX backend, and
  # with TOKENIZERS_PARALLELISM set a tokenizer trained here leaves the children single-threaded, quietly.
  previous = os.environ.get("TOKENIZERS_PARALLELISM")
  os.environ["TOKENIZERS_PARALLELISM"] = "false"
  try:
    pool = multiprocessing.get_context("fork").Pool(workers, _start_worker, initargs)
  finally:
    if previous is None:
      del os.environ["TOKENIZERS_PARALLELISM"]
    else:
      os.environ["TOKENIZERS_PARALLELISM"] = previous
  with pool:
    yield from pool.imap(_tokenize_file, paths)


def _with_progress(results, paths: list[str], stats: dict):
  start = last = time.monotonic()
  for done, (tokens, lengths) in enumerate(results, start=1):
    stats["documents"] += int(np.count_nonzero(lengths))
    stats["tokens"] += int(tokens.size)
    if (now := time.monotonic()) - last >= PROGRESS_SECONDS:
      last = now
      logging.info("%d/%d files, %d documents, %d tokens, %.0f tokens/s (%s)", done, len(paths), stats["documents"],
                   stats["tokens"], stats["tokens"] / (now - start), paths[done - 1])
    yield tokens, lengths


def prepare_text_files(patterns: list[str], output: str, tokenizer: str = "bytes", train_tokenizer: str | None = None,
                       vocab_size: int | None = None, documents: str = "file", text_field: str = "text",
                       eos: bool = True, workers: int | None = None) -> tuple[dict, list[str], dict]:
  """Tokenizes the files `patterns` match into the token file `output` (.bin, .idx, sidecar,
  the tokenizer file beside them). `tokenizer`: "bytes", a tokenizer.json or a sentencepiece
  .model; or `train_tokenizer`="bpe" with `vocab_size`: a byte-level BPE trained on the
  inputs first. Returns (the sidecar's fields, the input paths, {"documents", "tokens",
  "seconds", "workers"}). Raises PrepareError, having written nothing, for any bad input,
  flag, tokenizer or output."""
  start = time.monotonic()
  if train_tokenizer is not None and tokenizer != "bytes":
    raise PrepareError("usage error", "pass --tokenizer or --train-tokenizer, not both")
  if train_tokenizer not in (None, "bpe"):
    raise PrepareError("usage error", f"--train-tokenizer={train_tokenizer}: the one trainer is 'bpe'")
  if (train_tokenizer is None) != (vocab_size is None):
    raise PrepareError("usage error", "--train-tokenizer=bpe and --vocab-size=N go together")
  if documents not in DOCUMENT_MODES:
    raise PrepareError("usage error", f"--documents={documents}: one of {', '.join(DOCUMENT_MODES)}")
  if workers is not None and workers < 1:
    raise PrepareError("usage error", f"--workers={workers}: at least 1")
  try:
    if train_tokenizer is not None:
      check_bpe_vocab_size(vocab_size)
      chosen = None
    else:
      chosen = load_tokenizer(tokenizer)
  except TokenizerError as error:
    raise PrepareError("tokenizer error", str(error)) from None
  paths = input_paths(patterns)
  check_output(output)
  workers = min(len(paths), workers or len(os.sched_getaffinity(0)))
  trained = output[:-len(".bin")] + ".tokenizer.tmp.json"
  with contextlib.ExitStack() as cleanup:
    if chosen is None:
      cleanup.callback(lambda: os.path.exists(trained) and os.remove(trained))
      texts = itertools.chain.from_iterable(read_documents(path, documents, text_field) for path in paths)
      chosen = train_bpe(texts, vocab_size)
      chosen.save(trained)
      chosen.file = trained
      logging.info("trained a byte-level BPE of %d ids in %.1f s", chosen.vocab_size, time.monotonic() - start)
    spec = "bytes" if chosen.kind == "bytes" else chosen.file
    dtype = "uint16" if chosen.vocab_size <= 2**16 else "uint32"
    stats = {"documents": 0, "tokens": 0}
    results = _with_progress(_tokenized(paths, workers, (spec, documents, text_field, eos, dtype)), paths, stats)
    try:
      meta = write_token_file(output, results, chosen.vocab_size, sidecar_entry(chosen, output),
                              chosen.file)
    except OSError as error:
      raise PrepareError("output error", f"cannot write {output}: {error.strerror}") from None
    except ValueError as error:
      if "no tokens" not in str(error):
        raise
      raise PrepareError("input error", f"the {len(paths)} input file(s) hold no text to tokenize") from None
  return meta, paths, dict(stats, seconds=time.monotonic() - start, workers=workers)


def _short(value) -> str:
  text = json.dumps(value)
  return text if len(text) <= 40 else text[:37] + "..."

