r"""megajax-import-hf: train (fine-tune) from a Hugging Face model's weights, on any mesh.

  megajax-import-hf --hf=/models/my-neox --config=configs/default.py --workdir=/tmp/ft \
      --config.parallel.dp=2 --config.parallel.tp=4 --config.train.steps=100 [--convert_only]

The model fields come from --hf's config.json (GPT-NeoX, Llama, Mistral; docs/huggingface.md):
the --config file and its overrides give the rest (mesh, optimizer, data, train, the model's
dtypes, attention_impl, remat). A model field given on the command line that config.json
contradicts is refused naming both (model.seq_len may be shorter than max_position_embeddings).
The weights (safetensors) are converted and written as WORKDIR/hf_import/params (Orbax), the
HF tokenizer copied into WORKDIR/tokenizer/, and training starts from them
(train.init_params) as megajax-train's would; relaunching resumes from the latest checkpoint.
Token data must be tokenized with the model's own tokenizer (checked when both are
tokenizer.json or bytes). One host: for a multi-host job, --convert_only writes and prints
the megajax-train command to run on every host. Bad input: one line on stderr, exit code 2.
"""

import os
import shutil
import sys

from absl import app
from absl import flags
from absl import logging
from tokenizers import Tokenizer

from megajax import data
from megajax.checkpoint import HfFormatError, import_hf, save_params
from megajax.checkpoint.huggingface import byte_level_tokenizer
from megajax.config import ConfigError
from megajax.launch import cli
from megajax.launch.cli import define_config_flag, fail, flags_parser, validated_config
from megajax.launch.cluster import expected_process_count
from megajax.launch.training import prepare_process, run_training
from megajax.tokenizer import joined_message, tokenizer_of

PROGRAM = "megajax-import-hf"
MODEL_FIELDS = ("vocab_size", "seq_len", "num_layers", "hidden_dim", "num_heads", "num_kv_heads", "mlp_dim", "window",
                "window_pattern", "block", "norm", "mlp", "tie_embeddings", "use_bias", "qkv_bias", "rope_theta",
                "layernorm_epsilon", "global_rope", "logit_scale")
_CONFIG = define_config_flag()
_HF = flags.DEFINE_string("hf", None, "A Hugging Face model directory: config.json and safetensors weights.")
_WORKDIR = flags.DEFINE_string("workdir", None, "The training run's workdir (hf_import/params is written there).")
_CONVERT_ONLY = flags.DEFINE_bool("convert_only", False, "Write WORKDIR/hf_import/params and the tokenizer, print "
                                  "the megajax-train command that trains from them, and stop.")
flags.mark_flags_as_required(["hf", "config", "workdir"])
flags.adopt_module_key_flags(cli)


def _pinned() -> set:
  """The model fields given on the command line (--config.model.x=v)."""
  return {name[len("config.model."):] for name in flags.FLAGS
          if name.startswith("config.model.") and flags.FLAGS[name].present}


def _tokenizer_to_copy(config, hf_dir: str) -> str | None:
  """The HF tokenizer file the run should carry (None: the data's own, copied by the trainer);
  token data written with another vocabulary is refused."""
  hf_file = next((os.path.join(hf_dir, n) for n in ("tokenizer.json", "tokenizer.model")
                  if os.path.isfile(os.path.join(hf_dir, n))), None)
  if hf_file is None or config.data.source != "tokens":
    return hf_file
  if hf_file.endswith(".json"):
    try:
      vocab = Tokenizer.from_file(hf_file).get_vocab(with_added_tokens=True)
    except Exception as error:       # tokenizers raises plain Exceptions for every parse failure
      raise HfFormatError(f"{hf_file}: not a Hugging Face tokenizer.json ({joined_message(error)})") from None
    for path in data.token_file_paths(config):
      tokenizer = tokenizer_of(path)
      theirs = (byte_level_tokenizer() if tokenizer.kind == "bytes" else getattr(tokenizer, "tokenizer", None))
      if theirs is not None and theirs.get_vocab(with_added_tokens=True) != vocab:
        raise ConfigError("data.path", path, f"its tokenizer ({tokenizer.kind} {tokenizer.file or ''}) is not the "
                          f"model's {hf_file}", f"prepare the data with megajax-prepare-data --tokenizer={hf_file}")
  return None


def _write(params, tokenizer: str | None, workdir: str) -> str:
  path = save_params(os.path.join(workdir, "hf_import", "params"), params)
  if tokenizer:
    directory = os.path.join(workdir, "tokenizer")
    os.makedirs(directory, exist_ok=True)
    suffix = ".tokenizer.json" if tokenizer.endswith(".json") else ".tokenizer.model"
    shutil.copyfile(tokenizer, os.path.join(directory, "hf" + suffix))
  logging.info("%s converted to %s%s", _HF.value, path, f"; tokenizer {tokenizer} copied" if tokenizer else "")
  return path


def main(argv):
  prepare_process()
  config = validated_config(PROGRAM, argv, _CONFIG)
  if expected_process_count(None) > 1:
    fail(PROGRAM, "usage error", "one process only: for a multi-host job run it once with --convert_only, then the "
                                 "megajax-train command it prints on every host")
  workdir = os.path.abspath(_WORKDIR.value)
  try:
    config, params = import_hf(_HF.value, config, _pinned())
    tokenizer = _tokenizer_to_copy(config, _HF.value)
  except HfFormatError as error:
    fail(PROGRAM, "cannot import", error)
  except ConfigError as error:
    fail(PROGRAM, "config error", error)
  config.train.init_params = os.path.join(workdir, "hf_import", "params")
  if _CONVERT_ONLY.value:
    os.makedirs(workdir, exist_ok=True)
    _write(params, tokenizer, workdir)
    user = [arg for arg in sys.argv[1:] if arg.startswith("--config") and not arg.startswith("--config.model.")]
    model = [f"--config.model.{name}={config.model[name]}" for name in MODEL_FIELDS]
    print(" ".join(["megajax-train", *user, *model, f"--config.train.init_params={config.train.init_params}",
                    f"--workdir={workdir}"]))
    return
  run_training(PROGRAM, config, workdir, before_train=lambda: _write(params, tokenizer, workdir))


def run():
  app.run(main, flags_parser=flags_parser(PROGRAM))


if __name__ == "__main__":
  run()
