"""Hugging Face interop (checkpoint/huggingface.py, checkpoint/hf_architectures.py): export then
import is bitwise for every architecture; the exported files compute megajax's logits in an
independent NumPy implementation of the HF architectures (tests/support/hf_reference.py) and
in transformers itself (skipped where it is not installed); what either side cannot represent
is refused in one line naming it; a fresh state from imported parameters (train.init_params)
on a pipelined mesh."""

import ast
import dataclasses
import json
import os

import jax
import numpy as np
import pytest
import safetensors.numpy
import sentencepiece
from tokenizers import Tokenizer

import megajax
from megajax.checkpoint import CheckpointError, HfFormatError, export_hf, import_hf, initial_state, save_params
from megajax.checkpoint.hf_architectures import export_architecture
from megajax.checkpoint.huggingface import parse_size
from megajax.config import default_config
from megajax.model import ModelConfig
from megajax.tokenizer import train_bpe
from megajax.trainer import build_parallel_step
from tests.support import hf_reference

LLAMA = {"norm": "rmsnorm", "mlp": "swiglu", "block": "serial", "use_bias": False}
COHERE2 = {"norm": "layernorm_nobias", "mlp": "swiglu", "block": "parallel", "use_bias": False, "global_rope": False,
           "logit_scale": 0.0625, "tie_embeddings": True}
# name -> (model fields, the HF class). Every architecture; tied and untied; GQA; a window
# shorter than the sequence.
CASES = {
    "neox-parallel": ({"block": "parallel"}, "GPTNeoXForCausalLM"),
    "neox-parallel_two_norms-tied": ({"block": "parallel_two_norms", "tie_embeddings": True}, "GPTNeoXForCausalLM"),
    "neox-serial-no-bias": ({"block": "serial", "use_bias": False}, "GPTNeoXForCausalLM"),
    "neox-exact-gelu": ({"block": "parallel", "mlp": "gelu_exact"}, "GPTNeoXForCausalLM"),   # Pythia's GeLU
    "llama-gqa": ({**LLAMA, "num_kv_heads": 2, "window_pattern": "G"}, "LlamaForCausalLM"),
    "mistral-window-gqa-tied": ({**LLAMA, "num_kv_heads": 1, "window": 5, "tie_embeddings": True, "rope_theta": 500.0},
                                "MistralForCausalLM"),
    # Cohere2: three local layers then a global one without positions, GQA, the logit scale.
    "cohere2-lllg-gqa": ({**COHERE2, "num_layers": 4, "window": 5, "window_pattern": "LLLG", "num_kv_heads": 2},
                         "Cohere2ForCausalLM"),
    "cohere2-untied-lg": ({**COHERE2, "window": 6, "window_pattern": "LG", "tie_embeddings": False,
                           "logit_scale": 0.5}, "Cohere2ForCausalLM"),
    # Qwen2: Llama's with biases on q, k and v alone; GQA, tied.
    "qwen2-gqa-tied": ({**LLAMA, "qkv_bias": True, "num_kv_heads": 2, "window_pattern": "G", "tie_embeddings": True},
                       "Qwen2ForCausalLM"),
}
SINGLE_FILE = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
TOKENS = np.random.default_rng(1).integers(0, 64, (2, 16)).astype(np.int32)


def _config(**model):
  config = default_config()
  config.model.update({"num_layers": 2, "hidden_dim": 32, "num_heads": 4, "seq_len": 16, "vocab_size": 64,
                       "compute_dtype": "float32", **model})
  return config


def _params(config, seed: int = 0) -> dict:
  """Random parameters of the model's shapes (no init compiled): every leaf its own values, so
  norms differ and biases are nonzero; norm scales around 1."""
  model = megajax.build_model(config)
  shapes = jax.eval_shape(lambda: megajax.init_params(model, jax.random.key(0)))
  rng = np.random.default_rng(seed)
  return jax.tree_util.tree_map_with_path(
      lambda path, s: (float(path[-1].key == "scale") + 0.1 * rng.standard_normal(s.shape)).astype(np.float32), shapes)


