"""megajax/token_files.py: writing, the document index, every bad file as one ConfigError line,
the per-record id check, the checksums, old sidecars (without checksum, without index), and
megajax-prepare-data's library (megajax/text_inputs.py: readers, the parallel pass, every bad
input; in process; the command line itself: tests/e2e/test_commands.py; tokenizers:
tests/unit/test_tokenizer.py)."""

import gzip
import json
import os

import numpy as np
import pyarrow
import pyarrow.parquet
import pytest

from megajax import text_inputs
from megajax import token_files
from megajax.config import ConfigError
from megajax.token_files import PrepareError, TokenFileSource


def _write(tmp_path, tokens=None, vocab_size=257, name="tokens.bin"):
  path = str(tmp_path / name)
  tokens = np.arange(40) % vocab_size if tokens is None else tokens
  token_files.write_token_file(path, tokens, vocab_size)
  return path


def _edit_sidecar(path, **fields):
  meta_path = token_files.sidecar_path(path)
  with open(meta_path) as f:
    meta = json.load(f)
  meta.update(fields)
  for name in [name for name, value in meta.items() if value is None]:
    del meta[name]
  with open(meta_path, "w") as f:
    json.dump(meta, f)


def _one_line_error(path, match, **kwargs):
  with pytest.raises(ConfigError) as error:
    TokenFileSource(path, seq_len=4, **kwargs)
  message = str(error.value)
  assert "\n" not in message and message.startswith(f"data.path={path!r}: "), message
  assert error.match(match), message
  return message


@pytest.mark.parametrize("vocab_size,dtype", [(257, "uint16"), (65536, "uint16"), (70_000, "uint32")])
def test_bin_token_file_round_trip(tmp_path, vocab_size, dtype):
  rng = np.random.default_rng(0)
  docs = [rng.integers(0, vocab_size, size=n) for n in (50, 1, 30)]
  tokens = np.concatenate(docs)
  path = str(tmp_path / "sub" / "tokens.bin")
  meta = token_files.write_token_file(path, iter(docs), vocab_size)
  starts = np.array([0, 50, 51], np.int64)
  expected = {"dtype": dtype, "vocab_size": vocab_size, "num_tokens": 81, "num_documents": 3,
              "checksum": token_files.checksum(tokens.astype(dtype)),
              "index": {"file": "tokens.idx", "checksum": token_files.checksum(starts)}}
  assert meta == expected and expected["checksum"].startswith("crc32:")
  with open(str(tmp_path / "sub" / "tokens.json")) as f:
    assert json.load(f) == expected
  assert sorted(os.listdir(tmp_path / "sub")) == ["tokens.bin", "tokens.idx", "tokens.json"]  # No temp files left.
  np.testing.assert_array_equal(np.fromfile(str(tmp_path / "sub" / "tokens.idx"), "<i8"), starts)
  source = TokenFileSource(path, seq_len=8)
  assert len(source) == 10 and source.vocab_size == vocab_size
  np.testing.assert_array_equal(source.document_starts, starts)
  assert source.document_starts.dtype == np.int64 and source.tokenizer == token_files.BYTES_TOKENIZER
  for i in range(len(source)):
    assert source[i].dtype == np.int32
    np.testing.assert_array_equal(source[i], tokens[i * 8:i * 8 + 9])
  assert token_files.verify_token_file(path) == expected


def test_npy_token_file_round_trip(tmp_path):
  tokens = np.random.default_rng(1).integers(0, 100, size=40).astype(np.uint16)
  path = str(tmp_path / "tokens.npy")
  np.save(path, tokens)
  source = TokenFileSource(path, seq_len=6)
  assert len(source) == 6 and source.vocab_size == int(tokens.max()) + 1
  for i in range(len(source)):
    np.testing.assert_array_equal(source[i], tokens[i * 6:i * 6 + 7])


def test_writer_refuses_out_of_range_ids_and_no_tokens(tmp_path):
  with pytest.raises(ValueError, match=r"in \[0, 257\), got \[0, 300\]"):
    _write(tmp_path, np.array([0, 300]))
  with pytest.raises(ValueError, match="no tokens"):
    token_files.write_token_file(str(tmp_path / "e.bin"), [np.array([], np.int32)], 257)
  assert os.listdir(tmp_path) == []


