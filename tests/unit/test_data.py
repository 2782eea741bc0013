"""megajax/data.py: determinism, sharding, resume, token files, the device prefetcher (megajax-prepare-data: tests/e2e)."""

import json
import os
import threading

import jax
import numpy as np
import pytest

from megajax import config as config_lib
from megajax import data


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


@pytest.mark.parametrize("source", ["synthetic", "tokens"])
def test_global_batch_is_the_same_for_any_process_count(tmp_path, source):
  c = _config() if source == "synthetic" else _arange_token_config(tmp_path)
  assert c.data.shuffle
  num_batches = 4  # 32 records: crosses an epoch boundary of the 21-record token file.
  reference = None
  for count in (1, 2, 4):
    per_process = [_take(data.make_iterator(c, p, count), num_batches) for p in range(count)]
    for local in per_process:
      assert local[0]["inputs"].shape == (8 // count, c.model.seq_len)
    global_batches = [
        {key: np.concatenate([per_process[p][k][key] for p in range(count)]) for key in local[0]}
        for k in range(num_batches)]
    if reference is None:
      reference = global_batches
    else:
      _assert_batches_equal(reference, global_batches)


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


def test_grain_iterator_state_json_round_trip_resumes_at_the_next_batch():
  c = _config()
  iterator = data.make_iterator(c, 1, 2)
  _take(iterator, 3)
  state = json.loads(json.dumps(iterator.get_state()))
  expected = _take(iterator, 2)
  resumed = data.make_iterator(c, 1, 2)
  resumed.set_state(state)
  _assert_batches_equal(expected, _take(resumed, 2))


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


@pytest.mark.parametrize("vocab_size,dtype", [(257, "uint16"), (70_000, "uint32")])
def test_bin_token_file_round_trip(tmp_path, vocab_size, dtype):
  rng = np.random.default_rng(0)
  docs = [rng.integers(0, vocab_size, size=n) for n in (50, 1, 30)]
  tokens = np.concatenate(docs)
  path = str(tmp_path / "sub" / "tokens.bin")
  assert data.write_token_file(path, iter(docs), vocab_size) == 81
  with open(str(tmp_path / "sub" / "tokens.json")) as f:
    assert json.load(f) == {"dtype": dtype, "vocab_size": vocab_size, "num_tokens": 81}
  assert sorted(os.listdir(tmp_path / "sub")) == ["tokens.bin", "tokens.json"]  # No temp files left.
  source = data.TokenFileSource(path, seq_len=8)
  assert len(source) == 10 and source.vocab_size == vocab_size
  for i in range(len(source)):
    assert source[i].dtype == np.int32
    np.testing.assert_array_equal(source[i], tokens[i * 8:i * 8 + 9])


def test_npy_token_file_round_trip(tmp_path):
  tokens = np.random.default_rng(1).integers(0, 100, size=40).astype(np.uint16)
  path = str(tmp_path / "tokens.npy")
  np.save(path, tokens)
  source = data.TokenFileSource(path, seq_len=6)
  assert len(source) == 6 and source.vocab_size == int(tokens.max()) + 1
  for i in range(len(source)):
    np.testing.assert_array_equal(source[i], tokens[i * 6:i * 6 + 7])


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


def test_encode_decode_round_trip_non_ascii():
  text = "Grüße, 世界! naïve café — ok 🙂\n"
  tokens = data.encode_text(text)
  assert tokens.dtype == np.int32 and tokens.min() >= 0 and tokens.max() < 256
  assert len(tokens) == len(text.encode("utf-8")) > len(text)
  assert data.decode_tokens(tokens) == text
  assert data.decode_tokens(np.concatenate([tokens, [data.EOS]])) == text


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
