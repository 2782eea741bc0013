"""Token files: the file format (tokens, document index, sidecar) and every check a loader makes.

A token file is `NAME.bin`, the raw token ids (uint16, or uint32 for vocabularies over 65536),
`NAME.idx`, the int64 start offset of every document in the token stream (a document is its
tokens followed by its tokenizer's EOS), and a sidecar `NAME.json`, written last:

    {"dtype": "uint16", "vocab_size": 257, "num_tokens": 1048576, "num_documents": 12,
     "checksum": "crc32:1c291ca3", "index": {"file": "NAME.idx", "checksum": "crc32:0a1b2c3d"},
     "tokenizer": {"kind": "bytes", "file": null, "eos_id": 256}}

The checksums are zlib's CRC-32 of the .bin and .idx bytes, computed while writing (1-2 GB/s
here; a corruption check, not a signature). `tokenizer` names the tokenizer that wrote the
ids (megajax/tokenizer.py: "bytes", "huggingface" or "sentencepiece", its file saved beside
the .bin, its end-of-text id); a sidecar without one means bytes. A `.npy` holding one 1-D
integer array also loads; it has no sidecar, so opening it scans it once for its smallest and
largest id.

Opening a file (`TokenFile`) checks the sidecar against the file's size, the index against
num_tokens and num_documents (starts at 0, strictly increasing, below num_tokens) and, when
asked, both checksums (data.verify_checksum: about 1 s per GB at most, docs/data.md);
`document_starts` is the index (for segment ids and positions of packed rows).
`TokenFileSource` reads records of seq_len + 1 tokens and checks each one's largest id (under
a microsecond for 2049 tokens). Every bad file is one line, a ConfigError on data.path that
names the file and what is wrong, never a traceback or silent garbage. Older files still load
with a warning: without a checksum their bytes go unchecked (size, dtype and every id still
are); without an index the document starts are derived from the EOS ids of their tokenizer
(bytes: 256), once, when asked for (a .npy of ids past 256 names no EOS: one document). Text becomes token files in megajax/text_inputs.py
(megajax-prepare-data).
"""
from __future__ import annotations

import functools
import json
import os
import re
import shutil
import zlib

from absl import logging
import numpy as np

from megajax.config_checks import ConfigError

BYTE_VOCAB_SIZE = 257  # Bytes 0..255 and EOS.
EOS = 256
TOKEN_DTYPES = ("uint16", "uint32")
CHECKSUM = r"crc32:[0-9a-f]{8}"    # how a sidecar spells it
DIGEST = r"sha256:[0-9a-f]{64}"    # a tokenizer's content digest (megajax/tokenizer.py)
CHECKSUM_CHUNK_BYTES = 64 << 20   # Hash in pieces: a memory-mapped file is never copied whole.
REWRITE = "rerun megajax-prepare-data to rewrite it"
TOKENIZER_KINDS = ("bytes", "huggingface", "sentencepiece")
BYTES_TOKENIZER = {"kind": "bytes", "file": None, "eos_id": EOS}   # what a sidecar without "tokenizer" means


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


def index_path(path: str) -> str:
  return path[:-len(".bin")] + ".idx"


def checksum(tokens: np.ndarray) -> str:
  """CRC-32 of the array's bytes, as the sidecar spells it."""
  data = memoryview(np.ascontiguousarray(tokens)).cast("B")
  crc = 0
  for start in range(0, len(data), CHECKSUM_CHUNK_BYTES):
    crc = zlib.crc32(data[start:start + CHECKSUM_CHUNK_BYTES], crc)
  return f"crc32:{crc:08x}"