def test_encode_decode_round_trip_non_ascii():
  text = "Grüße, 世界! naïve café — ok 🙂\n"
  tokens = token_files.encode_text(text)
  assert tokens.dtype == np.int32 and tokens.min() >= 0 and tokens.max() < 256
  assert len(tokens) == len(text.encode("utf-8")) > len(text)
  assert token_files.decode_tokens(tokens) == text
  assert token_files.decode_tokens(np.concatenate([tokens, [token_files.EOS]])) == text


# Every bad file: (how to spoil a good one, what its one line says).

def _append_byte(path):
  with open(path, "ab") as f:
    f.write(b"\0")


def _empty_bin(path):
  open(path, "wb").close()


def _flip_a_byte(path):
  with open(path, "r+b") as f:
    f.seek(10)
    f.write(b"\x07")   # token 5 becomes id 7 (still in range): only the checksum notices


def _sidecar_text(text):
  def spoil(path):
    with open(token_files.sidecar_path(path), "wb") as f:
      f.write(text)
  return spoil


def _sidecar(**fields):
  return lambda path: _edit_sidecar(path, **fields)


def _as_uint32_file(path):   # The tokens stored as uint32, the sidecar still says uint16.
  np.fromfile(path, np.uint16).astype(np.uint32).tofile(path)


def _as_uint16_file(path):   # A uint16 file whose sidecar says uint32 (and keeps its count).
  _edit_sidecar(path, dtype="uint32")


def _index(path):
  return token_files.index_path(path)


def _index_holds(*starts, fix_checksum=True):   # the index rewritten; its checksum updated or not
  def spoil(path):
    np.array(starts, "<i8").tofile(_index(path))
    if fix_checksum:
      _edit_sidecar(path, num_documents=len(starts), index={"file": "tokens.idx",
                                                            "checksum": token_files.checksum(np.array(starts, "<i8"))})
  return spoil


BAD_BIN_FILES = {
    "odd byte count": (_append_byte, "holds 81 bytes, not a whole number of uint16 tokens"),
    "empty .bin": (_empty_bin, r"is empty \(0 bytes\)"),
    "no sidecar": (lambda path: os.remove(token_files.sidecar_path(path)), "no sidecar .*tokens.json"),
    "sidecar not JSON": (_sidecar_text(b"dtype=uint16"), "sidecar .* is not readable JSON"),
    "sidecar garbled": (_sidecar_text(b'{"dtype": "uint16", "vocab_si'), "is not readable JSON"),
    "sidecar not UTF-8": (_sidecar_text(b"\xff\xfe\x00"), "is not readable JSON"),
    "sidecar a list": (_sidecar_text(b"[1, 2]"), "holds list, not a JSON object"),
    "sidecar without num_tokens": (_sidecar(num_tokens=None), "has no 'num_tokens'"),
    "sidecar without dtype": (_sidecar(dtype=None), "has no 'dtype'"),
    "sidecar float dtype": (_sidecar(dtype="float32"), "dtype='float32': not one of uint16, uint32"),
    "sidecar vocab_size a string": (_sidecar(vocab_size="257"), "vocab_size='257': must be a positive integer"),
    "sidecar vocab_size 0": (_sidecar(vocab_size=0), "vocab_size=0: must be a positive integer"),
    "sidecar vocab_size over its dtype": (_sidecar(vocab_size=70_000), "more ids than uint16 holds"),
    "sidecar num_documents true": (_sidecar(num_documents=True), "num_documents=True: must be a positive"),
    "sidecar checksum garbled": (_sidecar(checksum="crc32:12x"), "checksum='crc32:12x': not 'crc32:"),
    "token count mismatch": (_sidecar(num_tokens=41), "holds 40 uint16 tokens .* says num_tokens=41"),
    "data uint32, sidecar uint16": (_as_uint32_file, "sidecar's dtype=uint16 is wrong: the size fits 40 uint32"),
    "data uint16, sidecar uint32": (_as_uint16_file, "sidecar's dtype=uint32 is wrong: the size fits 40 uint16"),
    "checksum mismatch": (_flip_a_byte, "checksum crc32:[0-9a-f]{8} is not the crc32:[0-9a-f]{8} its sidecar"),
    "index missing": (lambda path: os.remove(_index(path)), r"its document index .*tokens.idx is missing"),
    "index truncated": (lambda path: open(_index(path), "ab").write(b"\0\0\0"),
                        "holds 11 bytes, not num_documents=1 int64 starts"),
    "index checksum mismatch": (_index_holds(7, fix_checksum=False), "document index's checksum crc32:"),
    "index not from 0": (_index_holds(7), "is not 1 strictly increasing starts from 0 below num_tokens=40"),
    "index decreasing": (_index_holds(0, 9, 5), "is not 3 strictly increasing starts"),
    "index past the tokens": (_index_holds(0, 40), "below num_tokens=40"),
    "index entry elsewhere": (_sidecar(index={"file": "../x.idx", "checksum": "crc32:00000000"}), "index=.*: not {"),
    "index without num_documents": (_sidecar(num_documents=None), "has an index but no 'num_documents'"),
    "tokenizer kind unknown": (_sidecar(tokenizer={"kind": "wordpiece", "file": "t.json", "eos_id": 1}),
                               "tokenizer=.*: not {\"kind\": one of bytes, huggingface, sentencepiece"),
    "tokenizer EOS past vocab": (_sidecar(tokenizer={"kind": "bytes", "file": None, "eos_id": 300}),
                                 "eos_id\": an id below vocab_size"),
    "bytes tokenizer with a file": (_sidecar(tokenizer={"kind": "bytes", "file": "t.json", "eos_id": 256}),
                                    "null for bytes"),
    "tokenizer file elsewhere": (_sidecar(tokenizer={"kind": "huggingface", "file": "a/t.json", "eos_id": 0}),
                                 "a file name beside it"),
}


