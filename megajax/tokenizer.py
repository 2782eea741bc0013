"""Tokenizers for megajax-prepare-data, and the tokenizer a token file travels with.

One small interface over three kinds, all offline:

    tok = load_tokenizer("bytes")                     # UTF-8 bytes, vocab 257, EOS 256 (the default)
    tok = load_tokenizer("path/tokenizer.json")       # a Hugging Face `tokenizers` file
    tok = load_tokenizer("path/spm.model")            # a sentencepiece model
    tok = train_bpe(texts, vocab_size=8192)           # byte-level BPE trained on the inputs
    ids = tok.encode(text)                            # int32 ids, no special tokens added
    text = tok.decode(ids)
    tok.vocab_size, tok.eos_id, tok.kind, tok.file    # file: where it was loaded from (None: bytes)

A document's end is the tokenizer's end-of-text id: 256 for bytes, `<|endoftext|>` (or
`<|end_of_text|>`, `</s>`, `<eos>`) of a tokenizer.json, the model's eos of a sentencepiece
model. A token file's sidecar names its tokenizer (`{"kind", "file", "eos_id"}`, the file
saved beside the .bin; no entry means bytes): `tokenizer_of(data_path)` loads it, and
`copy_tokenizer(data_path, dest_dir)` copies it (into a run's workdir, say). Every bad
tokenizer is one line: a TokenizerError from load_tokenizer / train_bpe, a ConfigError on
data.path from tokenizer_of / copy_tokenizer.

A tokenizer is identified by its content, not its kind and size: two BPEs of one vocabulary
size trained on different corpora give the same id to different tokens. `file_digest` is the
SHA-256 of a tokenizer.json's canonical JSON (key order and spacing do not count) or of a
.model's bytes; the sidecar stores it ("digest"), and `identity(data_path)` ({"kind",
"eos_id", "digest"}) is what token files read together, a run and its resumption, and a run
and its readers must share. A run records its own in WORKDIR/tokenizer.identity.json
(`record_run_identity`); `workdir_tokenizer` checks the copy in WORKDIR/tokenizer/ against it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np
import sentencepiece
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from megajax.config_checks import ConfigError
from megajax.token_files import BYTE_VOCAB_SIZE, EOS, TokenFile

EOS_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")   # looked up in this order
BPE_EOS = "<|endoftext|>"
BPE_MIN_VOCAB = BYTE_VOCAB_SIZE + 1   # the 256 byte symbols, the end-of-text token, one merge
BPE_MAX_VOCAB = 1 << 20               # beyond any real vocabulary: a typo
SUFFIXES = {"huggingface": ".tokenizer.json", "sentencepiece": ".tokenizer.model"}
BYTES_DIGEST = "bytes"                # the byte tokenizer has no file: its kind is its content
RUN_IDENTITY = "tokenizer.identity.json"   # in a workdir: the tokenizer the run trains with


class TokenizerError(ValueError):
  """A tokenizer that cannot be loaded or trained; the message is one line."""


class ByteTokenizer:
  """UTF-8 bytes: ids 0..255, EOS 256. Text read with errors="surrogateescape" encodes back to
  its raw bytes, so a file that is not UTF-8 is still stored exactly."""

  kind, vocab_size, eos_id, file = "bytes", BYTE_VOCAB_SIZE, EOS, None

  def encode(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8", "surrogateescape"), dtype=np.uint8).astype(np.int32)

  def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
    return [self.encode(text) for text in texts]

  def decode(self, ids) -> str:
    ids = np.asarray(ids).reshape(-1)
    return ids[ids < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class HuggingFaceTokenizer:
  """A `tokenizers.Tokenizer` (a tokenizer.json, or a BPE trained here)."""

  kind = "huggingface"

  def __init__(self, tokenizer, file: str | None, eos_id: int | None = None):
    self.tokenizer, self.file = tokenizer, file
    # One past the largest id, not the count of tokens: a tokenizer.json's ids may have holes
    # (an added token numbered past the vocabulary), and every id must be below vocab_size.
    self.vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    if eos_id is None:
      eos_id = next((tokenizer.token_to_id(t) for t in EOS_TOKENS if tokenizer.token_to_id(t) is not None), None)
    if eos_id is None:
      raise TokenizerError(f"{file} has no end-of-text token (none of {', '.join(EOS_TOKENS)}): documents need one "
                           "to be separated; add one to the tokenizer")
    self.eos_id = int(eos_id)

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int32)

  def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
    return [np.asarray(e.ids, dtype=np.int32) for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

  def decode(self, ids) -> str:
    return self.tokenizer.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=False)

  def save(self, path: str) -> None:
    self.tokenizer.save(path)


class SentencePieceTokenizer:
  """A sentencepiece model (.model); no BOS / EOS added by encode."""

  kind = "sentencepiece"

  def __init__(self, processor, file: str):
    self.processor, self.file = processor, file
    self.vocab_size = processor.get_piece_size()
    if processor.eos_id() < 0:
      raise TokenizerError(f"{file} has no end-of-text piece (its eos_id is -1): train it with eos_id >= 0")
    self.eos_id = processor.eos_id()

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self.processor.encode(text), dtype=np.int32)

  def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
    return [np.asarray(ids, dtype=np.int32) for ids in self.processor.encode(texts)]

  def decode(self, ids) -> str:
    return self.processor.decode([int(i) for i in np.asarray(ids).reshape(-1)])


def load_tokenizer(spec: str):
  """"bytes", a tokenizer.json (any name ending in .json) or a sentencepiece .model."""
  if spec == "bytes":
    return ByteTokenizer()
  if not spec.endswith((".json", ".model")):
    raise TokenizerError(f"--tokenizer={spec}: expected 'bytes', a Hugging Face tokenizer.json or a sentencepiece "
                         ".model file")
  if not os.path.isfile(spec):
    raise TokenizerError(f"no tokenizer file {spec}")
  if spec.endswith(".json"):
    try:
      return HuggingFaceTokenizer(Tokenizer.from_file(spec), spec)
    except Exception as error:   # tokenizers raises plain Exceptions for every parse failure
      raise TokenizerError(f"{spec} is not a Hugging Face tokenizer.json ({joined_message(error)})") from None
  processor = sentencepiece.SentencePieceProcessor()
  try:
    processor.Load(spec)
  except Exception as error:   # OSError or RuntimeError, by version
    raise TokenizerError(f"{spec} is not a sentencepiece model ({joined_message(error)})") from None
  return SentencePieceTokenizer(processor, spec)


def check_bpe_vocab_size(vocab_size: int) -> None:
  if not BPE_MIN_VOCAB <= vocab_size <= BPE_MAX_VOCAB:
    raise TokenizerError(f"--vocab-size={vocab_size}: a byte-level BPE needs {BPE_MIN_VOCAB} to {BPE_MAX_VOCAB} "
                         f"(256 bytes + {BPE_EOS} + at least one merge)")


def train_bpe(texts, vocab_size: int) -> HuggingFaceTokenizer:
  """A byte-level BPE (GPT-2 style: ByteLevel pre-tokenizer and decoder, every byte in the
  alphabet, so every text encodes) trained on the iterable of strings `texts`, with the
  end-of-text token `<|endoftext|>` as id 0. Deterministic for the same texts in the same order."""
  check_bpe_vocab_size(vocab_size)
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BPE_EOS], show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tokenizer.train_from_iterator(texts, trainer=trainer)
  return HuggingFaceTokenizer(tokenizer, None, eos_id=tokenizer.token_to_id(BPE_EOS))


def file_digest(path: str) -> str:
  """"sha256:<hex>" of a tokenizer file's content: a .json's canonical JSON (sorted keys, no
  spaces: the same tokenizer saved twice digests the same), a .model's bytes. TokenizerError
  for a .json that is not JSON, or a file that cannot be read."""
  try:
    with open(path, "rb") as f:
      raw = f.read()
    if path.endswith(".json"):
      raw = json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
  except (OSError, ValueError) as error:    # ValueError: JSONDecodeError, UnicodeDecodeError
    raise TokenizerError(f"{path} is not a readable tokenizer file ({joined_message(error)})") from None
  return "sha256:" + hashlib.sha256(raw).hexdigest()


def sidecar_entry(tokenizer, data_path: str) -> dict:
  """The sidecar's "tokenizer" field for data written to `data_path` with `tokenizer`: the
  file it is saved as beside the .bin (`NAME.tokenizer.json` / `NAME.tokenizer.model`) and,
  for those, the digest of its content."""
  if tokenizer.kind == "bytes":
    return {"kind": "bytes", "file": None, "eos_id": int(tokenizer.eos_id)}
  file = os.path.basename(data_path[:-len(".bin")]) + SUFFIXES[tokenizer.kind]
  return {"kind": tokenizer.kind, "file": file, "eos_id": int(tokenizer.eos_id), "digest": file_digest(tokenizer.file)}


def _entry(data_path: str) -> dict:
  return TokenFile(data_path, verify_checksum=False).tokenizer


def _tokenizer_path(data_path: str, entry: dict) -> str:
  path = os.path.join(os.path.dirname(os.path.abspath(data_path)), entry["file"])
  if not os.path.isfile(path):
    raise ConfigError("data.path", data_path, f"its sidecar names the tokenizer file {entry['file']}, which is not "
                      "beside it", "copy the tokenizer file with the data, or rerun megajax-prepare-data")
  return path


def entry_digest(data_path: str, entry: dict) -> str:
  """The content digest of the tokenizer a token file's sidecar entry names: the sidecar's,
  else (a sidecar written before digests) its file's beside the .bin; "bytes" for bytes."""
  if entry["kind"] == "bytes":
    return BYTES_DIGEST
  if entry.get("digest"):
    return entry["digest"]
  try:
    return file_digest(_tokenizer_path(data_path, entry))
  except TokenizerError as error:
    raise ConfigError("data.path", data_path, f"its tokenizer: {error}", "rerun megajax-prepare-data") from None