def _logits(config, params) -> np.ndarray:
  return np.asarray(jax.jit(megajax.build_model(config).apply)({"params": params}, TOKENS))


def _model(config) -> tuple:
  """The resolved model with a window per layer (window=0 and a G-only pattern are one model)."""
  model = ModelConfig.from_config(config.model)
  return dataclasses.replace(model, window_pattern=""), [model.layer_window(i) for i in range(model.num_layers)]


def _assert_bitwise(a: dict, b: dict) -> None:
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert np.asarray(y).dtype == np.float32 and np.array_equal(np.asarray(x), np.asarray(y))


def _json(path) -> dict:
  with open(path) as f:
    return json.load(f)


@pytest.mark.parametrize("name", CASES)
def test_export_then_import_is_bitwise_and_the_files_compute_megajax_logits(tmp_path, name):
  fields, hf_class = CASES[name]
  config = _config(**fields)
  params = _params(config)
  assert export_hf(config, params, str(tmp_path / "hf")) == SINGLE_FILE
  assert {oct(os.stat(path).st_mode & 0o777) for path in [tmp_path / "hf", *(tmp_path / "hf").iterdir()]} \
      == {"0o755", "0o644"}     # loadable by others, not private like a temporary directory
  hf = _json(tmp_path / "hf" / "config.json")
  assert hf["architectures"] == [hf_class] and hf["torch_dtype"] == "float32" and hf["max_position_embeddings"] == 16
  # The HF config.json decides every model field, whatever the config it is imported into says.
  imported, back = import_hf(str(tmp_path / "hf"), _config(num_layers=4, hidden_dim=64, block="serial"))
  assert _model(imported) == _model(config)
  _assert_bitwise(params, back)
  export_hf(imported, back, str(tmp_path / "again"))      # export -> import -> export: every file bit for bit
  for file in SINGLE_FILE:
    assert (tmp_path / "again" / file).read_bytes() == (tmp_path / "hf" / file).read_bytes(), file
  np.testing.assert_allclose(hf_reference.logits(str(tmp_path / "hf"), TOKENS), _logits(config, params), rtol=1e-5, atol=1e-5)


def _same_greedy_tokens(model, torch, config, params, name: str) -> None:
  """transformers' generate (its KV cache) and megajax.generate, greedy, for the window (or the
  sequence) and 32 tokens more: the same tokens."""
  prompt, new = TOKENS[:1, :4], (config.model.window or config.model.seq_len) + 32
  ours = megajax.generate(params, config, prompt.tolist(), max_new_tokens=new, temperature=0.0,
                          allow_past_seq_len=True)
  out = model.generate(torch.tensor(prompt, dtype=torch.long), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=0)
  assert out[0, 4:].tolist() == np.asarray(ours)[0].tolist(), name


