"""Hugging Face checkpoints, local files only (safetensors): a megajax model out to a
transformers directory, and one back in.

    files = export_hf(config, params, "out/")            # config.json, model.safetensors, ...
    config, params = import_hf("out/", config)           # the model fields from out/config.json

`export_hf` writes, atomically (a temporary directory renamed into place): config.json (the
architecture's fields, hf_architectures.hf_config), model.safetensors (or model-0000k-of-0000n
shards and model.safetensors.index.json above `max_shard_size`), generation_config.json, and the
tokenizer: the run's tokenizer.json (or sentencepiece tokenizer.model) with a
tokenizer_config.json, or for a byte-level run a tokenizer.json mapping bytes to ids 0..255 and
<|endoftext|> to 256. `import_hf` takes every model field the HF config.json determines, reads
the weights into megajax's fp32 pytree, and refuses (HfFormatError, one line) what megajax
cannot represent or files that contradict their config. Export then import is bitwise.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile

import jax
import ml_collections
import numpy as np
from safetensors import SafetensorError, safe_open
import safetensors.numpy
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from megajax.checkpoint.hf_architectures import (BUFFER_SUFFIXES, NEOX, REMOTE, REMOTE_CODE_FILES, HfFormatError,
                                                 export_architecture, from_hf, hf_config, hf_shape, model_fields,
                                                 parameter_shapes, tensor_table, to_hf)
from megajax.config import validate
from megajax.model import ModelConfig
from megajax.token_files import EOS
from megajax.tokenizer import TokenizerError, load_tokenizer

SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
REMOTE_CODE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "remote_code")
DEFAULT_MAX_SHARD_SIZE = "5GB"                       # transformers' save_pretrained default
BYTES_EOS_TOKEN = "<|endoftext|>"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_NEOX_BIASES = ("attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")


# --- Export.

def export_hf(config: ml_collections.ConfigDict, params, out_dir: str, tokenizer_dir: str | None = None,
              max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, format: str = "auto") -> list[str]:
  """Writes `params` (the model's pytree, as megajax.init_params or WORKDIR/params give it) of
  `config`'s model as a Hugging Face directory `out_dir` (new, or empty); returns the file
  names written. `tokenizer_dir`: the run's tokenizer file, or the directory holding it
  (WORKDIR/tokenizer); None or no file there: a byte-level run. `format`: hf_architectures.FORMATS
  ("auto": native where an HF architecture holds the model exactly, else megajax's own code
  beside the weights, loaded with trust_remote_code=True)."""
  model = ModelConfig.from_config(config.model)
  arch, _ = export_architecture(model, format)
  limit = parse_size(max_shard_size)
  params = jax.tree.map(np.asarray, jax.device_get(params))
  _check_params(model, params)
  files, eos_id = _tokenizer_files(tokenizer_dir, model.seq_len)
  tensors = {t.name: np.ascontiguousarray(to_hf(t.kind, [_leaf(params, p) for p in t.paths]) if t.paths
                                          else np.zeros(t.zeros, model.param_dtype))
             for t in tensor_table(arch, model)}
  eos = eos_id if eos_id < model.vocab_size else None     # a model smaller than its tokenizer never says EOS
  files["config.json"] = _json(hf_config(arch, model, eos_id=eos, bos_id=eos))
  files["generation_config.json"] = _json({"bos_token_id": eos, "eos_token_id": eos})
  if arch == REMOTE:
    for name in REMOTE_CODE_FILES:
      with open(os.path.join(REMOTE_CODE_DIR, name), "rb") as f:
        files[name] = f.read()
  out = os.path.abspath(out_dir)
  if os.path.exists(out) and not (os.path.isdir(out) and not os.listdir(out)):
    raise FileExistsError(f"{out}: exists and is not an empty directory; pass a new output directory")
  os.makedirs(os.path.dirname(out), exist_ok=True)
  temporary = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=os.path.dirname(out))
  try:
    for name, content in files.items():
      with open(os.path.join(temporary, name), "wb") as f:
        f.write(content)
    _write_safetensors(temporary, tensors, limit)
    _readable_by_all(temporary)
    if os.path.isdir(out):
      os.rmdir(out)
    os.rename(temporary, out)
  except BaseException:
    shutil.rmtree(temporary, ignore_errors=True)
    raise
  return sorted(os.listdir(out))


def _readable_by_all(directory: str) -> None:
  """rwxr-xr-x for the directory, rw-r--r-- for its files (mkdtemp and safetensors make them
  private): a model directory is for others to load."""
  os.chmod(directory, 0o755)
  for name in os.listdir(directory):
    os.chmod(os.path.join(directory, name), 0o644)


def parse_size(size: int | str) -> int:
  """5000000, "5GB" (10^9), "500MiB" (2^20) -> bytes."""
  if isinstance(size, int) and not isinstance(size, bool) and size > 0:
    return size
  match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(size).upper())
  if not match or match.group(2) not in _UNITS or float(match.group(1)) <= 0:
    raise HfFormatError(f"max_shard_size={size!r}: not a size (e.g. 5GB, 500MB, 100KiB or a byte count)")
  return max(1, int(float(match.group(1)) * _UNITS[match.group(2)]))


def _write_safetensors(directory: str, tensors: dict, limit: int) -> None:
  """One model.safetensors, or shards of at most `limit` bytes (a larger tensor alone) and
  their index, as transformers' save_pretrained names them."""
  shards, size = [[]], 0
  for name, tensor in tensors.items():
    if shards[-1] and size + tensor.nbytes > limit:
      shards.append([])
      size = 0
    shards[-1].append(name)
    size += tensor.nbytes
  names = [SINGLE_FILE] if len(shards) == 1 else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
                                                   for k in range(len(shards))]
  for file, shard in zip(names, shards):
    safetensors.numpy.save_file({name: tensors[name] for name in shard}, os.path.join(directory, file),
                                metadata={"format": "pt"})
  if len(shards) > 1:
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
             "weight_map": {name: file for file, shard in zip(names, shards) for name in shard}}
    with open(os.path.join(directory, INDEX_FILE), "wb") as f:
      f.write(_json(index))