def identity(data_path: str) -> dict:
  """{"kind", "eos_id", "digest"} of the tokenizer that wrote `data_path`."""
  entry = _entry(data_path)
  return {"kind": entry["kind"], "eos_id": entry["eos_id"], "digest": entry_digest(data_path, entry)}


def tokenizer_of(data_path: str):
  """The tokenizer that wrote the token file `data_path` (bytes for sidecars without one),
  loaded and checked against its sidecar (kind, end-of-text id, content digest)."""
  entry = _entry(data_path)
  if entry["kind"] == "bytes":
    return ByteTokenizer()
  path = _tokenizer_path(data_path, entry)
  if entry.get("digest"):
    try:
      found = file_digest(path)
    except TokenizerError as error:
      raise ConfigError("data.path", data_path, f"its tokenizer: {error}", "rerun megajax-prepare-data") from None
    if found != entry["digest"]:
      raise ConfigError("data.path", data_path, f"its tokenizer file {entry['file']} is not the one its sidecar names "
                        f"(content {found[:19]}..., the sidecar says {entry['digest'][:19]}...): changed or damaged "
                        "since the data was written", "copy the right tokenizer file, or rerun megajax-prepare-data")
  try:
    tokenizer = load_tokenizer(path)
  except TokenizerError as error:
    raise ConfigError("data.path", data_path, f"its tokenizer: {error}", "rerun megajax-prepare-data") from None
  if tokenizer.kind != entry["kind"] or tokenizer.eos_id != entry["eos_id"]:
    raise ConfigError("data.path", data_path, f"its tokenizer {entry['file']} is a {tokenizer.kind} tokenizer with "
                      f"eos_id={tokenizer.eos_id}, its sidecar says {entry['kind']} with eos_id={entry['eos_id']}",
                      "copy the right tokenizer file, or rerun megajax-prepare-data")
  return tokenizer