def test_transformers_computes_megajax_logits(tmp_path):
  """transformers' own classes on the exported directories: the logits, and generate's greedy
  tokens against megajax.generate's (not installed in CI: skipped)."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  for name, (fields, hf_class) in CASES.items():
    config = _config(**fields)
    params = _params(config)
    export_hf(config, params, str(tmp_path / name))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / name), attn_implementation="eager")
    assert type(model).__name__ == hf_class
    with torch.no_grad():
      theirs = model(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(theirs, _logits(config, params), rtol=1e-5, atol=1e-5, err_msg=name)
    _same_greedy_tokens(model, torch, config, params, name)
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / name))
  assert tokenizer("héllo wörld")["input_ids"] == list("héllo wörld".encode())


# Models no native architecture holds: megajax's own code beside the weights (trust_remote_code).
REMOTE_CASES = {
    "default-block": {"block": "parallel", "window": 5, "window_pattern": "LG", "num_kv_heads": 2},
    "two-norms-gelu-exact-tied": {"block": "parallel_two_norms", "mlp": "gelu_exact", "window": 4,
                                  "window_pattern": "LLG", "num_layers": 3, "tie_embeddings": True},
    "serial-rmsnorm-swiglu-windows": {**LLAMA, "window": 6, "window_pattern": "GL", "num_kv_heads": 1},
    "parallel-qkv-bias": {"block": "parallel", "use_bias": False, "qkv_bias": True, "window": 5, "window_pattern": "LG"},
}
REMOTE_FILES = sorted([*SINGLE_FILE, "configuration_megajax.py", "modeling_megajax.py"])


@pytest.mark.parametrize("name", REMOTE_CASES)
def test_a_model_no_native_architecture_holds_exports_with_its_own_code_and_round_trips(tmp_path, name):
  """auto: MegajaxForCausalLM with its code (auto_map), each layer's window; import gives the
  same model and the parameters bit for bit; exporting that again gives every file bit for bit."""
  config = _config(**REMOTE_CASES[name])
  params = _params(config)
  assert export_hf(config, params, str(tmp_path / "hf")) == REMOTE_FILES
  hf = _json(tmp_path / "hf" / "config.json")
  model = ModelConfig.from_config(config.model)
  assert hf["architectures"] == ["MegajaxForCausalLM"] and hf["auto_map"]["AutoModelForCausalLM"] == \
      "modeling_megajax.MegajaxForCausalLM"
  assert hf["layer_windows"] == [model.layer_window(i) for i in range(model.num_layers)]
  for code in ("configuration_megajax.py", "modeling_megajax.py"):     # Python that parses, no megajax import
    tree = ast.parse((tmp_path / "hf" / code).read_text())
    imported_modules = {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)} | {
        alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not any(m.startswith("megajax") for m in imported_modules), imported_modules
  imported, back = import_hf(str(tmp_path / "hf"), _config(num_layers=5, hidden_dim=64, block="serial"))
  assert _model(imported) == _model(config)
  _assert_bitwise(params, back)
  export_hf(imported, back, str(tmp_path / "again"))
  for file in REMOTE_FILES:
    assert (tmp_path / "again" / file).read_bytes() == (tmp_path / "hf" / file).read_bytes(), file


def test_the_format_is_chosen_or_forced():
  """auto: native where one holds the model exactly, else remote, saying why; native: refused
  naming the field; remote: any model."""
  llama, default = ModelConfig.from_config(_config(**LLAMA).model), ModelConfig.from_config(_config(window=4).model)
  assert export_architecture(llama) == ("llama", "LlamaForCausalLM holds it exactly")
  arch, why = export_architecture(default)
  assert arch == "megajax" and why.startswith("no native architecture holds it: model.window=4")
  assert export_architecture(llama, "remote")[0] == "megajax"
  with pytest.raises(HfFormatError, match=r"^model.window=4 \(window_pattern='L'\): GPT-NeoX has every layer global"):
    export_architecture(default, "native")


def test_transformers_runs_megajax_own_code_as_megajax_does(tmp_path):
  """transformers loads the remote directories (trust_remote_code=True): logits within 1e-4 of
  megajax's (fp32) and greedy tokens equal to megajax.sampling's for 32 tokens past the window,
  through transformers' generate and its KV cache (not installed in CI: skipped)."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  for name, fields in REMOTE_CASES.items():
    config = _config(**fields)
    params = _params(config)
    export_hf(config, params, str(tmp_path / name))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / name), trust_remote_code=True,
                                                              dtype=torch.float32)
    assert type(model).__name__ == "MegajaxForCausalLM"
    with torch.no_grad():
      theirs = model(torch.tensor(TOKENS, dtype=torch.long), use_cache=False).logits.numpy()
    np.testing.assert_allclose(theirs, _logits(config, params), rtol=1e-4, atol=1e-4, err_msg=name)
    _same_greedy_tokens(model, torch, config, params, name)


