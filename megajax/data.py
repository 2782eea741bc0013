"""The input pipeline: record sources, the grain dataset of local batches, device prefetch.

Token files (the byte tokenizer, the file format and its checks) are megajax.token_files'.
Records are int32 windows of seq_len + 1 tokens. A global order over records
(shuffled per epoch, repeated forever) is cut into global batches of
train.batch_size; process p of P reads only its contiguous slice p*b .. p*b+b-1
of every global batch (b = B / P). So global batch k holds the same tokens in
the same order whatever the process count, and a run can change its host count
and still see the same data stream.

    it = make_iterator(config)                     # grain DatasetIterator
    with DevicePrefetcher(it, put_fn) as batches:  # overlaps loading with the step
      batch = next(batches)                        # {"inputs", "targets", "loss_mask"}
      state = batches.get_state()                  # {"next_index": int}, JSON-safe
"""

from __future__ import annotations

import queue
import threading

import grain
import numpy as np

from megajax.config import ConfigError
# Re-exported: what users of the data API (the launcher's tests, notebooks) reach for here.
from megajax.token_files import BYTE_VOCAB_SIZE, EOS, TokenFileSource, decode_tokens, encode_text, write_token_file

__all__ = ["BYTE_VOCAB_SIZE", "EOS", "DevicePrefetcher", "SyntheticSource", "TokenFileSource", "decode_tokens",
           "encode_text", "make_dataset", "make_iterator", "make_source", "write_token_file"]


# Sources: random access (`__len__`, `__getitem__`) so grain can shuffle and shard by index.

class SyntheticSource:
  """Random token sequences with structure a tiny model can learn in ~100 steps.

  A sparse first-order Markov chain (each token has 4 likely successors with
  fixed probabilities; the table is drawn once from `seed`) gives ~1.2 nats of
  next-token entropy against log(vocab_size) for uniform tokens. Copy spans
  (an earlier span of the same record repeated later) reward attention beyond
  the previous token. Record i depends only on (seed, i).
  """

  SUCCESSOR_PROBS = (0.55, 0.25, 0.12, 0.08)
  COPY_EVERY = 64            # About one copy span per this many tokens.
  COPY_LEN = (8, 32)         # Copy span length range [lo, hi).

  def __init__(self, vocab_size: int, seq_len: int, seed: int, num_records: int):
    self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
    self.num_records = num_records
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
    rng = np.random.default_rng((self.seed, 1, int(index)))
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


def make_source(config):
  """The record source named by config.data.source."""
  d, m = config.data, config.model
  if d.source == "synthetic":
    return SyntheticSource(m.vocab_size, m.seq_len, config.train.seed, d.synthetic_records)
  if d.source == "tokens":
    source = TokenFileSource(d.path, m.seq_len, verify_checksum=d.verify_checksum)
    if source.vocab_size > m.vocab_size:
      raise ConfigError("model.vocab_size", m.vocab_size,
                        f"smaller than the vocab_size {source.vocab_size} of data.path={d.path}",
                        f"set --config.model.vocab_size={source.vocab_size}")
    return source
  raise ConfigError("data.source", d.source, "unknown name", "choose one of synthetic, tokens")


# The dataset: global order -> this process's slice of each global batch -> batches.

def _to_example(records: np.ndarray) -> dict:
  return {
      "inputs": records[:, :-1],
      "targets": records[:, 1:],  # Next token at every position.
      "loss_mask": np.ones(records[:, 1:].shape, np.float32),
  }


def make_dataset(config, process_index: int, process_count: int) -> grain.IterDataset:
  """Infinite, deterministic grain IterDataset of this process's batches.

  Each element is {"inputs", "targets": int32 (b, S), "loss_mask": float32 (b, S)}
  with b = train.batch_size // process_count.
  """
  global_batch = config.train.batch_size
  if global_batch % process_count:
    raise ConfigError("train.batch_size", global_batch, f"not divisible into {process_count} per-process slices",
                      f"use a multiple of {process_count}")
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} not in [0, {process_count})")
  local_batch = global_batch // process_count

  ds = grain.MapDataset.source(make_source(config))
  if config.data.shuffle:
    # grain's index shuffle: O(1) memory, and repeat() reseeds it every epoch.
    ds = ds.shuffle(seed=config.train.seed % 2**32)
  ds = ds.repeat()  # Infinite; global position n is one fixed record.
  # Chunks of b consecutive global positions; global batch k is chunks kP .. kP+P-1,
  # so process p takes every P-th chunk starting at p: positions kB+pb .. kB+pb+b-1, and
  # reads no other record. drop_remainder: without it grain sizes the batched dataset as
  # ceil(len / b) in floating point, which overflows on the infinite (sys.maxsize long)
  # order at b = 1; floor division is exact, and the remainder it drops is 2**63 records away.
  ds = ds.batch(local_batch, drop_remainder=True)[process_index::process_count]
  ds = ds.map(_to_example)
  return ds.to_iter_dataset(grain.ReadOptions(num_threads=config.data.read_threads,
                                              prefetch_buffer_size=config.data.prefetch))


def make_iterator(config, process_index: int | None = None, process_count: int | None = None):
  """A grain DatasetIterator over this process's batches.

  `get_state()` returns a plain dict {"next_index": int} (JSON-serialisable, the
  number of batches handed out so far); `set_state(state)` on a fresh iterator
  from the same config and process layout resumes at exactly the next batch.
  """
  if process_index is None or process_count is None:
    import jax  # Only needed when the caller leaves the process layout to jax.
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
  return iter(make_dataset(config, process_index, process_count))


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
