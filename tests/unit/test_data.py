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
  sources, make_source = [], data.make_source          # sources[p]: process p's, made by make_iterator
  monkeypatch.setattr(data, "make_source", lambda config: sources.append(_RecordingSource(make_source(config)))
                      or sources[-1])
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
  iterator = data.make_iterator(c, process_index, process_count)
  _take(iterator, 3)
  state = json.loads(json.dumps(iterator.get_state()))
  assert state == {"next_index": 3}   # grain's own state: what every checkpoint's data state holds
  expected = _take(iterator, 2)
  resumed = data.make_iterator(c, process_index, process_count)
  resumed.set_state(state)
  _assert_batches_equal(expected, _take(resumed, 2))


def test_a_bad_id_in_a_batch_is_one_line_naming_file_record_and_id(tmp_path):
  tokens = np.arange(200) % 50
  tokens[130] = 99
  path = str(tmp_path / "tokens.bin")
  data.write_token_file(path, tokens, 100)
  with open(token_files.sidecar_path(path)) as f:
    meta = json.load(f)
  with open(token_files.sidecar_path(path), "w") as f:
    json.dump(dict(meta, vocab_size=64), f)   # a sidecar that lies about its ids
  c = _config(source="tokens", path=path, shuffle=False)
  c.model.seq_len, c.train.batch_size = 16, 2
  iterator = data.make_iterator(c, 0, 1)
  _take(iterator, 4)                         # records 0 .. 7
  with pytest.raises(config_lib.ConfigError) as error:
    next(iterator)                           # records 8 (tokens 128 .. 144) and 9
  assert str(error.value).startswith(f"data.path={path!r}: record 8 holds the id 99 (token 130), outside [0, 64)")


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
    assert ran_ahead.wait(timeout=60)
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