def test_a_forced_small_shard_size_writes_shards_and_an_index_that_read_back(tmp_path):
  config = _config(**LLAMA, num_kv_heads=2)
  params = _params(config)
  files = export_hf(config, params, str(tmp_path / "hf"), max_shard_size="20KB")
  shards = [f for f in files if f.startswith("model-")]
  assert len(shards) > 2 and shards == [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in
                                        range(1, len(shards) + 1)]
  assert sorted(set(files) - set(shards)) == sorted(set(SINGLE_FILE) - {"model.safetensors"} |
                                                    {"model.safetensors.index.json"})
  index = _json(tmp_path / "hf" / "model.safetensors.index.json")
  assert sorted(set(index["weight_map"].values())) == shards
  tensors = {}
  for shard in shards:
    content = safetensors.numpy.load_file(str(tmp_path / "hf" / shard))
    assert sum(t.nbytes for t in content.values()) <= 20_000 or len(content) == 1
    assert all(index["weight_map"][n] == shard for n in content)
    tensors.update(content)
  assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
  _, back = import_hf(str(tmp_path / "hf"), config)
  _assert_bitwise(params, back)
  assert (parse_size("20KB"), parse_size("1MiB"), parse_size(123), parse_size("1.5GB")) == (
      20_000, 2**20, 123, 1_500_000_000)
  with pytest.raises(HfFormatError, match=r"^max_shard_size='lots': not a size"):
    parse_size("lots")


def test_a_byte_level_run_gets_a_tokenizer_that_encodes_bytes_and_a_run_s_tokenizer_is_copied(tmp_path):
  config = _config(vocab_size=300)
  export_hf(config, _params(config), str(tmp_path / "bytes"))
  tokenizer = Tokenizer.from_file(str(tmp_path / "bytes" / "tokenizer.json"))
  text = "héllo\n\twörld € \x00"
  assert tokenizer.encode(text).ids == list(text.encode()) and tokenizer.decode(list(text.encode())) == text
  assert tokenizer.token_to_id("<|endoftext|>") == 256
  assert _json(tmp_path / "bytes" / "generation_config.json") == {"bos_token_id": 256, "eos_token_id": 256}
  assert _json(tmp_path / "bytes" / "tokenizer_config.json")["eos_token"] == "<|endoftext|>"
  # A run with its own tokenizer.json (WORKDIR/tokenizer/NAME.tokenizer.json): copied unchanged.
  bpe = train_bpe(["the quick brown fox jumps over the lazy dog"] * 20, vocab_size=270)
  os.makedirs(tmp_path / "run" / "tokenizer")
  bpe.save(str(tmp_path / "run" / "tokenizer" / "corpus.tokenizer.json"))
  assert export_hf(config, _params(config), str(tmp_path / "hf"), tokenizer_dir=str(tmp_path / "run" / "tokenizer")) \
      == SINGLE_FILE
  assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == \
      (tmp_path / "run" / "tokenizer" / "corpus.tokenizer.json").read_bytes()
  assert _json(tmp_path / "hf" / "generation_config.json")["eos_token_id"] == bpe.eos_id == 0
  # A sentencepiece run: its model as tokenizer.model, for transformers' LlamaTokenizer without BOS / EOS added.
  (tmp_path / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 50)
  sentencepiece.SentencePieceTrainer.train(input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "spm"),
                                           vocab_size=40, model_type="bpe", minloglevel=2)
  assert export_hf(config, _params(config), str(tmp_path / "spm_hf"), tokenizer_dir=str(tmp_path / "spm.model")) == [
      "config.json", "generation_config.json", "model.safetensors", "tokenizer.model", "tokenizer_config.json"]
  assert (tmp_path / "spm_hf" / "tokenizer.model").read_bytes() == (tmp_path / "spm.model").read_bytes()
  assert _json(tmp_path / "spm_hf" / "tokenizer_config.json") == {
      "tokenizer_class": "LlamaTokenizer", "bos_token": "</s>", "eos_token": "</s>", "add_bos_token": False,
      "add_eos_token": False, "model_max_length": 16, "clean_up_tokenization_spaces": False}
  # A model smaller than its tokenizer's EOS id says no EOS at all.
  small = _config()
  export_hf(small, _params(small), str(tmp_path / "small"))
  assert _json(tmp_path / "small" / "config.json")["eos_token_id"] is None
  with pytest.raises(FileExistsError, match="exists and is not an empty directory"):
    export_hf(small, _params(small), str(tmp_path / "small"))


