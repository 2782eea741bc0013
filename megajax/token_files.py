"""Token files: text -> tokens (byte-level), the file format, and every check a loader makes.

A token file is `NAME.bin`, the raw token ids (uint16, or uint32 for vocabularies over 65536),
with a sidecar `NAME.json` that megajax-prepare-data writes after the tokens:

    {"dtype": "uint16", "vocab_size": 257, "num_tokens": 1048576, "num_documents": 12,
     "checksum": "crc32:1c291ca3"}

The checksum is zlib's CRC-32 of the .bin bytes, computed while writing (1-2 GB/s here; a
corruption check, not a signature). A `.npy` holding one 1-D integer array also loads; it
has no sidecar, so opening it scans it once for its smallest and largest id.

Opening a file (`TokenFile`) checks the sidecar against the file's size and, when asked, the
checksum (data.verify_checksum: about 1 s per GB at most, docs/data.md); `TokenFileSource`
reads records of seq_len + 1 tokens and checks each one's largest id (under a microsecond for
2049 tokens). Every bad file is one line, a ConfigError on
data.path that names the file and what is wrong, never a traceback or silent garbage.
Sidecars written before the checksum and the document count still load (a warning says the
bytes go unchecked): their size, dtype and every id are still checked.
"""

from __future__ import annotations

import glob
import json
import os
import re
import zlib

from absl import logging
import numpy as np

from megajax.config_checks import ConfigError

BYTE_VOCAB_SIZE = 257  # Bytes 0..255 and EOS.
EOS = 256
TOKEN_DTYPES = ("uint16", "uint32")
CHECKSUM = r"crc32:[0-9a-f]{8}"    # how a sidecar spells it
CHECKSUM_CHUNK_BYTES = 64 << 20   # Hash in pieces: a memory-mapped file is never copied whole.
REWRITE = "rerun megajax-prepare-data to rewrite it"


# Byte-level tokenizer: no vocabulary file, works offline, every text encodes.

def encode_text(text: str) -> np.ndarray:
  """UTF-8 bytes of `text` as int32 token ids in [0, 256)."""
  return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


def decode_tokens(tokens) -> str:
  """Inverse of encode_text. EOS and any id >= 256 are dropped; broken UTF-8 becomes U+FFFD."""
  tokens = np.asarray(tokens).reshape(-1)
  return tokens[tokens < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


# Writing.

def sidecar_path(path: str) -> str:
  return path[:-len(".bin")] + ".json"


def checksum(tokens: np.ndarray) -> str:
  """CRC-32 of the array's bytes, as the sidecar spells it."""
  data = memoryview(np.ascontiguousarray(tokens)).cast("B")
  crc = 0
  for start in range(0, len(data), CHECKSUM_CHUNK_BYTES):
    crc = zlib.crc32(data[start:start + CHECKSUM_CHUNK_BYTES], crc)
  return f"crc32:{crc:08x}"


def write_token_file(path: str, documents, vocab_size: int) -> dict:
  """Writes `path` (.bin) and its sidecar atomically; returns the sidecar's fields.

  `documents` is one array or an iterable of arrays, one per document, streamed to disk in
  order. Tokens are stored as uint16 when vocab_size <= 65536. Ids outside [0, vocab_size)
  and a stream with no token at all are ValueErrors, and nothing is written.
  """
  if not path.endswith(".bin"):
    raise ValueError(f"token file path {path!r} must end with .bin")
  dtype = np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)
  if isinstance(documents, np.ndarray):
    documents = [documents]
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp_bin, tmp_meta = path + ".tmp", sidecar_path(path) + ".tmp"
  num_tokens = num_documents = crc = 0
  try:
    with open(tmp_bin, "wb") as f:
      for tokens in documents:
        tokens = np.asarray(tokens).reshape(-1)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
          raise ValueError(f"token ids must be in [0, {vocab_size}), got [{tokens.min()}, {tokens.max()}]")
        raw = tokens.astype(dtype).tobytes()
        f.write(raw)
        crc = zlib.crc32(raw, crc)
        num_tokens += tokens.size
        num_documents += 1
    if num_tokens == 0:
      raise ValueError(f"no tokens to write to {path}")
    meta = {"dtype": dtype.name, "vocab_size": int(vocab_size), "num_tokens": num_tokens,
            "num_documents": num_documents, "checksum": f"crc32:{crc:08x}"}
    with open(tmp_meta, "w") as f:
      json.dump(meta, f)
    # Tokens first, then the sidecar: a reader never sees a sidecar for missing tokens.
    os.replace(tmp_bin, path)
    os.replace(tmp_meta, sidecar_path(path))
  finally:
    for tmp in (tmp_bin, tmp_meta):
      if os.path.exists(tmp):
        os.remove(tmp)
  return meta