def _tokenizer_files(tokenizer_dir: str | None, seq_len: int) -> tuple[dict, int]:
  """({file name: content}, eos id) of the run's tokenizer; a byte-level one without."""
  file = _tokenizer_file(tokenizer_dir)
  settings = {"model_max_length": seq_len, "clean_up_tokenization_spaces": False}
  if file is None:
    eos_id, eos_token, kind = EOS, BYTES_EOS_TOKEN, "PreTrainedTokenizerFast"
    files = {"tokenizer.json": byte_level_tokenizer().to_str(pretty=True).encode()}
  else:
    try:
      tokenizer = load_tokenizer(file)
    except TokenizerError as error:
      raise HfFormatError(f"the run's tokenizer: {error}") from None
    with open(file, "rb") as f:
      content = f.read()
    eos_id = tokenizer.eos_id
    if tokenizer.kind == "huggingface":
      eos_token, kind, files = tokenizer.tokenizer.id_to_token(eos_id), "PreTrainedTokenizerFast", {
          "tokenizer.json": content}
    else:                                                   # sentencepiece
      eos_token, kind, files = tokenizer.processor.id_to_piece(eos_id), "LlamaTokenizer", {"tokenizer.model": content}
      settings.update(add_bos_token=False, add_eos_token=False)
  files["tokenizer_config.json"] = _json({"tokenizer_class": kind, "bos_token": eos_token, "eos_token": eos_token,
                                          **settings})
  return files, int(eos_id)