@pytest.mark.parametrize("case", BAD_BIN_FILES)
def test_every_bad_bin_file_is_one_config_error_line(tmp_path, case):
  spoil, match = BAD_BIN_FILES[case]
  path = _write(tmp_path)
  spoil(path)
  _one_line_error(path, match)


def _npy_bytes(data):
  def write(path):
    with open(path, "wb") as f:
      f.write(data)
  return write


BAD_NPY_FILES = {
    "empty .npy": (_npy_bytes(b""), r"is not a readable \.npy array"),
    "garbage .npy": (_npy_bytes(b"hello, not numpy" * 8), r"is not a readable \.npy array"),
    "object .npy": (lambda path: np.save(path, np.array([{"a": 1}], dtype=object)), r"not a readable \.npy"),
    "2-D .npy": (lambda path: np.save(path, np.zeros((2, 3), np.int32)), r"int32 array of shape \(2, 3\)"),
    "float .npy": (lambda path: np.save(path, np.arange(10.0)), r"float64 array of shape \(10,\)"),
    "no tokens .npy": (lambda path: np.save(path, np.zeros(0, np.int32)), "holds no tokens"),
    "negative id .npy": (lambda path: np.save(path, np.array([1, 2, -3, 4] * 3)), r"negative id -3 \(token 2\)"),
}


@pytest.mark.parametrize("case", BAD_NPY_FILES)
def test_every_bad_npy_file_is_one_config_error_line(tmp_path, case):
  write, match = BAD_NPY_FILES[case]
  path = str(tmp_path / "tokens.npy")
  write(path)
  _one_line_error(path, match)


def test_too_short_and_unknown_suffix(tmp_path):
  _one_line_error(_write(tmp_path, np.arange(4)), "has 4 tokens, fewer than one record of model.seq_len")
  (tmp_path / "tokens.txt").write_text("hi")
  _one_line_error(str(tmp_path / "tokens.txt"), "not a .bin or .npy token file")


def test_a_record_with_an_id_beyond_the_vocabulary_names_the_file_record_and_id(tmp_path):
  tokens = np.arange(40) % 200
  tokens[22] = 900
  path = _write(tmp_path, tokens, vocab_size=1000)
  _edit_sidecar(path, vocab_size=257)   # The sidecar lies; the bytes (and their checksum) are intact.
  source = TokenFileSource(path, seq_len=4)
  np.testing.assert_array_equal(source[4], tokens[16:21])
  with pytest.raises(ConfigError) as error:
    source[5]
  assert str(error.value) == (f"data.path={path!r}: record 5 holds the id 900 (token 22), outside [0, 257) of its "
                              "sidecar; the file is corrupt: rerun megajax-prepare-data to rewrite it")
  with pytest.raises(ConfigError, match=r"the tokens from 0 holds the id 900 \(token 22\)"):
    token_files.verify_token_file(path)