@pytest.mark.parametrize("fields, message", [
    ({**LLAMA, "window": 4, "window_pattern": "LG"}, "model.window=4 (window_pattern='LG'): Llama has every layer "
     "global (model.window=0); Mistral has every layer local (window_pattern L)"),
    ({"num_kv_heads": 2}, "model.num_kv_heads=2: GPT-NeoX has no grouped KV heads"),
    ({"window": 4}, "model.window=4 (window_pattern='L'): GPT-NeoX has every layer global (model.window=0)"),
    ({**LLAMA, "block": "parallel"}, "model.block=parallel: Llama has serial blocks (model.block=serial)"),
    ({**LLAMA, "use_bias": True}, "model.use_bias=True: Llama has no biases (model.use_bias=False, "
     "model.qkv_bias=False); Qwen2 has biases on q, k and v alone"),
    ({"norm": "rmsnorm"}, "model.norm=rmsnorm, model.mlp=gelu: no Hugging Face architecture"),
    ({**COHERE2, "block": "serial"}, "model.block=serial: Cohere2 has parallel blocks"),
    ({**COHERE2, "global_rope": True}, "model.global_rope=True: Cohere2's global layers have no positions"),
    ({"logit_scale": 0.5}, "model.logit_scale=0.5: GPT-NeoX has no logit scale (1.0)"),
    ({**LLAMA, "global_rope": False}, "model.global_rope=False: Llama's global layers rotate their positions"),
    ({**LLAMA, "qkv_bias": True, "window": 4}, "model.qkv_bias=True: Mistral has no biases (model.use_bias=False, "
     "model.qkv_bias=False); model.window=4 (window_pattern='L'): Qwen2 has every layer global (model.window=0)"),
    ({**COHERE2, "qkv_bias": True}, "model.qkv_bias=True: Cohere2 has no biases"),
    ({"use_bias": False, "qkv_bias": True}, "model.qkv_bias=True: GPT-NeoX has biases on every linear "
     "(model.use_bias=True) or no biases"),
])
def test_a_native_export_refuses_what_the_architecture_cannot_carry_in_one_line(tmp_path, fields, message):
  config = _config(**fields)
  with pytest.raises(HfFormatError) as error:
    export_hf(config, _params(config), str(tmp_path / "hf"), format="native")
  assert str(error.value).startswith(message) and "\n" not in str(error.value)
  assert not os.path.exists(tmp_path / "hf")


def test_export_refuses_params_of_another_model(tmp_path):
  with pytest.raises(HfFormatError, match=r"^params: layer_0/mlp/wi/bias has shape \(128,\), the config's "
                                          r"model needs \(64,\)$"):
    export_hf(_config(mlp_dim=64), _params(_config()), str(tmp_path / "hf"))


def _edit_config(directory, **changes):
  hf = _json(directory / "config.json")
  hf.update(changes)
  (directory / "config.json").write_text(json.dumps(hf))