def copy_tokenizer(data_path: str, dest_dir: str) -> str | None:
  """Copies the token file's tokenizer into `dest_dir` under its own name, once it loads and
  matches its sidecar (tokenizer_of); returns the copy's path, or None for bytes."""
  entry = _entry(data_path)
  if entry["kind"] == "bytes":
    return None
  tokenizer_of(data_path)       # a corrupt or substituted file is refused, not adopted
  source = _tokenizer_path(data_path, entry)
  os.makedirs(dest_dir, exist_ok=True)
  dest = os.path.join(dest_dir, entry["file"])
  if not (os.path.exists(dest) and os.path.samefile(source, dest)):
    shutil.copyfile(source, dest + ".tmp")
    os.replace(dest + ".tmp", dest)
  return dest


def run_identity(workdir: str) -> dict | None:
  """The tokenizer identity a run recorded (WORKDIR/tokenizer.identity.json), or None: a run
  of synthetic tokens, or one written before identities were recorded."""
  path = os.path.join(workdir, RUN_IDENTITY)
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      recorded = json.load(f)
  except (OSError, ValueError) as error:
    raise ConfigError("workdir", workdir, f"{path} is not readable JSON ({joined_message(error)})",
                      "restore it from a copy, or delete it to skip the tokenizer checks") from None
  if not (isinstance(recorded, dict) and {"kind", "eos_id", "digest"} <= recorded.keys()):
    raise ConfigError("workdir", workdir, f"{path} is not a tokenizer identity (kind, eos_id, digest)",
                      "restore it from a copy, or delete it to skip the tokenizer checks")
  return {key: recorded[key] for key in ("kind", "eos_id", "digest")}


