r"""megajax-export-hf: a trained run as a Hugging Face model directory (safetensors).

  megajax-export-hf --workdir=/tmp/run --out=/tmp/run-hf [--max_shard_size=5GB] [--format=auto|native|remote]

Reads the run's config (WORKDIR/config.json), its trained parameters (WORKDIR/params, or the
latest checkpoint when that is newer) and its tokenizer (WORKDIR/tokenizer/; none: bytes), and
writes --out (new, or empty; atomically): config.json, model.safetensors (shards and
model.safetensors.index.json above --max_shard_size), generation_config.json, tokenizer.json
(or tokenizer.model) and tokenizer_config.json; then prints which format it wrote and why, and
the files. Native (an architecture transformers and vLLM have; checkpoint/hf_families.py has
what each carries): layernorm + gelu models without windows are GPT-NeoX, rmsnorm + swiglu
serial ones Llama (no window), Mistral (every layer windowed) or Qwen2 (q, k, v biases), layernorm
without bias + swiglu parallel ones Cohere2. Any other model (the default job's: parallel block, local and global layers) goes out
with megajax's own model code beside the weights (configuration_megajax.py, modeling_megajax.py:
AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)); docs/huggingface.md.
--format=native refuses such a model in one line naming the field. Any bad input is one line
on stderr and exit code 2. One process; the parameters are read onto one device.
"""

import os

from absl import app
from absl import flags
from absl import logging

from megajax.checkpoint import CheckpointError, HfFormatError, export_hf
from megajax.checkpoint.hf_architectures import ARCHITECTURES, FORMATS, REMOTE, export_architecture
from megajax.checkpoint.hf_families import NATIVE_FAMILIES
from megajax.config import ConfigError
from megajax.launch.cli import QuietLibraries, fail, flags_parser, one_line_errors
from megajax.launch.run_files import run_config, run_params, workdir_tokenizer_file
from megajax.model import ModelConfig

PROGRAM = "megajax-export-hf"
_WORKDIR = flags.DEFINE_string("workdir", None, "The run's workdir (config.json, params/ or checkpoints/).")
_OUT = flags.DEFINE_string("out", None, "The Hugging Face directory to write (new, or empty).")
_MAX_SHARD_SIZE = flags.DEFINE_string("max_shard_size", "5GB", "Largest safetensors file (5GB, 500MB, bytes): "
                                      "above it the weights go into numbered shards and an index.")
_FORMAT = flags.DEFINE_enum("format", "auto", FORMATS, "native: an architecture transformers and vLLM have ("
                            f"{', '.join(f.name for f in NATIVE_FAMILIES)}), refused naming the field when none holds "
                            "the model; remote: megajax's "
                            "own model code beside the weights (trust_remote_code=True); auto: native where one holds "
                            "the model exactly, else remote.")
flags.mark_flags_as_required(["workdir", "out"])


def main(argv):
  logging.get_absl_handler().addFilter(QuietLibraries())
  if len(argv) > 1:
    fail(PROGRAM, "usage error", f"unexpected arguments: {' '.join(argv[1:])}")
  out = os.path.abspath(_OUT.value)
  if os.path.exists(out) and not (os.path.isdir(out) and not os.listdir(out)):
    fail(PROGRAM, "output error", f"{out}: exists and is not an empty directory; pass a new --out")
  try:
    with one_line_errors(PROGRAM, {ConfigError: "config error", CheckpointError: "missing input",
                                   HfFormatError: "cannot export"}):
      config = run_config(_WORKDIR.value)
      # refused before any parameter is read
      arch, why = export_architecture(ModelConfig.from_config(config.model), _FORMAT.value)
      tokenizer = workdir_tokenizer_file(_WORKDIR.value)
      params, source = run_params(_WORKDIR.value, config)
      files = export_hf(config, params, out, tokenizer_dir=tokenizer, max_shard_size=_MAX_SHARD_SIZE.value,
                        format=_FORMAT.value)
  except OSError as error:
    fail(PROGRAM, "output error", f"{out}: {error}")
  print(f"wrote {out}: {ARCHITECTURES[arch]} from {source}, tokenizer {tokenizer or 'bytes'}")
  print(f"format {'remote' if arch == REMOTE else 'native'}: {why}"
        + ("; load it with AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)" if arch == REMOTE else ""))
  for name in files:
    print(f"  {name}  {os.path.getsize(os.path.join(out, name))} bytes")


def run():
  app.run(main, flags_parser=flags_parser(PROGRAM))


if __name__ == "__main__":
  run()