def _tokenizer_file(tokenizer_dir: str | None) -> str | None:
  if not tokenizer_dir or os.path.isfile(tokenizer_dir):
    return tokenizer_dir or None
  names = sorted(n for n in os.listdir(tokenizer_dir) if n.endswith((".json", ".model"))) \
      if os.path.isdir(tokenizer_dir) else []
  if len(names) > 1:
    raise HfFormatError(f"{tokenizer_dir} holds {len(names)} tokenizers ({', '.join(names)}): keep the run's one")
  return os.path.join(tokenizer_dir, names[0]) if names else None


def _byte_chars() -> list[str]:
  """GPT-2's printable stand-in of every byte (what tokenizers' ByteLevel maps bytes to)."""
  printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
  chars, extra = [], 0
  for byte in range(256):
    chars.append(chr(byte) if byte in printable else chr(256 + extra))
    extra += byte not in printable
  return chars


def byte_level_tokenizer() -> Tokenizer:
  """megajax's bytes as a `tokenizers` tokenizer: a text's UTF-8 bytes are its ids 0..255,
  <|endoftext|> is 256 (megajax's EOS); decoding gives the bytes back."""
  vocab = {char: byte for byte, char in enumerate(_byte_chars())}
  tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.add_special_tokens([AddedToken(BYTES_EOS_TOKEN, special=True)])
  return tokenizer


# --- Import.

def import_hf(hf_dir: str, config: ml_collections.ConfigDict, pinned=()) -> tuple[ml_collections.ConfigDict, dict]:
  """(config with the model fields of `hf_dir`/config.json, the model's fp32 params as numpy).

  The other fields (mesh, optimizer, data, train; the model's dtypes, attention_impl, remat)
  are `config`'s. `pinned`: model field names whose `config` value the caller insists on (given
  on a command line): one the HF config contradicts is refused naming both; model.seq_len may
  be shorter than max_position_embeddings. Where the HF files leave a choice, the weights
  decide: GPT-NeoX's parallel residual is block "parallel" when every layer's two norms are
  equal, else "parallel_two_norms"; use_bias is False when every bias is zero."""
  where = os.path.join(hf_dir, "config.json")
  hf = _read_json(where)
  try:
    arch, fields = model_fields(hf)
  except HfFormatError as error:
    raise HfFormatError(f"{where}: {error}") from None
  tensors = _Tensors(hf_dir, arch, fields["tie_embeddings"])
  fields.update(_weight_fields(arch, fields, tensors, config, set(pinned)))
  imported = _with_fields(config, fields, set(pinned), where)
  model = ModelConfig.from_config(imported.model)
  absent = set() if arch != NEOX or hf.get("attention_bias", True) else {   # attention_bias=false: zeros
      f"gpt_neox.layers.{i}.{x}.bias" for i in range(model.num_layers) for x in _NEOX_BIASES[:2]}
  return imported, _read_params(arch, model, tensors, absent)


def _weight_fields(arch: str, fields: dict, tensors: "_Tensors", config, pinned: set) -> dict:
  """GPT-NeoX's block and use_bias, from its weights and what the caller pinned."""
  if arch != NEOX:
    return {}
  decided = {}
  biases = [f"gpt_neox.layers.{i}.{x}.bias" for i in range(fields["num_layers"]) for x in _NEOX_BIASES]
  nonzero = next((name for name in biases if name in tensors.names and np.any(tensors.get(name))), None)
  if "use_bias" in pinned and not config.model.use_bias and nonzero:
    raise HfFormatError(f"model.use_bias=False (given) but {nonzero} is nonzero: the model has biases; drop the flag")
  decided["use_bias"] = bool(nonzero) or ("use_bias" in pinned and bool(config.model.use_bias))
  if fields["block"] == "parallel_two_norms":
    different = next((i for i in range(fields["num_layers"]) for x in ("weight", "bias")
                      if not np.array_equal(tensors.get(f"gpt_neox.layers.{i}.input_layernorm.{x}"),
                                            tensors.get(f"gpt_neox.layers.{i}.post_attention_layernorm.{x}"))), None)
    wanted = config.model.block if "block" in pinned else None
    if wanted == "parallel" and different is not None:
      raise HfFormatError(f"model.block=parallel: layer {different}'s input_layernorm and post_attention_layernorm "
                          "differ, and the parallel block has one norm; use model.block=parallel_two_norms")
    if wanted in ("parallel", "parallel_two_norms"):
      decided["block"] = wanted
    else:
      decided["block"] = "parallel" if different is None else "parallel_two_norms"
  return decided


