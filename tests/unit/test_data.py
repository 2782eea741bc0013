"""megajax/data.py: determinism, the batch split over processes, resume, the device prefetcher
(token files themselves: tests/unit/test_token_files.py)."""

import json
import threading

import jax
import numpy as np
import pytest

from megajax import config as config_lib
from megajax import data
from megajax import token_files
from megajax.sections import section
from tests.support.processes import HANG_S   # a hang guard only: each wait ends on its event


def _config(**data_overrides):
  c = config_lib.default_config()
  c.model.vocab_size = 64
  c.model.seq_len = 16
  c.train.batch_size = 8
  c.train.seed = 3
  c.data.synthetic_records = 100
  c.data.read_threads = 2
  c.data.prefetch = 2
  for name, value in data_overrides.items():
    c.data[name] = value
  return c


def _take(iterator, n):
  return [next(iterator) for _ in range(n)]


def _assert_batches_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for key in x:
      np.testing.assert_array_equal(np.asarray(x[key]), np.asarray(y[key]))

def _assert_resumes_exactly(c, process, taken, then):
  """A fresh iterator given the (JSON round-tripped) state after `taken` batches yields the
  same `then` batches as the original; `process`: (index, count). Returns that state."""
  iterator = data.make_iterator(c, *process)
  _take(iterator, taken)
  state = json.loads(json.dumps(iterator.get_state()))
  expected = _take(iterator, then)
  resumed = data.make_iterator(c, *process)
  resumed.set_state(state)
  _assert_batches_equal(expected, _take(resumed, then))
  return state


def _arange_token_config(tmp_path, num_records=21, seq_len=4):
  """A .npy source whose record i starts with token i * seq_len, so records are identifiable."""
  path = str(tmp_path / "arange.npy")
  np.save(path, np.arange(num_records * seq_len + 1, dtype=np.int32))
  c = _config(source="tokens", path=path)
  c.model.seq_len = seq_len
  c.model.vocab_size = num_records * seq_len + 1
  return c


def test_batches_are_deterministic_given_the_seed():
  first = _take(data.make_iterator(_config(), 0, 1), 4)
  again = _take(data.make_iterator(_config(), 0, 1), 4)
  _assert_batches_equal(first, again)
  other = _config()
  other.train.seed = 4
  different = _take(data.make_iterator(other, 0, 1), 4)
  assert not all(np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(first, different))


def test_batch_layout_and_targets_are_inputs_shifted_by_one():
  c = _config(shuffle=False)
  batch = next(data.make_iterator(c, 0, 1))
  assert batch["inputs"].shape == batch["targets"].shape == batch["loss_mask"].shape == (8, 16)
  assert batch["inputs"].dtype == batch["targets"].dtype == np.int32
  assert batch["loss_mask"].dtype == np.float32 and np.all(batch["loss_mask"] == 1)
  np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
  # Unshuffled, row i is record i: inputs = record[:-1], targets = record[1:].
  source = data.make_source(c)
  for i in range(8):
    np.testing.assert_array_equal(batch["inputs"][i], source[i][:-1])
    np.testing.assert_array_equal(batch["targets"][i], source[i][1:])
  assert "segment_ids" not in batch and not section(c, "data").packs_documents   # synthetic: no documents


def _global_batches(config, process_count, num_batches):
  """What `process_count` processes read, process p from its own iterator, rows concatenated."""
  per_process = [_take(data.make_iterator(config, p, process_count), num_batches) for p in range(process_count)]
  b = config.train.batch_size // process_count
  for local in per_process:
    assert all(batch["inputs"].shape == (b, config.model.seq_len) for batch in local)
  return [{key: np.concatenate([local[k][key] for local in per_process]) for key in per_process[0][0]}
          for k in range(num_batches)]


@pytest.mark.parametrize("source", ["synthetic", "tokens"])
@pytest.mark.parametrize("global_batch", [8, 24])
def test_global_batch_is_the_same_for_any_process_count(tmp_path, source, global_batch):
  """1, 2, 4 and 8 processes; at 8 x 1 and 8 x 3 rows one or a few rows each."""
  c = _config() if source == "synthetic" else _arange_token_config(tmp_path)
  c.train.batch_size = global_batch
  assert c.data.shuffle
  num_batches = 3  # 24 or 72 records: crosses an epoch boundary of the 21-record token file.
  reference = _global_batches(c, 1, num_batches)
  for count in (2, 4, 8):
    _assert_batches_equal(reference, _global_batches(c, count, num_batches))