def test_checksum_verification_can_be_turned_off(tmp_path):
  path = _write(tmp_path)
  _flip_a_byte(path)
  source = TokenFileSource(path, seq_len=4, verify_checksum=False)
  assert source[1][1] == 7
  with pytest.raises(ConfigError, match="checksum"):
    token_files.verify_token_file(path)


def test_old_sidecars_without_checksum_still_load_with_a_warning(tmp_path, caplog):
  path = _write(tmp_path)
  _edit_sidecar(path, checksum=None, num_documents=None, index=None)
  with open(token_files.sidecar_path(path)) as f:
    assert json.load(f) == {"dtype": "uint16", "vocab_size": 257, "num_tokens": 40}   # the older format
  source = TokenFileSource(path, seq_len=4)
  np.testing.assert_array_equal(source[8], np.arange(32, 37))
  assert "has no checksum" in caplog.text and "rerun megajax-prepare-data" in caplog.text
  with pytest.raises(ConfigError, match="no checksum to verify"):
    token_files.verify_token_file(path)
  _append_byte(path)   # Its size is still checked.
  _one_line_error(path, "not a whole number")


def test_old_files_without_an_index_derive_documents_from_eos_with_a_warning(tmp_path, caplog):
  eos = token_files.EOS
  path = _write(tmp_path, np.array([1, 2, eos, 3, eos, 4, 5, 6, eos, 7]))
  _edit_sidecar(path, index=None, num_documents=None)
  source = TokenFileSource(path, seq_len=4)
  np.testing.assert_array_equal(source.document_starts, [0, 3, 5, 9])
  assert "has no document index" in caplog.text and "EOS id 256" in caplog.text
  token_files.verify_token_file(path)   # the rest still verifies
  path = _write(tmp_path, np.array([1, 2, eos, 3, 4, eos]), name="b.bin")   # the last EOS starts no document
  _edit_sidecar(path, index=None)
  np.testing.assert_array_equal(TokenFileSource(path, seq_len=4).document_starts, [0, 3])


def test_documents_as_chunks_with_lengths(tmp_path):
  """The writer's other input: (tokens, lengths) pairs, several documents each; empty ones dropped."""
  path = str(tmp_path / "c.bin")
  chunks = [(np.arange(6), [2, 0, 4]), (np.zeros(0, np.int32), []), (np.arange(3), [3])]
  meta = token_files.write_token_file(path, iter(chunks), 257)
  assert meta["num_documents"] == 3 and meta["num_tokens"] == 9
  np.testing.assert_array_equal(token_files.TokenFile(path).document_starts, [0, 2, 6])
  with pytest.raises(ValueError, match="lengths sum to 2, not to their 3 tokens"):
    token_files.write_token_file(path, [(np.arange(3), [2])], 257)


# megajax-prepare-data's library (megajax/text_inputs.py).

def test_prepare_text_files_writes_one_document_per_non_empty_file(tmp_path):
  (tmp_path / "a.txt").write_text("héllo\n", encoding="utf-8")
  (tmp_path / "b.txt").write_text("", encoding="utf-8")
  (tmp_path / "c.txt").write_text("bye", encoding="utf-8")
  output = str(tmp_path / "out" / "corpus.bin")
  meta, paths, stats = text_inputs.prepare_text_files([str(tmp_path / "*.txt")], output, workers=1)
  assert [os.path.basename(p) for p in paths] == ["a.txt", "b.txt", "c.txt"]
  assert stats["documents"] == 2 and stats["tokens"] == meta["num_tokens"] and stats["workers"] == 1
  expected = np.concatenate([token_files.encode_text("héllo\n"), [token_files.EOS], token_files.encode_text("bye"),
                             [token_files.EOS]])
  assert meta["num_tokens"] == len(expected) and meta["num_documents"] == 2
  np.testing.assert_array_equal(np.fromfile(output, np.uint16), expected)
  np.testing.assert_array_equal(TokenFileSource(output, seq_len=4).document_starts, [0, 8])
  assert meta["tokenizer"] == {"kind": "bytes", "file": None, "eos_id": 256}
  meta, _, _ = text_inputs.prepare_text_files([str(tmp_path / "c.txt")], output, eos=False, workers=1)
  assert token_files.decode_tokens(np.fromfile(output, np.uint16)) == "bye" and meta["num_tokens"] == 3


