"""The input pipeline: record sources, the grain datasets of local batches, device prefetch.

Token files (the byte tokenizer, the file format and its checks) are megajax.token_files'.
A record is seq_len + 1 consecutive tokens of a token stream: the documents of one file (all
of them, or the ones training keeps when data.eval_fraction holds some out) back to back,
cut at stride seq_len, so a document is split across rows where a window cuts it. A global
order over records (each source shuffled per epoch and repeated forever, several sources
mixed by weight) is cut into global batches of train.batch_size; process p of P reads only
its contiguous slice p*b .. p*b+b-1 of every global batch (b = B / P). So global batch k
holds the same tokens in the same order whatever the process count, and a run can change
its host count and still see the same data stream.

    pipeline = open_pipeline(config, 0, 1)         # the trainer's: everything a run reads, opened once
    it = make_iterator(config)                     # grain DatasetIterator
    with DevicePrefetcher(it, put_fn) as batches:  # overlaps loading with the step
      batch = next(batches)                        # {"inputs", "targets", "loss_mask"} (+ below)
      state = batches.get_state()                  # {"next_index": int}, JSON-safe

With document masking (data.packs_documents) a batch also holds "segment_ids" (the
input's document number within its row, from 1) and "positions" (its place in that part of
the document, from 0 at the row start or the document's start), and loss_mask is 0 where a
document's EOS would predict the next document's first token.

`config` below is the run's (megajax.sections.RunConfig, as the trainer passes it) or a
ConfigDict; what is read of it is its data, model and train sections.
"""

from __future__ import annotations

import dataclasses
import queue
import threading

from absl import logging
import grain
import numpy as np

from megajax.config import ConfigError, parse_mixture
from megajax.sections import section
from megajax.tokenizer import entry_digest
# Re-exported: what users of the data API (the launcher's tests, notebooks) reach for here.
from megajax.token_files import (BYTE_VOCAB_SIZE, EOS, TokenFile, TokenFileSource, decode_tokens, encode_text,
                                 write_token_file)

__all__ = ["BYTE_VOCAB_SIZE", "EOS", "DevicePrefetcher", "SyntheticSource", "TokenFileSource", "TokenRecords",
           "decode_tokens", "describe_data", "encode_text", "held_out_documents",
           "make_dataset", "make_eval_dataset", "make_eval_iterator", "make_iterator", "make_source", "make_sources",
           "open_pipeline", "Pipeline", "token_file_paths", "write_token_file"]

# model.vocab_size over this many times the data's: one warning line (the padding rows train nothing).
VOCAB_SLACK = 2


# Sources: random access (`__len__`, `__getitem__`) so grain can shuffle and shard by index.