class PrepareError(Exception):
  """Why megajax-prepare-data refuses its inputs or output: `kind` ("input error", "output
  error") and a one-line message."""

  def __init__(self, kind: str, message: str):
    self.kind = kind
    super().__init__(message)


def prepare_text_files(patterns: list[str], output: str, eos: bool = True) -> tuple[dict, list[str]]:
  """Tokenizes the files `patterns` match (sorted per pattern: the same inputs give the same
  file) into the token file `output`, one document per non-empty file, EOS after each when
  `eos`. Returns (the sidecar's fields, the input paths). Raises PrepareError, having written
  nothing, for a pattern matching no file, a directory, an unreadable file, inputs with no
  text, an output that is a directory or cannot be written."""
  paths = []
  for pattern in patterns:
    matches = sorted(glob.glob(pattern))
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
  try:
    meta = write_token_file(output, _documents(paths, eos), BYTE_VOCAB_SIZE)
  except OSError as error:
    raise PrepareError("output error", f"cannot write {output}: {error.strerror}") from None
  return meta, paths


def _documents(paths: list[str], eos: bool):
  for path in paths:
    try:
      with open(path, "rb") as f:
        text = f.read()
    except OSError as error:
      raise PrepareError("input error", f"cannot read {path}: {error.strerror}") from None
    if text:   # Byte-level: the raw bytes are the tokens, no decode / encode round trip.
      tokens = np.frombuffer(text, dtype=np.uint8).astype(np.uint16)
      yield np.append(tokens, np.uint16(EOS)) if eos else tokens


# Reading: every check, each failure one ConfigError on data.path.

def _bad_file(path: str, problem: str, fix: str = REWRITE) -> ConfigError:
  return ConfigError("data.path", path, problem, fix)


class TokenFile:
  """An opened, checked token file: `tokens` (read-only, memory-mapped), `vocab_size` (the sidecar's,
  or max id + 1 for a .npy), `meta` (the sidecar's fields; {} for a .npy)."""

  def __init__(self, path: str, verify_checksum: bool = True):
    self.path = path
    if path.endswith(".bin"):
      self.meta = self._read_sidecar()
      self.tokens = self._map_bin()
      self.vocab_size = self.meta["vocab_size"]
      if verify_checksum and "checksum" in self.meta:
        found = checksum(self.tokens)
        if found != self.meta["checksum"]:
          raise _bad_file(path, f"its tokens' checksum {found} is not the {self.meta['checksum']} its sidecar "
                          "records: the file changed after it was written or is corrupt",
                          f"copy it again, or {REWRITE}")
      elif "checksum" not in self.meta:
        logging.warning("%s has no checksum (an older megajax-prepare-data wrote it): its size and ids are "
                        "checked, its bytes are not; %s", path, REWRITE)
    elif path.endswith(".npy"):
      self.meta, self.tokens = {}, self._map_npy()
      self.vocab_size = int(self.tokens.max()) + 1
    else:
      raise _bad_file(path, "not a .bin or .npy token file", "make one with megajax-prepare-data")

  def check_ids(self, window: np.ndarray, start: int, what: str) -> None:
    """`window` (the tokens from `start`, named `what` in the error) holds no id >= vocab_size.
    One max, no min: .bin ids are unsigned, and opening a .npy refused its negative ids."""
    if (high := window.max()) >= self.vocab_size:
      raise _bad_file(self.path, f"{what} holds the id {high} (token {start + int(np.argmax(window))}), outside "
                      f"[0, {self.vocab_size}) of its {'sidecar' if self.meta else 'array'}",
                      f"the file is corrupt: {REWRITE}")

  def _read_sidecar(self) -> dict:
    meta_path = sidecar_path(self.path)
    if not os.path.isfile(meta_path):
      raise _bad_file(self.path, f"no sidecar {meta_path} with its dtype, vocab_size and num_tokens",
                      "make the file with megajax-prepare-data")
    try:
      with open(meta_path, encoding="utf-8") as f:
        meta = json.load(f)
    except (ValueError, OSError) as error:   # JSONDecodeError and UnicodeDecodeError are ValueErrors
      raise _bad_file(self.path, f"its sidecar {meta_path} is not readable JSON ({error})") from None
    if not isinstance(meta, dict):
      raise _bad_file(self.path, f"its sidecar {meta_path} holds {type(meta).__name__}, not a JSON object")

    def bad(field, problem):
      return _bad_file(self.path, f"its sidecar {meta_path} has {field}={meta.get(field)!r}: {problem}")

    for field in ("dtype", "vocab_size", "num_tokens"):
      if field not in meta:
        raise _bad_file(self.path, f"its sidecar {meta_path} has no {field!r}")
    if meta["dtype"] not in TOKEN_DTYPES:
      raise bad("dtype", f"not one of {', '.join(TOKEN_DTYPES)}")
    for field in ("vocab_size", "num_tokens", "num_documents"):
      if field in meta and not (type(meta[field]) is int and meta[field] >= 1):   # bool is no count
        raise bad(field, "must be a positive integer")
    if meta["vocab_size"] > np.iinfo(meta["dtype"]).max + 1:
      raise bad("vocab_size", f"more ids than {meta['dtype']} holds")
    if "checksum" in meta and not (isinstance(meta["checksum"], str) and re.fullmatch(CHECKSUM, meta["checksum"])):
      raise bad("checksum", "not 'crc32:<8 hex digits>'")
    return meta

  def _map_bin(self) -> np.ndarray:
    size, dtype, count = os.path.getsize(self.path), np.dtype(self.meta["dtype"]), self.meta["num_tokens"]
    if size == 0:
      raise _bad_file(self.path, "is empty (0 bytes)")
    if size % dtype.itemsize:
      raise _bad_file(self.path, f"holds {size} bytes, not a whole number of {dtype.name} tokens: truncated, or "
                      "not the file its sidecar describes")
    if size != count * dtype.itemsize:
      other = np.dtype(TOKEN_DTYPES[1 - TOKEN_DTYPES.index(dtype.name)])
      why = (f"its sidecar's dtype={dtype.name} is wrong: the size fits {count} {other.name} tokens"
             if size == count * other.itemsize else "truncated, or not the file its sidecar describes")
      raise _bad_file(self.path, f"holds {size // dtype.itemsize} {dtype.name} tokens ({size} bytes) but its "
                      f"sidecar says num_tokens={count}: {why}")
    # A plain ndarray over the mapping: numpy's memmap subclass makes every record's slice
    # and max about 4x slower (10 us against 2.5 us for 2049 tokens).
    return np.memmap(self.path, dtype=dtype, mode="r").view(np.ndarray)

  def _map_npy(self) -> np.ndarray:
    try:
      tokens = np.load(self.path, mmap_mode="r")
    except (ValueError, OSError, EOFError) as error:   # empty, garbage, pickled objects
      raise _bad_file(self.path, f"is not a readable .npy array ({error})",
                      "save a 1-D integer token array with numpy.save, or use megajax-prepare-data") from None
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
      raise _bad_file(self.path, f"holds a {tokens.dtype} array of shape {tokens.shape}",
                      "save a 1-D integer token array")
    if tokens.size == 0:
      raise _bad_file(self.path, "holds no tokens", "save a non-empty token array")
    if (low := tokens.min()) < 0:
      raise _bad_file(self.path, f"holds the negative id {low} (token {int(np.argmin(tokens))})",
                      "token ids are in [0, vocab_size): fix the array")
    return tokens.view(np.ndarray)