def _behaviour(model: ml_collections.ConfigDict) -> tuple:
  """What a model's fields make of it: resolved, with a window per layer instead of window and
  window_pattern (window=0 and a G-only pattern are the same model)."""
  resolved = dataclasses.replace(ModelConfig.from_config(model), window_pattern="")
  windows = tuple(ModelConfig.from_config(model).layer_window(layer) for layer in range(resolved.num_layers))
  return dataclasses.replace(resolved, window=None), windows


def _with_fields(config, fields: dict, pinned: set, where: str) -> ml_collections.ConfigDict:
  """`config` with the HF model fields; a pinned field they contradict is refused."""
  imported = config.copy_and_resolve_references()
  for name, value in fields.items():
    imported.model[name] = value
  if "seq_len" in pinned:
    seq_len = config.model.seq_len
    if seq_len > fields["seq_len"]:
      raise HfFormatError(f"model.seq_len={seq_len} (given) is longer than {where}'s max_position_embeddings="
                          f"{fields['seq_len']}; drop it or give at most that")
    imported.model.seq_len = seq_len
    imported.model.window = min(imported.model.window, seq_len)
  reference = _behaviour(imported.model)
  for name in sorted(pinned & set(fields) - {"seq_len"}):
    trial = imported.model.copy_and_resolve_references()
    trial[name] = config.model[name]
    if _behaviour(trial) != reference:
      raise HfFormatError(f"model.{name}={config.model[name]!r} (given) conflicts with {where}, which makes "
                          f"model.{name}={imported.model[name]!r}; drop it to take the Hugging Face value")
  validate(imported)
  return imported


def _read_params(arch: str, model: ModelConfig, tensors: "_Tensors", absent: set) -> dict:
  """The HF tensors -> megajax's pytree; every tensor is placed once or refused."""
  expected = parameter_shapes(model)
  params, used = {}, set()
  for t in tensor_table(arch, model):
    shapes = [expected[path] for path in t.paths]
    want = hf_shape(t.kind, shapes) if t.paths else t.zeros
    if t.name not in tensors.names:
      if t.name not in absent:
        raise HfFormatError(f"{t.name}: missing from {tensors.where}, and a {arch} model of this config.json has it")
      tensor = np.zeros(want, model.param_dtype)
    else:
      tensor = tensors.get(t.name)
      used.add(t.name)
    if tuple(tensor.shape) != tuple(want):
      raise HfFormatError(f"{t.name}: shape {tuple(tensor.shape)} in {tensors.where}, but its config.json's model "
                          f"needs {tuple(want)}")
    nonfinite = np.size(tensor) - int(np.count_nonzero(np.isfinite(tensor)))
    if nonfinite:     # named here, before any training: a step would only see a NaN loss
      raise HfFormatError(f"{t.name}: {nonfinite} of its {np.size(tensor)} values in {tensors.where} are NaN or "
                          "infinite; the weights are damaged: download or convert them again")
    if not t.paths:                   # a bias-free model's zero bias (_weight_fields checked it is zero)
      continue
    for path, leaf in zip(t.paths, from_hf(t.kind, tensor.astype(model.param_dtype), shapes)):
      if path in params and not np.array_equal(params[path], leaf):
        raise HfFormatError(f"{t.name}: differs from the other tensor of megajax's {'/'.join(path)}")
      params[path] = np.ascontiguousarray(leaf)
  extra = sorted(n for n in tensors.names - used - tensors.ignored if not n.endswith(BUFFER_SUFFIXES))
  if extra:
    raise HfFormatError(f"{extra[0]}: in {tensors.where}, but a {arch} model of its config.json has no such tensor "
                        f"({len(extra)} such)")
  nested = {}
  for path, leaf in params.items():
    node = nested
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = leaf
  return nested


