"""megajax/tokenizer.py: the byte tokenizer, a byte-level BPE trained here, a tokenizer.json
and a sentencepiece model (each made by the test, offline), every bad tokenizer as one line,
and the tokenizer travelling with the data (sidecar entry, tokenizer_of, copy_tokenizer)."""

import json
import os
import random

import jax
import numpy as np
import pytest
import sentencepiece
import tokenizers

from megajax import data
from megajax import text_inputs
from megajax import token_files
from megajax import tokenizer as tok
from megajax.config import ConfigError
from megajax.token_files import PrepareError
from megajax.trainer import train

WORDS = "the quick brown fox jumps over a lazy dog while data tokens flow through the model".split()


def _texts(count=60, seed=0):
  rng = random.Random(seed)
  return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40))) + rng.choice([".", "!", " ünïcödé 世界"])
          for _ in range(count)]


def _write_texts(folder, texts, files=3):
  folder.mkdir(exist_ok=True)
  for i in range(files):
    (folder / f"{i}.txt").write_text("\n\n".join(texts[i::files]), encoding="utf-8")
  return [str(folder / "*.txt")]


@pytest.fixture(scope="module")
def bpe():
  return tok.train_bpe(_texts(), vocab_size=320)


def test_bytes_round_trip_and_its_sidecar_entry():
  tokenizer = tok.load_tokenizer("bytes")
  text = "Grüße, 世界 🙂"
  ids = tokenizer.encode(text)
  assert ids.dtype == np.int32 and tokenizer.decode(np.append(ids, tokenizer.eos_id)) == text
  assert (tokenizer.kind, tokenizer.vocab_size, tokenizer.eos_id, tokenizer.file) == ("bytes", 257, 256, None)
  assert tok.sidecar_entry(tokenizer, "d/x.bin") == {"kind": "bytes", "file": None, "eos_id": 256}


def test_trained_bpe_round_trips_and_compresses(bpe):
  assert bpe.kind == "huggingface" and bpe.eos_id == 0 and 257 < bpe.vocab_size <= 320
  for text in _texts(10, seed=1) + ["unseen wörds: xyz 123 \t\n"]:
    ids = bpe.encode(text)
    assert ids.dtype == np.int32 and ids.max() < bpe.vocab_size and tok.BPE_EOS not in bpe.decode(ids)
    assert bpe.decode(ids) == text
  sample = " ".join(_texts(5, seed=2))
  assert len(bpe.encode(sample)) < len(sample.encode("utf-8")) / 2   # merges learned
  again = tok.train_bpe(_texts(), vocab_size=320)
  assert again.tokenizer.to_str() == bpe.tokenizer.to_str()   # deterministic


def test_tokenizer_json_from_a_file(tmp_path, bpe):
  path = str(tmp_path / "tokenizer.json")
  bpe.save(path)
  loaded = tok.load_tokenizer(path)
  assert (loaded.kind, loaded.vocab_size, loaded.eos_id, loaded.file) == ("huggingface", bpe.vocab_size, 0, path)
  text = _texts(1, seed=3)[0]
  np.testing.assert_array_equal(loaded.encode(text), bpe.encode(text))
  assert [list(ids) for ids in loaded.encode_batch([text, "b"])] == [list(bpe.encode(text)), list(bpe.encode("b"))]


def test_sentencepiece_model_trained_here(tmp_path):
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("\n".join(_texts(200)), encoding="utf-8")
  sentencepiece.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "spm"), vocab_size=80,
                                           model_type="bpe", minloglevel=2)
  loaded = tok.load_tokenizer(str(tmp_path / "spm.model"))
  assert (loaded.kind, loaded.vocab_size, loaded.eos_id) == ("sentencepiece", 80, 2)
  text = "the lazy dog jumps over the quick fox."
  assert loaded.decode(loaded.encode(text)) == text and len(loaded.encode_batch([text, text])) == 2


def _bad_file(tmp_path, name, content):
  path = tmp_path / name
  path.write_bytes(content)
  return str(path)