class SyntheticSource:
  """Random token sequences with structure a tiny model can learn in ~100 steps.

  A sparse first-order Markov chain (each token has 4 likely successors with
  fixed probabilities; the table is drawn once from `seed`) gives ~1.2 nats of
  next-token entropy against log(vocab_size) for uniform tokens. Copy spans
  (an earlier span of the same record repeated later) reward attention beyond
  the previous token. Record i is record first_record + i of the chain's stream
  and depends only on (seed, first_record + i): eval records start past the
  training ones, so they are the same distribution and never trained on.
  """

  SUCCESSOR_PROBS = (0.55, 0.25, 0.12, 0.08)
  COPY_EVERY = 64            # About one copy span per this many tokens.
  COPY_LEN = (8, 32)         # Copy span length range [lo, hi).

  def __init__(self, vocab_size: int, seq_len: int, seed: int, num_records: int, first_record: int = 0):
    self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
    self.num_records, self.first_record = num_records, first_record
    table_rng = np.random.default_rng((seed, 0, 0))
    k = len(self.SUCCESSOR_PROBS)
    successors = table_rng.integers(0, vocab_size, size=(vocab_size, k))
    # A flat Python list: the chain is sequential, and list indexing beats numpy scalars.
    self._successors = successors.reshape(-1).tolist()
    self._cum_probs = np.cumsum(self.SUCCESSOR_PROBS)

  def __len__(self) -> int:
    return self.num_records

  def __getitem__(self, index: int) -> np.ndarray:
    n = self.seq_len + 1
    rng = np.random.default_rng((self.seed, 1, self.first_record + int(index)))
    # Draw every random choice up front (vectorised); only the walk is a loop.
    slots = np.searchsorted(self._cum_probs, rng.random(n - 1) * self._cum_probs[-1], side="right")
    k, succ = len(self.SUCCESSOR_PROBS), self._successors
    token = int(rng.integers(self.vocab_size))
    out = [token]
    for slot in slots.tolist():
      token = succ[token * k + slot]
      out.append(token)
    record = np.asarray(out, dtype=np.int32)
    lo, hi = self.COPY_LEN
    for _ in range(n // self.COPY_EVERY):
      length = int(rng.integers(lo, hi))
      if 2 * length > n:
        break
      dst = int(rng.integers(length, n - length + 1))
      src = int(rng.integers(0, dst - length + 1))
      record[dst:dst + length] = record[src:src + length]
    return record


def held_out_documents(num_documents: int, fraction: float) -> np.ndarray:
  """Which documents (bool per document number) evaluation holds out: those whose hash
  (splitmix64 of the number) falls under `fraction`. It depends on nothing but the number, so
  the held-out set is the same for every run, seed and process count over the same file."""
  with np.errstate(over="ignore"):   # The hash wraps around 2**64 on purpose.
    x = np.arange(num_documents, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
  return (x >> np.uint64(11)).astype(np.float64) / 2.0**53 < fraction


class TokenRecords:
  """Records of seq_len + 1 tokens at stride seq_len over a token stream: the documents
  `keep` selects (bool per document; None: all) of an opened TokenFile, back to back in file
  order. Record i is the stream's tokens [i*S, i*S + S + 1); each is a dict {"tokens"} and,
  with `segments`, {"segment_ids"}: every token's document number within the record, from 1.
  Each record's ids are checked as it is read (the error names the file and record)."""

  def __init__(self, token_file: TokenFile, seq_len: int, keep: np.ndarray | None = None,
               segments: bool = True, starts: np.ndarray | None = None):
    self.file, self.path, self.seq_len, self.segments = token_file, token_file.path, seq_len, segments
    self.tokens, self.vocab_size = token_file.tokens, token_file.vocab_size
    starts = token_file.document_starts if starts is None else starts
    ends = np.append(starts[1:], len(self.tokens))
    chosen = np.ones(len(starts), bool) if keep is None else np.asarray(keep, bool)
    documents = np.flatnonzero(chosen & (ends > starts))   # An empty document is no boundary.
    lengths = ends[documents] - starts[documents]
    self.num_documents, self.num_tokens = len(documents), int(lengths.sum())
    # Each document's start in the stream, and the runs of adjacent documents: each run is one
    # contiguous piece of the file, so a record is one slice, or a few across held-out gaps.
    self._document_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    first_of_run = np.flatnonzero(np.diff(documents, prepend=-2) != 1)
    self._run_starts = self._document_starts[first_of_run]                 # in the stream
    self._run_file_starts = starts[documents[first_of_run]]               # in the file
    self._run_ends = np.append(self._run_starts[1:], self.num_tokens)

  def __len__(self) -> int:
    return max(self.num_tokens - 1, 0) // self.seq_len

  def __getitem__(self, index: int) -> dict:
    start, n = int(index) * self.seq_len, self.seq_len + 1
    run = int(np.searchsorted(self._run_starts, start, side="right")) - 1
    pieces, at = [], start
    while at < start + n:
      file_at = int(self._run_file_starts[run]) + at - int(self._run_starts[run])
      piece = self.tokens[file_at:file_at + min(start + n, int(self._run_ends[run])) - at]
      # On the stored dtype, before int32: a uint32 id >= 2**31 would wrap to a negative.
      self.file.check_ids(piece, file_at, f"record {index}")
      pieces.append(piece)
      at, run = at + len(piece), run + 1
    record = {"tokens": np.concatenate(pieces).astype(np.int32) if len(pieces) > 1
              else np.asarray(pieces[0], dtype=np.int32)}
    if self.segments:
      first = int(np.searchsorted(self._document_starts, start, side="right"))
      last = int(np.searchsorted(self._document_starts, start + n, side="left"))
      new_document = np.zeros(n, np.int32)
      new_document[self._document_starts[first:last] - start] = 1
      record["segment_ids"] = 1 + np.cumsum(new_document, dtype=np.int32)
    return record


def _check_same_tokenizer(files: list, field: str, value: str) -> None:
  """Files read together must share a tokenizer: ids mean the same tokens in each. Compared by
  content (tokenizer.entry_digest): two BPEs of one vocabulary size trained on different
  corpora give the same id to different tokens."""
  def identity(token_file):
    tokenizer = token_file.tokenizer
    return (token_file.vocab_size, tokenizer.get("kind"), tokenizer.get("eos_id"),
            entry_digest(token_file.path, tokenizer))

  with_sidecars = [f for f in files if f.meta]   # a .npy has no sidecar: its vocab is its largest id + 1
  for other in with_sidecars[1:]:
    if identity(other) != identity(with_sidecars[0]):
      (vocab, kind, eos, digest), (vocab2, kind2, eos2, digest2) = identity(with_sidecars[0]), identity(other)
      same_shape = (vocab, kind, eos) == (vocab2, kind2, eos2)
      show = lambda digest: f", content {digest[:19]}..." if same_shape else ""
      raise ConfigError(field, value, f"{with_sidecars[0].path} (tokenizer {kind}, vocab {vocab}, EOS {eos}"
                        f"{show(digest)}) and {other.path} (tokenizer {kind2}, vocab {vocab2}, EOS {eos2}"
                        f"{show(digest2)}) use different tokenizers", "prepare every file with the same --tokenizer")


def _training_files(config) -> list[tuple[str, float]]:
  d = config.data
  return parse_mixture(d.mixture) if d.mixture else [(d.path, 1.0)]


def token_file_paths(config) -> list[str]:
  """Every token file the run reads (training files, then data.eval_path); none for synthetic data."""
  d = config.data
  if d.source != "tokens":
    return []
  return [path for path, _ in _training_files(config)] + ([d.eval_path] if d.eval_path else [])


def make_sources(config, split: str = "train", verify: bool = True) -> list[tuple[object, float]]:
  """[(record source, weight)] of config.data for `split` ("train" or "eval"): one source, or
  one per mixture file. Eval records are data.eval_path's, or the documents data.eval_fraction
  holds out of each training file (the training sources then skip them). verify=False: no
  file's checksum is computed, whatever data.verify_checksum says (a description's quick look)."""
  d, m = section(config, "data"), config.model
  if d.source == "synthetic":
    if split == "train":
      return [(SyntheticSource(m.vocab_size, m.seq_len, config.train.seed, d.synthetic_records), 1.0)]
    return [(SyntheticSource(m.vocab_size, m.seq_len, config.train.seed, _eval_rows(config),
                             first_record=d.synthetic_records), 1.0)]
  if d.source != "tokens":
    raise ConfigError("data.source", d.source, "unknown name", "choose one of synthetic, tokens")
  train_files = _training_files(config)
  field, value = ("data.mixture", d.mixture) if d.mixture else ("data.path", d.path)
  # With data.eval_path the eval split opens the training files only to check the tokenizers
  # agree: no checksum (a full read of the training corpus at every evaluation's start).
  verify = verify and d.verify_checksum
  verify_training = verify and not (split == "eval" and d.eval_path)
  files = [(path, weight, TokenFile(path, verify_training)) for path, weight in train_files]
  if split == "eval" and d.eval_path:
    eval_file = TokenFile(d.eval_path, verify)
    _check_same_tokenizer([f for _, _, f in files] + [eval_file], "data.eval_path", d.eval_path)
    files, field, value = [(d.eval_path, 1.0, eval_file)], "data.eval_path", d.eval_path
  elif split == "eval" and not d.eval_fraction:
    raise ConfigError("data.eval_path", d.eval_path, "token data has no eval data",
                      "set --config.data.eval_path=FILE or --config.data.eval_fraction=0.01")
  _check_same_tokenizer([f for _, _, f in files], field, value)
  sources = []
  for path, weight, token_file in files:
    if token_file.vocab_size > m.vocab_size:
      raise ConfigError("model.vocab_size", m.vocab_size,
                        f"smaller than the vocab_size {token_file.vocab_size} of {path}",
                        f"set --config.model.vocab_size={token_file.vocab_size}")
    if m.vocab_size > VOCAB_SLACK * token_file.vocab_size and split == "train":
      logging.warning("model.vocab_size=%d is over %dx the vocab_size %d of %s: the unused rows of the embedding "
                      "and the head cost memory and FLOPs for nothing; set --config.model.vocab_size=%d",
                      m.vocab_size, VOCAB_SLACK, token_file.vocab_size, path, token_file.vocab_size)
    starts, keep = token_file.document_starts, None
    if d.eval_fraction and not d.eval_path:
      held_out = held_out_documents(len(starts), d.eval_fraction)
      keep = held_out if split == "eval" else ~held_out
      if not keep.any():
        raise ConfigError("data.eval_fraction", d.eval_fraction,
                          f"holds out {'none' if split == 'eval' else 'all'} of the {len(starts)} documents of {path}",
                          "use a file with more documents, or --config.data.eval_path=FILE")
    source = TokenRecords(token_file, m.seq_len, keep, d.packs_documents, starts)
    if len(source) == 0:
      what = "" if keep is None else f" ({split} documents)"
      raise ConfigError(field, value, f"{path} has {source.num_tokens} tokens{what}, fewer than one record of "
                        f"model.seq_len + 1 = {m.seq_len + 1}", "use more text or a shorter model.seq_len")
    sources.append((source, weight))
  return sources


def make_source(config):
  """The training record source of config.data (the first file's, for a mixture)."""
  return make_sources(config)[0][0]


# The datasets: global order -> this process's slice of each global batch -> batches.

def _to_example(batch: dict, segments: bool) -> dict:
  """A batch of records -> the step's arrays, every one of shape (b, S) (module docstring)."""
  tokens = batch["tokens"]
  example = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}   # Next token at every position.
  if not segments:
    example["loss_mask"] = np.ones(tokens[:, 1:].shape, np.float32)
    return example
  documents = batch["segment_ids"]
  # An EOS predicting the next document's first token has nothing to learn from: no loss.
  example["loss_mask"] = (documents[:, 1:] == documents[:, :-1]).astype(np.float32)
  segment_ids = documents[:, :-1]
  b, s = segment_ids.shape
  columns = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s))
  starts = np.concatenate([np.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
  example["segment_ids"] = segment_ids
  example["positions"] = columns - np.maximum.accumulate(np.where(starts, columns, 0), axis=1)
  return example


def _as_record(record) -> dict:
  return record if isinstance(record, dict) else {"tokens": record}


def _local_slice(config, process_index: int, process_count: int) -> int:
  global_batch = config.train.batch_size
  if global_batch % process_count:
    raise ConfigError("train.batch_size", global_batch, f"not divisible into {process_count} per-process slices",
                      f"use a multiple of {process_count}")
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} not in [0, {process_count})")
  return global_batch // process_count


def _batched(config, ds: grain.MapDataset, process_index: int, process_count: int) -> grain.IterDataset:
  local_batch = _local_slice(config, process_index, process_count)
  # Chunks of b consecutive global positions; global batch k is chunks kP .. kP+P-1,
  # so process p takes every P-th chunk starting at p: positions kB+pb .. kB+pb+b-1, and
  # reads no other record. drop_remainder: without it grain sizes the batched dataset as
  # ceil(len / b) in floating point, which overflows on the infinite (sys.maxsize long)
  # order at b = 1; floor division is exact, and the remainder it drops is 2**63 records away.
  ds = ds.map(_as_record).batch(local_batch, drop_remainder=True)[process_index::process_count]
  segments = section(config, "data").packs_documents
  ds = ds.map(lambda batch: _to_example(batch, segments))
  return ds.to_iter_dataset(grain.ReadOptions(num_threads=config.data.read_threads,
                                              prefetch_buffer_size=config.data.prefetch))


def make_dataset(config, process_index: int, process_count: int) -> grain.IterDataset:
  """Infinite, deterministic grain IterDataset of this process's training batches.

  Each element is {"inputs", "targets": int32 (b, S), "loss_mask": float32 (b, S)} with
  b = train.batch_size // process_count, plus "segment_ids", "positions": int32 (b, S)
  when data.packs_documents.
  """
  _local_slice(config, process_index, process_count)   # A bad layout fails before any file opens.
  return _training_dataset(config, make_sources(config), process_index, process_count)


def _training_dataset(config, sources: list, process_index: int, process_count: int) -> grain.IterDataset:
  """make_dataset's, over training `sources` already opened (make_sources)."""
  parts = []
  for i, (source, _) in enumerate(sources):
    ds = grain.MapDataset.source(source)
    if config.data.shuffle:
      # grain's index shuffle: O(1) memory, and repeat() reseeds it every epoch. A seed per
      # source; the first keeps train.seed, so one file's order is what it always was.
      ds = ds.shuffle(seed=(config.train.seed + 7919 * i) % 2**32)
    parts.append(ds.repeat())  # Infinite; global position n is one fixed record.
  # grain's mix interleaves the sources by weight, position by position (deterministic), before
  # the global batching: the global batch is the same for any process count.
  ds = parts[0] if len(parts) == 1 else grain.MapDataset.mix(parts, [weight for _, weight in sources])
  return _batched(config, ds, process_index, process_count)


def _eval_rows(config) -> int:
  return config.train.eval_batches * config.train.batch_size


def make_eval_dataset(config, process_index: int, process_count: int) -> grain.IterDataset:
  """The eval pass: train.eval_batches global batches of this process's rows, the same
  layout and keys as training's, read in order (no shuffle) from the start of the eval
  records, so every pass is the same tokens. Eval records fewer than the pass wrap around."""
  _local_slice(config, process_index, process_count)
  sources = make_sources(config, "eval")
  parts = [grain.MapDataset.source(source).repeat() for source, _ in sources]
  ds = parts[0] if len(parts) == 1 else grain.MapDataset.mix(parts, [weight for _, weight in sources])
  return _batched(config, ds[:_eval_rows(config)], process_index, process_count)


def _process_layout(process_index, process_count):
  if process_index is None or process_count is None:
    import jax  # Only needed when the caller leaves the process layout to jax.
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
  return process_index, process_count


def make_iterator(config, process_index: int | None = None, process_count: int | None = None):
  """A grain DatasetIterator over this process's batches.

  `get_state()` returns a plain dict {"next_index": int} (JSON-serialisable, the
  number of batches handed out so far); `set_state(state)` on a fresh iterator
  from the same config and process layout resumes at exactly the next batch.
  """
  return iter(make_dataset(config, *_process_layout(process_index, process_count)))


def make_eval_iterator(config, process_index: int | None = None, process_count: int | None = None):
  """A fresh iterator over one eval pass (make_eval_dataset): finite, the same every call. It
  opens the files (and checks their checksums) again: to evaluate every N steps, make the
  dataset once and `iter()` it for each pass."""
  return iter(make_eval_dataset(config, *_process_layout(process_index, process_count)))


def describe_data(config, sources: list | None = None) -> str:
  """One line for the start-up log: the source, tokenizer, vocabulary, tokens, documents and
  how many epochs train.steps take (steps * batch_size * seq_len / training tokens). `sources`:
  the training sources if already opened (make_sources), else opened here."""
  d, t, m = section(config, "data"), config.train, config.model
  read = t.steps * t.batch_size * m.seq_len
  if d.source == "synthetic":
    tokens = d.synthetic_records * m.seq_len
    return (f"data: synthetic (Markov chain with copy spans), vocab {m.vocab_size}, {d.synthetic_records:,} records "
            f"= {tokens:,} tokens, no documents; {t.steps:,} steps read {read / tokens:.3g} epochs")
  if sources is None:
    sources = make_sources(config, verify=False)   # A description reads sidecars and the index, not every byte.
  tokens = sum(source.num_tokens for source, _ in sources)
  documents = sum(source.num_documents for source, _ in sources)
  total = sum(weight for _, weight in sources)
  names = " + ".join(f"{source.path} ({weight / total:.0%})" for source, weight in sources) if len(sources) > 1 \
      else sources[0][0].path
  tokenizer = sources[0][0].file.tokenizer["kind"]
  held_out = f" (data.eval_fraction={d.eval_fraction} held out)" if d.eval_fraction else ""
  masking = "document masking on" if d.packs_documents else "document masking off"
  return (f"data: tokens from {names}; tokenizer {tokenizer}, vocab {sources[0][0].vocab_size}; {tokens:,} training "
          f"tokens in {documents:,} documents{held_out}; {masking}; {t.steps:,} steps read {read / tokens:.3g} epochs")


@dataclasses.dataclass
class Pipeline:
  """What a training run reads, opened once: open_pipeline makes it."""
  iterator: object                     # grain DatasetIterator over this process's training batches
  eval_dataset: object | None          # one held-out pass (train.eval_every; None without), made once
  token_paths: list[str]               # every token file the run reads (token_file_paths)
  description: str                     # the start-up line (describe_data)


def open_pipeline(config, process_index: int, process_count: int) -> Pipeline:
  """The run's input, opened once: the training iterator of this process's rows, the held-out
  pass when train.eval_every asks for one, the token files read, and the description line
  (from the training sources the iterator opened: no file read twice). A bad token file or
  layout fails here, before anything compiles."""
  _local_slice(config, process_index, process_count)
  sources = make_sources(config)
  dataset = _training_dataset(config, sources, process_index, process_count)
  eval_dataset = make_eval_dataset(config, process_index, process_count) if config.train.eval_every else None
  return Pipeline(iter(dataset), eval_dataset, token_file_paths(config), describe_data(config, sources))


# Device prefetch: host batching and host->device copies overlap the training step.

class _Raised:
  def __init__(self, error: BaseException):
    self.error = error


class DevicePrefetcher:
  """Pulls batches from a grain iterator in a daemon thread and applies `put_fn` ahead.

  Up to `size` device batches wait in a queue. `get_state()` is the grain state
  right after the last batch handed out by `__next__` (not the prefetched ones),
  so a checkpoint saved after step n resumes at batch n + 1. To resume, call
  `set_state` on a fresh grain iterator and wrap it in a new DevicePrefetcher.
  Exceptions raised by the iterator or `put_fn` are re-raised by `__next__`.
  The grain iterator stays owned by the caller: `close()` only stops the thread.
  """

  def __init__(self, iterator, put_fn=lambda batch: batch, size: int = 2):
    self._iterator, self._put_fn = iterator, put_fn
    self._state = iterator.get_state()
    self._queue = queue.Queue(maxsize=max(1, size))
    self._stop = threading.Event()
    self._done = False
    self._thread = threading.Thread(target=self._fill, name="megajax-device-prefetch", daemon=True)
    self._thread.start()

  def _fill(self):
    while not self._stop.is_set():
      try:
        batch = next(self._iterator)
        # The state is read right after this batch, in the only thread that touches the iterator.
        item = (self._put_fn(batch), self._iterator.get_state())
      except BaseException as error:  # pylint: disable=broad-except
        item = _Raised(error)
      while not self._stop.is_set():
        try:
          self._queue.put(item, timeout=0.1)  # Timeout: notice close() while the queue is full.
          break
        except queue.Full:
          pass
      if isinstance(item, _Raised):
        return

  def __iter__(self):
    return self

  def __next__(self):
    if self._done:
      raise StopIteration
    item = self._queue.get()
    if isinstance(item, _Raised):
      self._done = True
      raise item.error
    batch, self._state = item
    return batch

  def get_state(self):
    """The grain iterator state after the last batch returned by `__next__`."""
    return self._state

  def close(self):
    self._stop.set()
    self._done = True
    self._thread.join(timeout=10)

  def __enter__(self):
    return self

  def __exit__(self, *exc_info):
    self.close()