def write_token_file(path: str, documents, vocab_size: int, tokenizer: dict | None = None,
                     tokenizer_file: str | None = None) -> dict:
  """Writes `path` (.bin), its document index (.idx) and its sidecar atomically; returns the
  sidecar's fields.

  `documents` is one array or an iterable of arrays, one per document (EOS included, if any),
  or of pairs (tokens, lengths): several documents back to back, streamed to disk in order;
  an empty document is no document. Tokens are stored as uint16 when
  vocab_size <= 65536. `tokenizer` is the sidecar's "tokenizer" entry (none: no entry, which
  means bytes); `tokenizer_file` is copied to its "file" beside the .bin before the sidecar is
  written. Ids outside [0, vocab_size) and a stream with no token at all are ValueErrors, and
  nothing is written.
  """
  if not path.endswith(".bin"):
    raise ValueError(f"token file path {path!r} must end with .bin")
  dtype = np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)
  if isinstance(documents, np.ndarray):
    documents = [documents]
  folder = os.path.dirname(os.path.abspath(path))
  os.makedirs(folder, exist_ok=True)
  final = {"bin": path, "idx": index_path(path)}
  if tokenizer_file is not None:
    final["tokenizer"] = os.path.join(folder, tokenizer["file"])
  final["meta"] = sidecar_path(path)   # last: a reader never sees a sidecar for missing files
  tmp = {name: target + ".tmp" for name, target in final.items()}
  num_tokens = crc = index_crc = 0
  try:
    with open(tmp["bin"], "wb") as f, open(tmp["idx"], "wb") as index:
      for item in documents:
        tokens, lengths = item if isinstance(item, tuple) else (item, None)
        tokens = np.asarray(tokens).reshape(-1)
        lengths = np.array([tokens.size]) if lengths is None else np.asarray(lengths, np.int64)
        if lengths.sum() != tokens.size:
          raise ValueError(f"document lengths sum to {lengths.sum()}, not to their {tokens.size} tokens")
        if not tokens.size:
          continue
        if tokens.min() < 0 or tokens.max() >= vocab_size:
          raise ValueError(f"token ids must be in [0, {vocab_size}), got [{tokens.min()}, {tokens.max()}]")
        lengths = lengths[lengths > 0]
        starts = (num_tokens + np.concatenate([[0], np.cumsum(lengths)[:-1]])).astype("<i8").tobytes()
        raw = tokens.astype(dtype).tobytes()
        f.write(raw)
        index.write(starts)
        crc, index_crc = zlib.crc32(raw, crc), zlib.crc32(starts, index_crc)
        num_tokens += tokens.size
    if num_tokens == 0:
      raise ValueError(f"no tokens to write to {path}")
    meta = {"dtype": dtype.name, "vocab_size": int(vocab_size), "num_tokens": num_tokens,
            "num_documents": os.path.getsize(tmp["idx"]) // 8, "checksum": f"crc32:{crc:08x}",
            "index": {"file": os.path.basename(final["idx"]), "checksum": f"crc32:{index_crc:08x}"}}
    if tokenizer is not None:
      meta["tokenizer"] = dict(tokenizer)
    if tokenizer_file is not None and not (os.path.exists(final["tokenizer"])
                                           and os.path.samefile(tokenizer_file, final["tokenizer"])):
      shutil.copyfile(tokenizer_file, tmp["tokenizer"])
    with open(tmp["meta"], "w") as f:
      json.dump(meta, f)
    for name, target in final.items():
      if os.path.exists(tmp[name]):
        os.replace(tmp[name], target)
  finally:
    for name in tmp.values():
      if os.path.exists(name):
        os.remove(name)
  return meta


class PrepareError(Exception):
  """Why megajax-prepare-data refuses its inputs, output or flags: `kind` ("input error",
  "output error", "usage error", "tokenizer error") and a one-line message."""

  def __init__(self, kind: str, message: str):
    self.kind = kind
    super().__init__(message)

  def __reduce__(self):   # raised in a worker process, re-raised in the writer
    return (PrepareError, (self.kind, str(self)))


# Reading: every check, each failure one ConfigError on data.path.

def _bad_file(path: str, problem: str, fix: str = REWRITE) -> ConfigError:
  return ConfigError("data.path", path, problem, fix)