def _edit_tensors(directory, edit):
  tensors = dict(safetensors.numpy.load_file(str(directory / "model.safetensors")))
  edit(tensors)
  safetensors.numpy.save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  """A Llama (GQA), a GPT-NeoX (two norms, biases) and a Qwen2 directory to damage (copy first)."""
  root = tmp_path_factory.mktemp("exported")
  for name, fields in (("llama", {**LLAMA, "num_kv_heads": 2}), ("neox", {"block": "parallel_two_norms"}),
                       ("qwen2", {**LLAMA, "qkv_bias": True})):
    export_hf(_config(**fields), _params(_config(**fields)), str(root / name))
  return root


def _copy(exported, name, tmp_path):
  target = tmp_path / name
  target.mkdir()
  for file in os.listdir(exported / name):
    (target / file).write_bytes((exported / name / file).read_bytes())
  return target


@pytest.mark.parametrize("name, damage, message", [
    ("llama", lambda d: _edit_config(d, model_type="gpt2"), "model_type='gpt2': megajax reads gpt_neox"),
    ("llama", lambda d: _edit_tensors(d, lambda t: t.update({"model.layers.1.mlp.up_proj.weight": np.zeros((64, 32),
                                                                                                          np.float32)})),
     "model.layers.1.mlp.up_proj.weight: shape (64, 32) in "),
    ("llama", lambda d: _edit_config(d, intermediate_size=64), "model.layers.0.mlp.gate_proj.weight: shape (128, 32)"),
    ("llama", lambda d: _edit_tensors(d, lambda t: t.pop("model.norm.weight")), "model.norm.weight: missing from "),
    ("llama", lambda d: _edit_tensors(d, lambda t: t.update({"model.extra.weight": np.zeros(2, np.float32)})),
     "model.extra.weight: in "),
    ("llama", lambda d: _edit_config(d, rope_parameters={"rope_type": "linear", "factor": 2.0}),
     "rope_type='linear' (rope scaling)"),
    ("llama", lambda d: _edit_config(d, attention_bias=True), "attention_bias=true"),
    ("qwen2", lambda d: _edit_config(d, use_sliding_window=True), "use_sliding_window=true: megajax reads Qwen2"),
    ("qwen2", lambda d: _edit_tensors(d, lambda t: t.pop("model.layers.0.self_attn.k_proj.bias")),
     "model.layers.0.self_attn.k_proj.bias: missing from "),
    ("neox", lambda d: _edit_config(d, rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.25}),
     "partial_rotary_factor=0.25 (rotary_pct)"),
    ("neox", lambda d: _edit_config(d, hidden_act="relu"), "hidden_act='relu': megajax's GeLUs are the tanh form"),
    ("neox", lambda d: os.remove(d / "model.safetensors"), "no model.safetensors or model.safetensors.index.json"),
    ("llama", lambda d: _edit_tensors(d, lambda t: t["model.layers.1.mlp.up_proj.weight"].reshape(-1).__setitem__(
        slice(3, 6), np.nan)), "model.layers.1.mlp.up_proj.weight: 3 of its 4096 values in "),     # named before training
])
def test_import_refuses_in_one_line_naming_it(exported, tmp_path, name, damage, message):
  directory = _copy(exported, name, tmp_path)
  damage(directory)
  with pytest.raises(HfFormatError) as error:
    import_hf(str(directory), _config())
  assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("name, given, message", [
    ("llama", {"num_layers": 3}, "model.num_layers=3 (given) conflicts with "),
    ("llama", {"num_kv_heads": 4}, "model.num_kv_heads=4 (given) conflicts with "),
    ("llama", {"seq_len": 32}, "model.seq_len=32 (given) is longer than "),
    ("neox", {"block": "parallel"}, "model.block=parallel: layer 0's input_layernorm and post_attention_layernorm "
                                    "differ, and the parallel block has one norm; use model.block=parallel_two_norms"),
    ("neox", {"use_bias": False}, "model.use_bias=False (given) but gpt_neox.layers.0.attention.query_key_value.bias is "
                                  "nonzero"),
])
def test_a_model_field_given_that_the_hf_config_contradicts_is_refused(exported, name, given, message):
  with pytest.raises(HfFormatError) as error:
    import_hf(str(exported / name), _config(**given), pinned=set(given))
  assert message in str(error.value) and "\n" not in str(error.value)