class _Tensors:
  """The tensors of a HF directory's safetensors files (one, or shards and their index), by name."""

  def __init__(self, hf_dir: str, arch: str, tied: bool):
    index, single = os.path.join(hf_dir, INDEX_FILE), os.path.join(hf_dir, SINGLE_FILE)
    self._handles = {}
    if os.path.isfile(index):
      weight_map = _read_json(index).get("weight_map")
      if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise HfFormatError(f"{index}: no weight_map of tensor names to files")
      self.files, self.where = {n: os.path.join(hf_dir, f) for n, f in weight_map.items()}, index
    elif os.path.isfile(single):
      self.files, self.where = {n: single for n in self._open(single).keys()}, single
    else:
      raise HfFormatError(f"{hf_dir}: no {SINGLE_FILE} or {INDEX_FILE}; megajax reads safetensors weights "
                          "(transformers' save_pretrained writes them)")
    self.aliases, self.ignored = {}, set()
    if tied:                                     # transformers ties them: a stored head is not read
      self.ignored = {"embed_out.weight", "lm_head.weight"} & set(self.files)
    elif arch == NEOX and "lm_head.weight" in self.files and "embed_out.weight" not in self.files:
      self.aliases["embed_out.weight"] = "lm_head.weight"      # transformers 5's name of the NeoX head
    self.names = set(self.files) - set(self.aliases.values()) | set(self.aliases)

  def _open(self, file: str):
    if file not in self._handles:
      try:
        self._handles[file] = safe_open(file, framework="np")
      except (SafetensorError, OSError) as error:
        raise HfFormatError(f"{file}: not a readable safetensors file ({_one_line(error)})") from None
    return self._handles[file]

  def get(self, name: str) -> np.ndarray:
    stored = self.aliases.get(name, name)
    try:
      return self._open(self.files[stored]).get_tensor(stored)
    except (SafetensorError, OSError) as error:
      raise HfFormatError(f"{self.files[stored]}: tensor {stored}: {_one_line(error)}") from None


def hf_tokenizer_file(hf_dir: str) -> str | None:
  """The HF directory's tokenizer.json, or None."""
  path = os.path.join(hf_dir, "tokenizer.json")
  return path if os.path.isfile(path) else None


# --- Shared.

def _check_params(model: ModelConfig, params) -> None:
  expected = parameter_shapes(model)
  given = {tuple(k.key for k in path): tuple(np.shape(leaf))
           for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
  for path in sorted(expected.keys() | given.keys()):
    if expected.get(path) != given.get(path):
      name = "/".join(path)
      if path not in given:
        raise HfFormatError(f"params: no {name}, which the config's model has (shape {expected[path]})")
      if path not in expected:
        raise HfFormatError(f"params: {name} is not a parameter of the config's model")
      raise HfFormatError(f"params: {name} has shape {given[path]}, the config's model needs {expected[path]}")


def _leaf(params: dict, path: tuple) -> np.ndarray:
  for key in path:
    params = params[key]
  return params


def _json(value) -> bytes:
  return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()


def _read_json(path: str) -> dict:
  if not os.path.isfile(path):
    raise HfFormatError(f"{path}: not found (a Hugging Face model directory has config.json and safetensors weights)")
  try:
    with open(path, encoding="utf-8") as f:
      value = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
    raise HfFormatError(f"{path}: unreadable ({_one_line(error)})") from None
  if not isinstance(value, dict):
    raise HfFormatError(f"{path}: holds a JSON {type(value).__name__}, not an object")
  return value


def _one_line(error: BaseException) -> str:
  return " ".join(str(error).split()) or type(error).__name__