def describe(tokenizer_identity: dict) -> str:
  """'huggingface sha256:1234abcd... (EOS 511)': an identity on one line."""
  digest = tokenizer_identity["digest"]
  return (tokenizer_identity["kind"] + ("" if digest == BYTES_DIGEST else f" {digest[:19]}...")
          + f" (EOS {tokenizer_identity['eos_id']})")


def check_run_identity(workdir: str, data_path: str, field: str = "data.path") -> dict:
  """data_path's tokenizer identity, checked against the one the workdir's run recorded (a
  resumed run, or its evaluation, must read ids the way it trained on them): a ConfigError
  on `field` naming both."""
  found, recorded = identity(data_path), run_identity(workdir)
  if recorded is not None and recorded != found:
    raise ConfigError(field, data_path, f"its tokenizer is {describe(found)}, but the run in {workdir} trained with "
                      f"{describe(recorded)} ({RUN_IDENTITY}): the same ids would mean other tokens",
                      "use data written with the run's tokenizer, or a new --workdir")
  return found


def record_run_identity(workdir: str, data_path: str, write: bool) -> dict:
  """check_run_identity, then the identity recorded (by the process that `write`s) when the
  workdir has none yet."""
  found, recorded = check_run_identity(workdir, data_path), run_identity(workdir)
  if write and recorded is None:
    path = os.path.join(workdir, RUN_IDENTITY)
    with open(path + ".tmp", "w") as f:
      json.dump(found, f)
    os.replace(path + ".tmp", path)
  return found


def workdir_tokenizer_file(workdir: str) -> str | None:
  """The tokenizer file a run trained with (WORKDIR/tokenizer/, copied there by the trainer
  from its token files' sidecars), or None: the run read bytes or synthetic tokens. Checked
  against the run's recorded identity: a damaged or replaced copy is a ConfigError."""
  directory = os.path.join(workdir, "tokenizer")
  files = sorted(name for name in os.listdir(directory) if name.endswith((".json", ".model"))) \
      if os.path.isdir(directory) else []
  if len(files) > 1:
    raise ConfigError("workdir", workdir, f"{directory} holds {len(files)} tokenizers ({', '.join(files)})",
                      "keep the one the run's data was written with")
  path = os.path.join(directory, files[0]) if files else None
  recorded = run_identity(workdir)
  if recorded is not None:
    try:
      found = BYTES_DIGEST if path is None else file_digest(path)
    except TokenizerError as error:
      raise ConfigError("workdir", workdir, f"its tokenizer: {error}", "copy the data's tokenizer there again") from None
    if found != recorded["digest"]:
      what = "no tokenizer file" if path is None else f"{path}, content {found[:19]}...,"
      raise ConfigError("workdir", workdir, f"the run trained with {describe(recorded)}; {directory} holds {what} "
                        "not that tokenizer (damaged or replaced)", "copy the data's tokenizer there again")
  return path


def workdir_tokenizer(workdir: str):
  """The tokenizer a run trained with: its WORKDIR/tokenizer/ file, else bytes."""
  file = workdir_tokenizer_file(workdir)
  if file is None:
    return ByteTokenizer()
  try:
    return load_tokenizer(file)
  except TokenizerError as error:
    raise ConfigError("workdir", workdir, f"its tokenizer: {error}", "copy the data's tokenizer there again") from None


def joined_message(error: Exception) -> str:
  """An exception's message on one line (the libraries' span several)."""
  return " ".join(str(error).split()) or type(error).__name__