def test_every_bad_tokenizer_is_one_line(tmp_path, bpe):
  no_eos = json.loads(bpe.tokenizer.to_str())
  no_eos["added_tokens"] = []
  del no_eos["model"]["vocab"][tok.BPE_EOS]
  cases = [
      ("missing.json", "no tokenizer file .*missing.json"),
      (_bad_file(tmp_path, "t.json", b'{"version": '), r"t.json is not a Hugging Face tokenizer.json \("),
      (_bad_file(tmp_path, "u.json", b'{"a": 1}'), r"u.json is not a Hugging Face tokenizer.json \("),
      (_bad_file(tmp_path, "n.json", json.dumps(no_eos).encode()), "n.json has no end-of-text token"),
      (_bad_file(tmp_path, "m.model", b"not a protobuf"), r"m.model is not a sentencepiece model \("),
      ("vocab.txt", "expected 'bytes', a Hugging Face tokenizer.json or a sentencepiece .model"),
  ]
  for spec, match in cases:
    with pytest.raises(tok.TokenizerError, match=match) as error:
      tok.load_tokenizer(spec if os.path.isabs(spec) or spec == "vocab.txt" else str(tmp_path / spec))
    assert "\n" not in str(error.value), str(error.value)


def _decoded_documents(path, tokenizer):
  token_file = token_files.TokenFile(path)
  starts = [*token_file.document_starts, len(token_file.tokens)]
  documents = []
  for start, end in zip(starts, starts[1:]):
    assert token_file.tokens[end - 1] == tokenizer.eos_id
    documents.append(tokenizer.decode(token_file.tokens[start:end - 1]))
  return documents


def test_trained_bpe_travels_with_the_data(tmp_path):
  texts = _texts()
  output = str(tmp_path / "out" / "corpus.bin")
  meta, _, _ = text_inputs.prepare_text_files(_write_texts(tmp_path / "in", texts), output, train_tokenizer="bpe",
                                              vocab_size=300, documents="blank_line", workers=1)
  assert meta["tokenizer"] == {"kind": "huggingface", "file": "corpus.tokenizer.json", "eos_id": 0,
                               "digest": tok.file_digest(str(tmp_path / "out" / "corpus.tokenizer.json"))}
  assert sorted(os.listdir(tmp_path / "out")) == ["corpus.bin", "corpus.idx", "corpus.json", "corpus.tokenizer.json"]
  tokenizer = tok.tokenizer_of(output)
  assert meta["vocab_size"] == tokenizer.vocab_size <= 300 and meta["num_documents"] == len(texts)
  assert sorted(_decoded_documents(output, tokenizer)) == sorted(texts)
  copied = tok.copy_tokenizer(output, str(tmp_path / "workdir"))
  assert copied == str(tmp_path / "workdir" / "corpus.tokenizer.json")
  assert tok.load_tokenizer(copied).tokenizer.to_str() == tokenizer.tokenizer.to_str()
  os.remove(str(tmp_path / "out" / "corpus.tokenizer.json"))
  for function in (tok.tokenizer_of, lambda path: tok.copy_tokenizer(path, str(tmp_path / "w2"))):
    with pytest.raises(ConfigError, match="names the tokenizer file corpus.tokenizer.json, which is not beside it"):
      function(output)


def test_a_tokenizer_file_is_copied_beside_the_data(tmp_path, bpe):
  bpe.save(str(tmp_path / "tokenizer.json"))
  texts = _texts(12)
  output = str(tmp_path / "d.bin")
  meta, _, _ = text_inputs.prepare_text_files(_write_texts(tmp_path / "in", texts), output,
                                              tokenizer=str(tmp_path / "tokenizer.json"), documents="blank_line",
                                              workers=1)
  assert meta["tokenizer"]["file"] == "d.tokenizer.json" and (tmp_path / "d.tokenizer.json").is_file()
  assert sorted(_decoded_documents(output, tok.tokenizer_of(output))) == sorted(texts)
  # Rerunning with the copy itself as the tokenizer keeps it in place.
  text_inputs.prepare_text_files([str(tmp_path / "in" / "0.txt")], output,
                                 tokenizer=str(tmp_path / "d.tokenizer.json"), workers=1)
  assert tok.tokenizer_of(output).vocab_size == bpe.vocab_size


def test_a_tokenizer_json_whose_ids_have_holes_covers_its_largest_id(tmp_path):
  """vocab_size is one past the largest id, not the number of tokens: an end-of-text token
  numbered past the vocabulary (ids 0, 1 and 7) once made the writer's range check a traceback."""
  holes = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1, tok.BPE_EOS: 7}, unk_token="a"))
  holes.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  holes.save(str(tmp_path / "holes.json"))
  loaded = tok.load_tokenizer(str(tmp_path / "holes.json"))
  assert (loaded.vocab_size, loaded.eos_id) == (8, 7)
  (tmp_path / "in.txt").write_text("a b a", encoding="utf-8")
  meta, _, _ = text_inputs.prepare_text_files([str(tmp_path / "in.txt")], str(tmp_path / "d.bin"),
                                              tokenizer=str(tmp_path / "holes.json"), workers=1)
  assert meta["vocab_size"] == 8 and token_files.verify_token_file(str(tmp_path / "d.bin"))["num_tokens"] == 4