def test_prepare_text_files_refusals_write_nothing(tmp_path):
  (tmp_path / "a.txt").write_text("text")
  (tmp_path / "empty.txt").write_text("")
  (tmp_path / "folder").mkdir()
  (tmp_path / "taken.bin").mkdir()
  good = str(tmp_path / "out.bin")
  refusals = [
      ([str(tmp_path / "none*.txt")], good, "input error", "matches no file"),
      ([str(tmp_path / "folder")], good, "input error", "is a directory; pass its files"),
      ([str(tmp_path / "empty.txt")], good, "input error", "the 1 input file(s) are empty"),
      ([str(tmp_path / "a.txt")], str(tmp_path / "taken.bin"), "output error", "is a directory; name the token file"),
      ([str(tmp_path / "a.txt")], str(tmp_path / "a.txt" / "out.bin"), "output error", "is a file, not a folder"),
      ([str(tmp_path / "a.txt")], str(tmp_path / "a.txt" / "deeper" / "out.bin"), "output error",
       "cannot create the folder"),
  ]
  for patterns, output, kind, words in refusals:
    with pytest.raises(PrepareError) as error:
      text_inputs.prepare_text_files(patterns, output, workers=1)
    assert error.value.kind == kind and words in str(error.value), str(error.value)
    assert "\n" not in str(error.value)
  assert sorted(os.listdir(tmp_path)) == ["a.txt", "empty.txt", "folder", "taken.bin"]



def test_not_utf8_text_is_kept_byte_for_byte_by_the_byte_tokenizer(tmp_path):
  raw = b"caf\xe9 \xff\xfe ok"
  (tmp_path / "latin1.txt").write_bytes(raw)
  output = str(tmp_path / "out.bin")
  text_inputs.prepare_text_files([str(tmp_path / "latin1.txt")], output, workers=1)
  np.testing.assert_array_equal(np.fromfile(output, np.uint16), [*raw, token_files.EOS])


def _corpus(tmp_path):
  """Ten documents over a .txt (blank-line blocks), a .jsonl, a .jsonl.gz and a .parquet."""
  docs = [f"document {i}: " + "words and more words " * (i + 1) for i in range(10)]
  (tmp_path / "a.txt").write_text(f"{docs[0]}\n\n\n{docs[1]}\n  \n{docs[2]}\n\n", encoding="utf-8")
  with open(tmp_path / "b.jsonl", "w") as f:
    for doc in docs[3:5]:
      f.write(json.dumps({"text": doc, "id": 1}) + "\n\n")
    f.write(json.dumps({"text": ""}) + "\n")    # an empty text is no document
  with gzip.open(tmp_path / "c.jsonl.gz", "wt") as f:
    f.writelines(json.dumps({"text": doc}) + "\n" for doc in docs[5:7])
  pyarrow.parquet.write_table(pyarrow.table({"text": docs[7:] + [None], "n": [1, 2, 3, 4]}), tmp_path / "d.parquet")
  return [str(tmp_path / name) for name in ("a.txt", "b.jsonl", "c.jsonl.gz", "d.parquet")], docs


def test_every_input_format_and_the_document_index(tmp_path):
  inputs, docs = _corpus(tmp_path)
  output = str(tmp_path / "out" / "corpus.bin")
  meta, _, stats = text_inputs.prepare_text_files(inputs, output, documents="blank_line", workers=1)
  assert meta["num_documents"] == stats["documents"] == 10
  source = TokenFileSource(output, seq_len=4)
  starts = source.document_starts
  ends = [*starts[1:], meta["num_tokens"]]
  tokens = np.asarray(source.tokens)
  for doc, start, end in zip(docs, starts, ends):
    assert tokens[end - 1] == token_files.EOS
    assert token_files.decode_tokens(tokens[start:end]) == doc
  assert token_files.verify_token_file(output)["num_documents"] == 10
  meta, _, _ = text_inputs.prepare_text_files(inputs[:1], output, workers=1)   # documents="file": one
  assert meta["num_documents"] == 1