def verify_token_file(path: str) -> dict:
  """Every check a loader makes, on the whole file: the sidecar, the checksum, every id.
  Returns the sidecar's fields; raises the ConfigError a loader would."""
  token_file = TokenFile(path, verify_checksum=True)
  if "checksum" not in token_file.meta and path.endswith(".bin"):
    raise _bad_file(path, "has no checksum to verify (an older megajax-prepare-data wrote it)", REWRITE)
  step = CHECKSUM_CHUNK_BYTES // token_file.tokens.itemsize
  for start in range(0, len(token_file.tokens), step):
    token_file.check_ids(token_file.tokens[start:start + step], start, f"the tokens from {start}")
  return dict(token_file.meta, num_tokens=len(token_file.tokens), vocab_size=token_file.vocab_size)


class TokenFileSource:
  """Records of seq_len + 1 tokens at stride seq_len over a token file (grain's random-access
  source: `__len__`, `__getitem__`). Each record's ids are checked as it is read."""

  def __init__(self, path: str, seq_len: int, verify_checksum: bool = True):
    self.file, self.seq_len = TokenFile(path, verify_checksum), seq_len
    self.path, self.tokens, self.vocab_size = path, self.file.tokens, self.file.vocab_size
    if len(self.tokens) < seq_len + 1:
      raise ConfigError("data.path", path, f"has {len(self.tokens)} tokens, fewer than one record "
                        f"of model.seq_len + 1 = {seq_len + 1}", "use more text or a shorter model.seq_len")

  def __len__(self) -> int:
    return (len(self.tokens) - 1) // self.seq_len

  def __getitem__(self, index: int) -> np.ndarray:
    start = int(index) * self.seq_len
    window = self.tokens[start:start + self.seq_len + 1]
    # On the stored dtype, before int32: a uint32 id >= 2**31 would wrap to a negative.
    self.file.check_ids(window, start, f"record {index}")
    return np.asarray(window, dtype=np.int32)