def test_a_sentencepiece_model_travels_with_the_data(tmp_path):
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("\n".join(_texts(200)), encoding="utf-8")
  sentencepiece.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "spm"), vocab_size=80,
                                           model_type="bpe", minloglevel=2)
  output = str(tmp_path / "sp.bin")
  meta, _, _ = text_inputs.prepare_text_files([str(corpus)], output, tokenizer=str(tmp_path / "spm.model"),
                                              workers=1)
  assert meta["tokenizer"] == {"kind": "sentencepiece", "file": "sp.tokenizer.model", "eos_id": 2,
                               "digest": tok.file_digest(str(tmp_path / "spm.model"))}
  assert meta["vocab_size"] == 80 and meta["num_documents"] == 1
  assert tok.tokenizer_of(output).kind == "sentencepiece"
  assert tok.copy_tokenizer(output, str(tmp_path / "w")).endswith("sp.tokenizer.model")


def test_bytes_data_has_no_tokenizer_file_to_copy(tmp_path):
  path = str(tmp_path / "b.bin")
  token_files.write_token_file(path, np.arange(10), 257)   # no "tokenizer" entry: bytes
  assert tok.tokenizer_of(path).kind == "bytes" and tok.copy_tokenizer(path, str(tmp_path / "w")) is None


def test_not_utf8_text_is_one_line_for_a_real_tokenizer(tmp_path, bpe):
  bpe.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "x.txt").write_bytes(b"caf\xe9")
  with pytest.raises(PrepareError, match=r"x.txt is not UTF-8 text \(byte 3: .*\); only --tokenizer=bytes takes any bytes"):
    text_inputs.prepare_text_files([str(tmp_path / "x.txt")], str(tmp_path / "o.bin"),
                                   tokenizer=str(tmp_path / "tokenizer.json"), workers=1)
  assert sorted(os.listdir(tmp_path)) == ["tokenizer.json", "x.txt"]


# --- Tokenizer identity by content (a digest), not by kind and size.

def _bpe_data(tmp_path, name, seed, vocab_size=300):
  """A token file written by a BPE trained on its own corpus (seed): same vocab size, other ids."""
  rng = random.Random(seed)
  words = ["".join(rng.choice("abcdefghijklmnop"[seed % 2::2]) for _ in range(rng.randint(2, 6))) for _ in range(200)]
  texts = [" ".join(rng.choice(words) for _ in range(30)) for _ in range(40)]
  output = str(tmp_path / "data" / f"{name}.bin")
  text_inputs.prepare_text_files(_write_texts(tmp_path / f"in_{name}", texts), output, train_tokenizer="bpe",
                                 vocab_size=vocab_size, documents="blank_line", workers=1)
  return output


@pytest.fixture
def two_bpes(tmp_path):
  a, b = _bpe_data(tmp_path, "a", 1), _bpe_data(tmp_path, "b", 2)
  assert token_files.TokenFile(a).vocab_size == token_files.TokenFile(b).vocab_size   # only the content differs
  return a, b


def test_a_digest_ignores_how_the_json_is_spelled_and_sees_any_change(two_bpes, tmp_path):
  a, _ = two_bpes
  file = a[:-len(".bin")] + ".tokenizer.json"
  content = json.loads(open(file).read())
  respelled = tmp_path / "respelled.json"
  respelled.write_text(json.dumps(content, indent=4, sort_keys=False))
  assert tok.file_digest(str(respelled)) == tok.file_digest(file) == token_files.TokenFile(a).tokenizer["digest"]
  content["model"]["vocab"]["zz"] = 0
  respelled.write_text(json.dumps(content))
  assert tok.file_digest(str(respelled)) != tok.file_digest(file)