BAD_INPUTS = {
    "jsonl row without the field": ("x.jsonl", b'{"text": "a"}\n{"body": "b"}\n',
                                    r"x.jsonl:2 has no 'text' field \(its fields: 'body'\); name the text with --text-field"),
    "jsonl row not JSON": ("x.jsonl", b'{"text": "a"}\n{"text": \n', r"x.jsonl:2 is not JSON \("),
    "jsonl row a list": ("x.jsonl", b'[1, 2]\n', "x.jsonl:1 holds a list, not a JSON object"),
    "jsonl text a number": ("x.jsonl", b'{"text": 12}\n', "x.jsonl:1 has text=12, not a string"),
    "jsonl not UTF-8": ("x.jsonl", b'{"text": "\xff"}\n', r"cannot read .*x.jsonl \(line 1\)"),
    "jsonl.gz not gzip": ("x.jsonl.gz", b"plain text", r"cannot read .*x.jsonl.gz \(line 1\): Not a gzipped file"),
    "parquet garbage": ("x.parquet", b"not parquet at all", r"x.parquet is not a readable Parquet file \("),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_every_bad_input_is_one_line_naming_the_file(tmp_path, case):
  name, content, match = BAD_INPUTS[case]
  (tmp_path / name).write_bytes(content)
  with pytest.raises(PrepareError) as error:
    text_inputs.prepare_text_files([str(tmp_path / name)], str(tmp_path / "out.bin"), workers=1)
  assert error.value.kind == "input error" and "\n" not in str(error.value), str(error.value)
  assert error.match(match), str(error.value)
  assert sorted(os.listdir(tmp_path)) == [name]   # nothing written


def test_parquet_column_missing_or_not_strings(tmp_path):
  path = str(tmp_path / "x.parquet")
  pyarrow.parquet.write_table(pyarrow.table({"body": ["a"], "n": [1]}), path)
  with pytest.raises(PrepareError, match=r"x.parquet has no column 'text' \(its columns: 'body', 'n'\)"):
    text_inputs.prepare_text_files([path], str(tmp_path / "o.bin"), workers=1)
  with pytest.raises(PrepareError, match="x.parquet's column 'n' holds int64, not strings"):
    text_inputs.prepare_text_files([path], str(tmp_path / "o.bin"), text_field="n", workers=1)
  meta, _, _ = text_inputs.prepare_text_files([path], str(tmp_path / "o.bin"), text_field="body", workers=1)
  assert meta["num_tokens"] == 2


@pytest.mark.parametrize("kwargs, kind, words", [
    (dict(tokenizer="t.json", train_tokenizer="bpe", vocab_size=300), "usage error", "not both"),
    (dict(vocab_size=300), "usage error", "go together"),
    (dict(train_tokenizer="bpe"), "usage error", "go together"),
    (dict(train_tokenizer="unigram", vocab_size=300), "usage error", "the one trainer is 'bpe'"),
    (dict(documents="paragraph"), "usage error", "--documents=paragraph: one of file, blank_line"),
    (dict(workers=0), "usage error", "--workers=0: at least 1"),
    (dict(train_tokenizer="bpe", vocab_size=257), "tokenizer error", "--vocab-size=257: a byte-level BPE needs 258"),
    (dict(train_tokenizer="bpe", vocab_size=1 << 21), "tokenizer error", "needs 258 to 1048576"),
    (dict(tokenizer="nothing/here.json"), "tokenizer error", "no tokenizer file nothing/here.json"),
    (dict(tokenizer="vocab.txt"), "tokenizer error", "expected 'bytes', a Hugging Face tokenizer.json"),
])
def test_bad_flags_are_one_line_before_any_input_is_read(tmp_path, kwargs, kind, words):
  with pytest.raises(PrepareError) as error:
    text_inputs.prepare_text_files([str(tmp_path / "none*.txt")], str(tmp_path / "o.bin"), **kwargs)
  assert error.value.kind == kind and words in str(error.value) and "\n" not in str(error.value), str(error.value)