class TokenFile:
  """An opened, checked token file: `tokens` (read-only, memory-mapped), `vocab_size` (the sidecar's,
  or max id + 1 for a .npy), `meta` (the sidecar's fields; {} for a .npy), `tokenizer` (the
  sidecar's entry; bytes without one), `document_starts` (int64 start of every document)."""

  def __init__(self, path: str, verify_checksum: bool = True):
    self.path = path
    self._index = None
    if path.endswith(".bin"):
      self.meta = self._read_sidecar()
      self.tokens = self._map_bin()
      self.vocab_size = self.meta["vocab_size"]
      if "index" in self.meta:
        self._index = self._map_index(verify_checksum)
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

  @property
  def tokenizer(self) -> dict:
    return self.meta.get("tokenizer", BYTES_TOKENIZER)

  @functools.cached_property
  def document_starts(self) -> np.ndarray:
    """The int64 start offset of every document: the index, or for files without one (older
    files, a .npy) the token after every EOS of the data's tokenizer, derived once."""
    if self._index is not None:
      return self._index
    if not self.meta and self.vocab_size > BYTE_VOCAB_SIZE:
      # A .npy names no tokenizer; ids past the byte vocabulary say it is not bytes, so 256 is
      # an ordinary token there, not an EOS: cutting at it would mask attention at random.
      logging.warning("%s is a .npy of ids up to %d: not byte tokens, and it names no tokenizer, so no EOS id marks "
                      "its documents: read as one document (no document masking); make it with "
                      "megajax-prepare-data for a document index", self.path, self.vocab_size - 1)
      return np.zeros(1, np.int64)
    eos = self.tokenizer["eos_id"]
    logging.warning("%s has no document index (an older megajax-prepare-data, or a .npy, wrote it): its documents "
                    "are taken to end at each EOS id %d; %s", self.path, eos, REWRITE)
    return starts_after_eos(self.tokens, eos)

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
    if "checksum" in meta and not _is_checksum(meta["checksum"]):
      raise bad("checksum", "not 'crc32:<8 hex digits>'")
    index = meta.get("index")
    if index is not None and not (isinstance(index, dict) and isinstance(index.get("file"), str)
                                  and os.path.basename(index["file"]) == index["file"]
                                  and _is_checksum(index.get("checksum"))):
      raise bad("index", "not {\"file\": <a file name beside it>, \"checksum\": \"crc32:<8 hex digits>\"}")
    if "index" in meta and "num_documents" not in meta:
      raise _bad_file(self.path, f"its sidecar {meta_path} has an index but no 'num_documents'")
    tokenizer = meta.get("tokenizer", BYTES_TOKENIZER)
    if not (isinstance(tokenizer, dict) and tokenizer.get("kind") in TOKENIZER_KINDS
            and (tokenizer.get("file") is None if tokenizer.get("kind") == "bytes"
                 else isinstance(tokenizer.get("file"), str) and os.path.basename(tokenizer["file"]) == tokenizer["file"])
            and type(tokenizer.get("eos_id")) is int and 0 <= tokenizer["eos_id"] < meta["vocab_size"]
            and (tokenizer.get("digest") is None or re.fullmatch(DIGEST, str(tokenizer["digest"])))):
      raise bad("tokenizer", f"not {{\"kind\": one of {', '.join(TOKENIZER_KINDS)}, \"file\": a file name beside it "
                f"(null for bytes), \"eos_id\": an id below vocab_size, \"digest\": \"sha256:<64 hex digits>\" "
                "(optional)}")
    return meta

  def _map_index(self, verify_checksum: bool) -> np.ndarray:
    index_file = os.path.join(os.path.dirname(os.path.abspath(self.path)), self.meta["index"]["file"])
    count = self.meta["num_documents"]
    if not os.path.isfile(index_file):
      raise _bad_file(self.path, f"its document index {index_file} is missing", f"copy it with the data, or {REWRITE}")
    if (size := os.path.getsize(index_file)) != count * 8:
      raise _bad_file(self.path, f"its document index {index_file} holds {size} bytes, not num_documents={count} "
                      "int64 starts: truncated, or not the index of this file")
    starts = np.memmap(index_file, dtype="<i8", mode="r").view(np.ndarray)
    if verify_checksum and (found := checksum(starts)) != self.meta["index"]["checksum"]:
      raise _bad_file(self.path, f"its document index's checksum {found} is not the {self.meta['index']['checksum']} "
                      "its sidecar records: the index changed after it was written or is corrupt",
                      f"copy it again, or {REWRITE}")
    if starts[0] != 0 or (count > 1 and np.any(np.diff(starts) <= 0)) or starts[-1] >= len(self.tokens):
      raise _bad_file(self.path, f"its document index {index_file} is not {count} strictly increasing starts from 0 "
                      f"below num_tokens={len(self.tokens)}", f"the index is corrupt: {REWRITE}")
    return starts

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


def starts_after_eos(tokens: np.ndarray, eos_id: int) -> np.ndarray:
  """The document starts (int64, first 0) of a stream without an index: the token after each EOS."""
  ends = np.flatnonzero(tokens == eos_id) + 1
  return np.concatenate([[0], ends[ends < len(tokens)]]).astype(np.int64)


def _is_checksum(value) -> bool:
  return isinstance(value, str) and re.fullmatch(CHECKSUM, value) is not None


def verify_token_file(path: str) -> dict:
  """Every check a loader makes, on the whole file: the sidecar, the checksums, the document
  index, every id. Returns the sidecar's fields; raises the ConfigError a loader would."""
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
    self.tokenizer = self.file.tokenizer
    if len(self.tokens) < seq_len + 1:
      raise ConfigError("data.path", path, f"has {len(self.tokens)} tokens, fewer than one record "
                        f"of model.seq_len + 1 = {seq_len + 1}", "use more text or a shorter model.seq_len")

  @property
  def document_starts(self) -> np.ndarray:
    return self.file.document_starts

  def __len__(self) -> int:
    return (len(self.tokens) - 1) // self.seq_len

  def __getitem__(self, index: int) -> np.ndarray:
    start = int(index) * self.seq_len
    window = self.tokens[start:start + self.seq_len + 1]
    # On the stored dtype, before int32: a uint32 id >= 2**31 would wrap to a negative.
    self.file.check_ids(window, start, f"record {index}")
    return np.asarray(window, dtype=np.int32)