def test_a_mixture_or_eval_data_of_another_bpe_of_the_same_size_is_refused(two_bpes, tiny_config):
  a, b = two_bpes
  tiny_config.data.source, tiny_config.model.vocab_size = "tokens", 300
  tiny_config.data.mixture = f"{a}:0.5,{b}:0.5"
  with pytest.raises(ConfigError, match=r"^data.mixture=.*: .*a.bin \(tokenizer huggingface, vocab \d+, EOS 0, content "
                                        r"sha256:.*\) and .*b.bin .* use different tokenizers; prepare every file"):
    data.make_sources(tiny_config)
  tiny_config.data.mixture, tiny_config.data.path, tiny_config.data.eval_path = "", a, b
  with pytest.raises(ConfigError, match=r"^data.eval_path=.*b.bin.*use different tokenizers"):
    data.make_sources(tiny_config, "eval")


@pytest.mark.parametrize("damage", ["truncated", "another_bpe"])
def test_a_damaged_or_substituted_tokenizer_beside_the_data_is_refused_when_adopted(two_bpes, tmp_path, damage):
  """The trainer adopts the data's tokenizer through copy_tokenizer: a file that no longer
  parses, or a valid one that is not the sidecar's (its digest), is one line, nothing copied."""
  a, b = two_bpes
  file = a[:-len(".bin")] + ".tokenizer.json"
  if damage == "truncated":
    open(file, "w").write(open(file).read()[:200])
  else:
    open(file, "w").write(open(b[:-len(".bin")] + ".tokenizer.json").read())
  with pytest.raises(ConfigError) as error:
    tok.copy_tokenizer(a, str(tmp_path / "run" / "tokenizer"))
  message = str(error.value)
  assert message.startswith(f"data.path='{a}': its tokenizer") and "\n" not in message, message
  assert ("not a readable tokenizer file" if damage == "truncated" else "is not the one its sidecar names") in message
  assert not (tmp_path / "run" / "tokenizer").exists()


def test_a_run_keeps_its_tokenizer_identity_for_resume_eval_and_sampling(two_bpes, tmp_path):
  """The run records the identity it trained with: resuming (or evaluating) on data of another
  tokenizer is refused naming both; a replaced copy in WORKDIR/tokenizer/ is refused when read."""
  a, b = two_bpes
  workdir = tmp_path / "run"
  workdir.mkdir()
  tok.copy_tokenizer(a, str(workdir / "tokenizer"))
  recorded = tok.record_run_identity(str(workdir), a, write=True)
  assert tok.run_identity(str(workdir)) == recorded == tok.identity(a)
  assert tok.check_run_identity(str(workdir), a) == recorded
  with pytest.raises(ConfigError, match=r"^data.eval_path=.*b.bin.: its tokenizer is huggingface sha256:.* but the run "
                                        r"in .* trained with huggingface sha256:.*: the same ids would mean other tokens"):
    tok.check_run_identity(str(workdir), b, "data.eval_path")
  assert tok.workdir_tokenizer(str(workdir)).vocab_size == token_files.TokenFile(a).vocab_size
  copy = tok.workdir_tokenizer_file(str(workdir))
  open(copy, "w").write(open(b[:-len(".bin")] + ".tokenizer.json").read())
  with pytest.raises(ConfigError, match=r"^workdir=.*: the run trained with .*; .*tokenizer holds .* not that tokenizer"):
    tok.workdir_tokenizer(str(workdir))


def test_a_refused_start_leaves_the_workdir_as_it_was(two_bpes, tiny_config, tmp_path):
  """The trainer checks the data's tokenizer before it writes anything: resuming a run of a.bin
  on b.bin, or starting on data whose tokenizer file is corrupt, is one ConfigError and the
  workdir's files are as they were (config.json not rewritten, nothing copied)."""
  a, b = two_bpes
  tiny_config.data.source, tiny_config.model.vocab_size = "tokens", 300
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "config.json").write_text("{}")          # what the run on a.bin left, as far as this check goes
  tok.record_run_identity(str(workdir), a, write=True)
  before = {path: path.read_bytes() for path in workdir.rglob("*") if path.is_file()}
  tiny_config.data.path = b
  with pytest.raises(ConfigError, match=r"^data.path=.*b.bin.: its tokenizer is .* but the run in .* trained with"):
    train(tiny_config, str(workdir), devices=jax.devices()[:1])
  assert {path: path.read_bytes() for path in workdir.rglob("*") if path.is_file() and path.name != "lock"} == before
  open(a[:-len(".bin")] + ".tokenizer.json", "w").write("{")
  tiny_config.data.path, fresh = a, tmp_path / "fresh"
  with pytest.raises(ConfigError, match=r"not a readable tokenizer file"):
    train(tiny_config, str(fresh), devices=jax.devices()[:1])
  assert not (fresh / "config.json").exists() and not (fresh / "tokenizer").exists()