def test_batch_size_one(tmp_path):
  c = _arange_token_config(tmp_path, num_records=5)
  c.train.batch_size, c.data.shuffle = 1, False
  firsts = [int(b["inputs"][0, 0]) // 4 for b in _take(data.make_iterator(c, 0, 1), 7)]
  assert firsts == [0, 1, 2, 3, 4, 0, 1]


class _RecordingSource:
  """A source that notes every record index it is asked for."""

  def __init__(self, source):
    self.source, self.read = source, []

  def __len__(self):
    return len(self.source)

  def __getitem__(self, index):
    self.read.append(index)
    return self.source[index]


@pytest.mark.parametrize("global_batch,process_count", [(8, 2), (8, 8), (24, 8)])
def test_each_process_reads_only_its_own_rows(tmp_path, monkeypatch, global_batch, process_count):
  c = _arange_token_config(tmp_path, num_records=1000)   # no record twice in what is read here
  c.train.batch_size = global_batch
  reference = _global_batches(c, 1, 30)
  sources, make_sources = [], data.make_sources        # sources[p]: process p's, made by make_iterator
  monkeypatch.setattr(data, "make_sources", lambda config: [(sources.append(_RecordingSource(source))
                                                             or sources[-1], weight)
                                                            for source, weight in make_sources(config)])
  b = global_batch // process_count
  for p in range(process_count):
    _take(data.make_iterator(c, p, process_count), 3)
    own = [set(batch["inputs"][p * b:(p + 1) * b, 0] // 4) for batch in reference]
    read = set(sources[p].read)
    assert set().union(*own[:3]) <= read                 # its rows of the batches it handed out
    assert read <= set().union(*own)                     # and nothing else (read-ahead included)


def test_shuffle_is_a_fresh_permutation_each_epoch(tmp_path):
  c = _arange_token_config(tmp_path, num_records=16)
  order = np.concatenate([b["inputs"][:, 0] // 4 for b in _take(data.make_iterator(c, 0, 1), 4)])
  first, second = order[:16], order[16:]
  assert sorted(first) == sorted(second) == list(range(16))
  assert list(first) != list(range(16))
  assert list(first) != list(second)
  c.data.shuffle = False
  order = np.concatenate([b["inputs"][:, 0] // 4 for b in _take(data.make_iterator(c, 0, 1), 4)])
  assert list(order) == list(range(16)) * 2


def test_batch_size_must_split_over_processes():
  with pytest.raises(config_lib.ConfigError, match="train.batch_size"):
    data.make_dataset(_config(), 0, 3)


@pytest.mark.parametrize("global_batch,process_index,process_count", [(8, 1, 2), (8, 5, 8), (1, 0, 1)])
def test_grain_iterator_state_json_round_trip_resumes_at_the_next_batch(global_batch, process_index, process_count):
  c = _config()
  c.train.batch_size = global_batch
  state = _assert_resumes_exactly(c, (process_index, process_count), taken=3, then=2)
  assert state == {"next_index": 3}   # grain's own state: what every checkpoint's data state holds


def test_a_bad_id_in_a_batch_is_one_line_naming_file_record_and_id(tmp_path):
  tokens = np.arange(200) % 50
  tokens[130] = 299
  path = str(tmp_path / "tokens.bin")
  data.write_token_file(path, tokens, 300)
  with open(token_files.sidecar_path(path)) as f:
    meta = json.load(f)
  with open(token_files.sidecar_path(path), "w") as f:
    json.dump(dict(meta, vocab_size=257), f)   # a sidecar that lies about its ids
  c = _config(source="tokens", path=path, shuffle=False)
  c.model.seq_len, c.model.vocab_size, c.train.batch_size = 16, 257, 2
  iterator = data.make_iterator(c, 0, 1)
  _take(iterator, 4)                         # records 0 .. 7
  with pytest.raises(config_lib.ConfigError) as error:
    next(iterator)                           # records 8 (tokens 128 .. 144) and 9
  assert str(error.value).startswith(f"data.path={path!r}: record 8 holds the id 299 (token 130), outside [0, 257)")


def test_device_prefetcher_state_counts_only_handed_out_batches():
  c = _config()
  reference = _take(data.make_iterator(c, 0, 1), 6)
  puts, ran_ahead = [], threading.Event()

  def put(batch):
    puts.append(batch)
    if len(puts) == 6:
      ran_ahead.set()
    return jax.device_put(batch)

  with data.DevicePrefetcher(data.make_iterator(c, 0, 1), put, size=2) as prefetcher:
    got = _take(prefetcher, 3)
    assert all(isinstance(x, jax.Array) for batch in got for x in batch.values())
    _assert_batches_equal(reference[:3], got)
    # The thread runs ahead: its 6th put starts once batches 4 and 5 wait in the full queue.
    assert ran_ahead.wait(timeout=HANG_S)
    assert prefetcher._queue.full()
    state = json.loads(json.dumps(prefetcher.get_state()))
  resumed = data.make_iterator(c, 0, 1)
  resumed.set_state(state)
  _assert_batches_equal(reference[3:6], _take(resumed, 3))
  # And resuming through a new prefetcher gives the same stream.
  resumed = data.make_iterator(c, 0, 1)
  resumed.set_state(state)
  with data.DevicePrefetcher(resumed, jax.device_put) as prefetcher:
    _assert_batches_equal(reference[3:5], _take(prefetcher, 2))


class _FailingIterator:
  def __init__(self, fail_after):
    self.n, self.fail_after = 0, fail_after

  def __next__(self):
    if self.n == self.fail_after:
      raise ValueError("broken record")
    self.n += 1
    return self.n

  def get_state(self):
    return {"n": self.n}


def test_device_prefetcher_reraises_errors_and_closes():
  prefetcher = data.DevicePrefetcher(_FailingIterator(fail_after=2), size=1)
  assert [next(prefetcher), next(prefetcher)] == [1, 2]
  assert prefetcher.get_state() == {"n": 2}
  with pytest.raises(ValueError, match="broken record"):
    next(prefetcher)
  prefetcher.close()
  # A thread blocked on a full queue stops too.
  prefetcher = data.DevicePrefetcher(_FailingIterator(fail_after=10**9), size=1)
  prefetcher.close()
  assert not prefetcher._thread.is_alive()
  with pytest.raises(StopIteration):
    next(prefetcher)


def test_token_file_errors_name_the_field(tmp_path):
  path = str(tmp_path / "short.bin")
  data.write_token_file(path, np.arange(10), 257)
  with pytest.raises(config_lib.ConfigError, match=r"^data\.path="):
    data.TokenFileSource(path, seq_len=16)
  c = _config(source="tokens", path=path)
  c.model.seq_len = 4
  c.model.vocab_size = 64
  with pytest.raises(config_lib.ConfigError, match=r"^model\.vocab_size=64.*--config\.model\.vocab_size=257"):
    data.make_source(c)
  c.model.vocab_size = 257
  assert len(data.make_source(c)) == 2
  c.model.seq_len = 10
  with pytest.raises(config_lib.ConfigError, match=r"^data\.path=.*fewer than one record"):
    data.make_source(c)


def _conditional_entropy(records, vocab_size):
  counts = np.zeros((vocab_size, vocab_size))
  np.add.at(counts, (records[:, :-1].ravel(), records[:, 1:].ravel()), 1)
  probs = counts / np.maximum(counts.sum(1, keepdims=True), 1)
  logs = np.log(np.where(counts > 0, probs, 1.0))
  return -(counts * logs).sum() / counts.sum()


def test_synthetic_source_has_learnable_structure():
  vocab_size = 256
  source = data.SyntheticSource(vocab_size, seq_len=128, seed=0, num_records=1000)
  records = np.stack([source[i] for i in range(500)])
  assert records.shape == (500, 129) and records.dtype == np.int32
  assert records.min() >= 0 and records.max() < vocab_size
  assert len(np.unique(records)) > vocab_size // 2  # Not collapsed onto a few tokens.
  assert _conditional_entropy(records, vocab_size) < 0.6 * np.log(vocab_size)
  # The estimator itself does not report structure where there is none.
  uniform = np.random.default_rng(0).integers(0, vocab_size, size=records.shape)
  assert _conditional_entropy(uniform, vocab_size) > 0.8 * np.log(vocab_size)
  np.testing.assert_array_equal(source[7], data.SyntheticSource(vocab_size, 128, 0, 1000)[7])
  assert not np.array_equal(source[7], data.SyntheticSource(vocab_size, 128, 1, 1000)[7])


def _has_repeated_ngram(record, n):
  seen = set()
  for i in range(len(record) - n + 1):
    gram = record[i:i + n].tobytes()
    if gram in seen:
      return True
    seen.add(gram)
  return False


def test_synthetic_source_has_copy_spans():
  source = data.SyntheticSource(256, seq_len=128, seed=0, num_records=1000)
  with_copies = np.mean([_has_repeated_ngram(source[i], 12) for i in range(200)])
  assert with_copies > 0.8  # The Markov chain alone almost never repeats a 12-gram.


# Documents: segment ids, positions and the loss mask of packed rows.

def _token_file(path, documents, vocab_size=data.BYTE_VOCAB_SIZE):
  """Writes `documents` (each gets EOS appended) to `path`; returns the token stream."""
  documents = [np.append(np.asarray(d, np.int64), data.EOS) for d in documents]
  data.write_token_file(str(path), documents, vocab_size)
  return np.concatenate(documents)


def _document_config(path, seq_len=8, batch_size=4, **data_overrides):
  c = _config(source="tokens", path=str(path), **data_overrides)
  c.model.seq_len, c.model.vocab_size, c.train.batch_size = seq_len, data.BYTE_VOCAB_SIZE, batch_size
  config_lib.validate(c)
  return c


def _expected_example(stream, document_of, start, seq_len):
  """What the batch contract says row `start // seq_len` is, computed token by token."""
  record, docs = stream[start:start + seq_len + 1], document_of[start:start + seq_len + 1]
  segment, position, segments, positions = 1, 0, [], []
  for j in range(seq_len):
    if j and docs[j] != docs[j - 1]:
      segment, position = segment + 1, 0
    segments.append(segment)
    positions.append(position)
    position += 1
  return {"inputs": record[:-1], "targets": record[1:], "loss_mask": (docs[1:] == docs[:-1]).astype(np.float32),
          "segment_ids": np.array(segments), "positions": np.array(positions)}


def test_packed_rows_carry_segment_ids_positions_and_mask_the_document_boundary(tmp_path):
  lengths = [3, 12, 1, 5, 9, 2, 20, 15]   # documents shorter than a row, one row long, spanning rows
  stream = _token_file(tmp_path / "d.bin", [np.arange(n) + 10 * i for i, n in enumerate(lengths)])
  document_of = np.repeat(np.arange(len(lengths)), np.array(lengths) + 1)
  c = _document_config(tmp_path / "d.bin", shuffle=False)
  assert section(c, "data").packs_documents
  batches = _take(data.make_iterator(c, 0, 1), 2)
  for k, batch in enumerate(batches):
    assert set(batch) == {"inputs", "targets", "loss_mask", "segment_ids", "positions"}
    assert batch["segment_ids"].dtype == batch["positions"].dtype == np.int32
    for row in range(4):
      expected = _expected_example(stream, document_of, (4 * k + row) * 8, 8)
      for key, value in expected.items():
        np.testing.assert_array_equal(batch[key][row], value, err_msg=f"batch {k} row {row} {key}")
  rows = {key: np.concatenate([b[key] for b in batches]) for key in batches[0]}
  assert np.all(rows["segment_ids"][:, 0] == 1) and np.all(rows["positions"][:, 0] == 0)
  assert np.all(np.diff(rows["segment_ids"], axis=1) >= 0)
  # Masked exactly where an EOS is the input: it would predict the next document's first token.
  boundary = (rows["inputs"] == data.EOS) & (rows["loss_mask"] == 0)
  assert np.array_equal(rows["loss_mask"] == 0, boundary) and boundary.sum() >= 5


def test_without_document_masking_rows_are_the_plain_windows(tmp_path):
  stream = _token_file(tmp_path / "d.bin", [np.arange(5), np.arange(30)])
  c = _document_config(tmp_path / "d.bin", shuffle=False, document_masking=False)
  assert not section(c, "data").packs_documents
  batch = next(data.make_iterator(c, 0, 1))
  assert set(batch) == {"inputs", "targets", "loss_mask"} and np.all(batch["loss_mask"] == 1)
  np.testing.assert_array_equal(batch["inputs"][1], stream[8:16])


def test_document_starts_come_from_the_index_else_split_after_eos(tmp_path):
  _token_file(tmp_path / "d.bin", [[1, 2], [3], [4, 5, 6]])
  token_file = token_files.TokenFile(str(tmp_path / "d.bin"))
  np.testing.assert_array_equal(token_file.document_starts, [0, 3, 5])

  # A file without a document index (a .npy, or an older file): its byte tokenizer's EOS ends each document.
  np.save(tmp_path / "n.npy", np.array([1, 2, data.EOS, 3, data.EOS, 4, 5, 6, data.EOS]))
  np.testing.assert_array_equal(token_files.TokenFile(str(tmp_path / "n.npy")).document_starts, [0, 3, 5])


def test_packed_rows_resume_exactly(tmp_path):
  _token_file(tmp_path / "d.bin", [np.arange(n % 13 + 1) for n in range(60)])
  _assert_resumes_exactly(_document_config(tmp_path / "d.bin", batch_size=4), (1, 2), taken=5, then=4)



# Mixtures.

def _mixture_files(tmp_path, vocab_sizes=(data.BYTE_VOCAB_SIZE, data.BYTE_VOCAB_SIZE)):
  """Two files whose tokens tell them apart: "a" in [0, 100), "b" in [100, 200)."""
  rng = np.random.default_rng(0)
  paths = []
  for name, low, vocab_size in zip("ab", (0, 100), vocab_sizes):
    paths.append(str(tmp_path / f"{name}.bin"))
    _token_file(paths[-1], [rng.integers(low, low + 100, size=rng.integers(1, 30)) for _ in range(200)], vocab_size)
  return paths


def _mixture_config(tmp_path, weights=(0.7, 0.3), batch_size=40):
  paths = _mixture_files(tmp_path)
  c = _config(source="tokens", mixture=",".join(f"{p}:{w}" for p, w in zip(paths, weights)))
  c.model.seq_len, c.model.vocab_size, c.train.batch_size = 8, data.BYTE_VOCAB_SIZE, batch_size
  config_lib.validate(c)
  return c


def _from_b(batch):
  """Which rows come from b.bin (every non-EOS token of a row is one file's)."""
  inputs = np.where(batch["inputs"] == data.EOS, -1, batch["inputs"])
  return inputs.max(axis=1) >= 100


def test_mixture_rows_follow_the_weights(tmp_path):
  c = _mixture_config(tmp_path, weights=(0.7, 0.3))
  rows = np.concatenate([_from_b(b) for b in _take(data.make_iterator(c, 0, 1), 250)])   # 10,000 rows
  assert len(rows) == 10_000 and abs(rows.mean() - 0.3) < 0.02
  c = _mixture_config(tmp_path, weights=(1, 3))   # weights need not sum to 1
  rows = np.concatenate([_from_b(b) for b in _take(data.make_iterator(c, 0, 1), 250)])
  assert abs(rows.mean() - 0.75) < 0.02


def test_mixture_resumes_exactly_and_splits_over_processes(tmp_path):
  c = _mixture_config(tmp_path, batch_size=8)
  _assert_resumes_exactly(c, (0, 1), taken=7, then=3)
  reference = _global_batches(c, 1, 6)
  assert "segment_ids" in reference[0]
  for count in (2, 4):
    _assert_batches_equal(reference, _global_batches(c, count, 6))


def test_mixture_eval_fraction_holds_out_documents_of_every_file(tmp_path):
  c = _mixture_config(tmp_path, weights=(0.5, 0.5), batch_size=8)
  c.data.eval_fraction, c.train.eval_batches = 0.2, 4
  config_lib.validate(c)
  eval_rows = np.concatenate([_from_b(b) for b in data.make_eval_iterator(c, 0, 1)])
  assert len(eval_rows) == 32 and abs(eval_rows.mean() - 0.5) <= 1 / 16
  train_sources = data.make_sources(c)
  eval_sources = data.make_sources(c, "eval")
  for (train, _), (held, _) in zip(train_sources, eval_sources):
    assert train.num_documents + held.num_documents == 200 and 20 < held.num_documents < 60


def test_mixture_files_must_share_a_tokenizer(tmp_path):
  a, b = _mixture_files(tmp_path, vocab_sizes=(data.BYTE_VOCAB_SIZE, 300))
  c = _config(source="tokens", mixture=f"{a}:1,{b}:1")
  c.model.seq_len, c.model.vocab_size = 8, 300
  with pytest.raises(config_lib.ConfigError, match=r"^data\.mixture=.*use different tokenizers; prepare every"):
    data.make_iterator(c, 0, 1)


# Evaluation data.

def _rows(batches):
  return [tuple(row) for batch in batches for row in batch["inputs"]]


def test_eval_fraction_holds_out_documents_that_training_never_reads(tmp_path):
  rng = np.random.default_rng(1)
  # Document i's tokens all equal i % 250 (< EOS): a token names its document (up to 250).
  documents = [np.full(rng.integers(2, 12), i) for i in range(200)]
  _token_file(tmp_path / "d.bin", documents)
  c = _document_config(tmp_path / "d.bin", batch_size=8, eval_fraction=0.2)
  held = data.held_out_documents(200, 0.2)
  assert 20 < held.sum() < 60
  train_tokens = {int(t) for b in _take(data.make_iterator(c, 0, 1), 60) for t in b["inputs"].ravel()} - {data.EOS}
  c.train.eval_batches = 3
  eval_batches = list(data.make_eval_iterator(c, 0, 1))
  eval_tokens = {int(t) for b in eval_batches for t in b["inputs"].ravel()} - {data.EOS}
  assert len(eval_batches) == 3 and set(eval_batches[0]) == set(_take(data.make_iterator(c, 0, 1), 1)[0])
  kept = set(np.flatnonzero(~held))   # all but the few in the tail after the last whole record
  assert train_tokens <= kept and len(train_tokens) >= len(kept) - 3 and eval_tokens <= set(np.flatnonzero(held))
  # Unshuffled, from the start: the held-out documents in file order.
  expected = np.concatenate([np.append(documents[i], data.EOS) for i in np.flatnonzero(held)])[:25]
  np.testing.assert_array_equal(np.concatenate([eval_batches[0]["inputs"][:3].ravel(), [eval_batches[0]["targets"][2, -1]]]),
                                expected)


def test_eval_pass_is_deterministic_finite_and_split_like_training(tmp_path):
  _token_file(tmp_path / "train.bin", [np.arange(20) % 50 for _ in range(30)])
  eval_stream = _token_file(tmp_path / "eval.bin", [np.arange(n) + 100 for n in (5, 17, 9, 30, 3)])
  c = _document_config(tmp_path / "train.bin", batch_size=4, eval_path=str(tmp_path / "eval.bin"))
  c.train.eval_batches = 2
  first, again = list(data.make_eval_iterator(c, 0, 1)), list(data.make_eval_iterator(c, 0, 1))
  assert len(first) == 2
  _assert_batches_equal(first, again)
  np.testing.assert_array_equal(first[0]["inputs"][0], eval_stream[:8])    # the eval file, in order
  np.testing.assert_array_equal(first[1]["inputs"][0], eval_stream[32:40])
  halves = [list(data.make_eval_iterator(c, p, 2)) for p in range(2)]
  for k in range(2):
    for key in first[k]:
      np.testing.assert_array_equal(first[k][key], np.concatenate([halves[0][k][key], halves[1][k][key]]))


def test_eval_from_eval_path_reads_no_training_byte(tmp_path):
  """With data.eval_path the training files are opened only for their tokenizers: a corrupt
  training file (same size, other bytes) is training's error, and no eval pass reads all of it."""
  stream = _token_file(tmp_path / "train.bin", [np.arange(20) % 50 for _ in range(30)])
  _token_file(tmp_path / "eval.bin", [np.arange(40) + 100])
  c = _document_config(tmp_path / "train.bin", eval_path=str(tmp_path / "eval.bin"))
  c.train.eval_batches = 1
  with open(tmp_path / "train.bin", "r+b") as f:
    f.write(np.asarray(stream[:4] + 1, np.uint16).tobytes())
  assert len(list(data.make_eval_iterator(c, 0, 1))) == 1
  with pytest.raises(config_lib.ConfigError, match="checksum"):
    data.make_iterator(c, 0, 1)


def test_a_npy_of_other_than_byte_tokens_is_one_document(tmp_path):
  """A .npy names no tokenizer: with ids past the byte vocabulary, 256 is a token like any
  other, not an EOS, and no document boundary is made up at it."""
  path = str(tmp_path / "gpt2.npy")
  np.save(path, np.tile(np.array([256, 5000, 17, 256, 300], np.int32), 20))
  c = _config(source="tokens", path=path, shuffle=False)
  c.model.seq_len, c.model.vocab_size, c.train.batch_size = 8, 5001, 4
  config_lib.validate(c)
  batch = next(data.make_iterator(c, 0, 1))
  assert np.all(batch["segment_ids"] == 1) and np.all(batch["loss_mask"] == 1)
  np.testing.assert_array_equal(batch["positions"], np.broadcast_to(np.arange(8), (4, 8)))
  # A .npy of byte tokens still splits at EOS = 256.
  np.save(path, np.tile(np.array([1, 2, data.EOS, 3], np.int32), 20))
  c.model.vocab_size = data.BYTE_VOCAB_SIZE
  assert data.make_iterator(c, 0, 1).__next__()["segment_ids"][0].max() > 1


def test_synthetic_eval_records_are_fresh_records_of_the_same_chain():
  c = _config()
  c.train.eval_batches = 2
  train_rows = set(_rows(_take(data.make_iterator(c, 0, 1), 13)))    # all 100 records, and then some
  eval_rows = _rows(data.make_eval_iterator(c, 0, 1))
  assert len(eval_rows) == 16 and not train_rows & set(eval_rows)
  source = data.make_sources(c, "eval")[0][0]
  np.testing.assert_array_equal(source[0], data.SyntheticSource(64, 16, 3, 200)[100])


def test_token_data_without_eval_data_has_no_eval_iterator(tmp_path):
  _token_file(tmp_path / "d.bin", [np.arange(40)])
  with pytest.raises(config_lib.ConfigError, match=r"^data\.eval_path='': .*eval_fraction=0\.01$"):
    data.make_eval_iterator(_document_config(tmp_path / "d.bin"), 0, 1)


def test_describe_data_names_source_tokenizer_vocab_tokens_documents_and_epochs(tmp_path):
  _token_file(tmp_path / "d.bin", [np.arange(99) % 200 for _ in range(10)])   # 1,000 tokens
  c = _document_config(tmp_path / "d.bin", batch_size=4)
  c.train.steps = 50                                                           # 50 * 4 * 8 = 1,600 tokens read
  line = data.describe_data(c)
  assert "\n" not in line
  assert line == (f"data: tokens from {tmp_path / 'd.bin'}; tokenizer bytes, vocab 257; 1,000 training tokens in "
                  "10 documents; document masking on; 50 steps read 1.6 epochs")
  synthetic = data.describe_data(_config())
  assert synthetic.startswith("data: synthetic") and "vocab 64" in synthetic and "epochs" in synthetic
  c = _mixture_config(tmp_path)
  assert "a.bin (70%) + " in data.describe_data(c) and "b.bin (30%)" in data.describe_data(c)


def test_a_vocab_far_larger_than_the_data_is_one_warning_line(tmp_path, caplog):
  """model.vocab_size over VOCAB_SLACK times the data's trains rows no id reaches: one warning
  naming the file and the fix; within it, nothing is said."""
  path = tmp_path / "d.bin"
  _token_file(path, [np.arange(40) % 200] * 4)
  config = _document_config(path)
  config.model.vocab_size = data.BYTE_VOCAB_SIZE * data.VOCAB_SLACK + 1
  with caplog.at_level("WARNING"):
    data.make_sources(config)
  warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "vocab_size" in r.getMessage()]
  assert len(warnings) == 1 and str(path) in warnings[0], warnings
  assert f"set --config.model.vocab_size={data.BYTE_VOCAB_SIZE}" in warnings[0]
  caplog.clear()
  config.model.vocab_size = data.BYTE_VOCAB_SIZE * data.VOCAB_SLACK
  with caplog.at_level("WARNING"):
    data.make_sources(config)
  assert not [r for r in caplog.records if "vocab_size" in r.getMessage()]