def test_the_neox_head_under_its_transformers_5_name_and_a_stored_tied_head_are_read_as_transformers_does(
    exported, tmp_path):
  directory = _copy(exported, "neox", tmp_path)
  _, before = import_hf(str(directory), _config())
  _edit_tensors(directory, lambda t: t.update({"lm_head.weight": t.pop("embed_out.weight")}))
  _assert_bitwise(before, import_hf(str(directory), _config())[1])
  tied = _config(**LLAMA, tie_embeddings=True)
  params = _params(tied)
  export_hf(tied, params, str(tmp_path / "tied"))
  _edit_tensors(tmp_path / "tied", lambda t: t.update({"lm_head.weight": np.ones((64, 32), np.float32)}))
  _assert_bitwise(params, import_hf(str(tmp_path / "tied"), _config())[1])


def test_given_fields_that_agree_are_kept_and_a_shorter_seq_len_shortens_the_window(tmp_path):
  config = _config(**LLAMA, window=5)
  export_hf(config, _params(config), str(tmp_path / "hf"))
  given = {"seq_len": 4, "num_kv_heads": 0, "window_pattern": "L", "compute_dtype": "bfloat16"}
  imported, _ = import_hf(str(tmp_path / "hf"), _config(**given), pinned=set(given))
  assert (imported.model.seq_len, imported.model.window, imported.model.compute_dtype) == (4, 4, "bfloat16")
  assert imported.model.norm == "rmsnorm" and imported.model.num_kv_heads == 4


def test_a_fresh_state_from_imported_parameters_on_a_pipelined_mesh(tmp_path):
  """train.init_params (checkpoint.initial_state): step 0, fresh moments, the imported parameters
  bit for bit in the pipeline's stacked layout; another model's are refused naming the parameter.
  (tests/e2e/test_huggingface_commands.py trains from them: the first loss is theirs.)"""
  config = _config(**LLAMA, num_kv_heads=2)
  export_hf(config, _params(config), str(tmp_path / "hf"))
  imported, params = import_hf(str(tmp_path / "hf"), _config())
  save_params(str(tmp_path / "params"), params)
  imported.parallel.update({"pp": 2, "tp": 2, "virtual_stages": 1, "schedule": "1f1b"})
  imported.train.update({"microbatches": 2, "init_params": str(tmp_path / "params")})
  parallel_step = build_parallel_step(imported, jax.devices()[:4])
  state = initial_state(parallel_step, str(tmp_path / "params"))
  assert int(state.step) == 0 and "layers" in state.params                  # the pipeline's stacked rows
  assert jax.tree.all(jax.tree.map(lambda s, sharding: s.sharding == sharding, state, parallel_step.state_shardings))
  _assert_bitwise(params, jax.device_get(jax.jit(parallel_step.model_params)(state.params)))
  assert all(not np.any(np.asarray(m)) for m in jax.tree.leaves(state.opt_state) if np.ndim(m) > 0)

  other = _config(**LLAMA)                       # 4 KV heads: key and value kernels of another shape
  save_params(str(tmp_path / "other"), _params(other))
  with pytest.raises(CheckpointError, match=r"parameter \['layer_0'\]\['attention'\]\['key'\]\['kernel'\] is "
                                            r"\(32, 4, 8\) there, this run's model has \(32, 2, 8\)"):
    initial_state(parallel_step, str(tmp_path / "other"))
  for directory, problem in (("none", "no such directory"), ("hf", "no saved parameters there")):
    with pytest.raises(CheckpointError, match=f"^train.init_params={tmp_path / directory}: {problem}; "):
      initial_state(parallel_step, str(tmp_path / directory))
