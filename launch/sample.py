r"""megajax-sample: text from a trained run, printed as it is generated.

  megajax-sample --workdir=/tmp/run --prompt="Once upon a time" \
      [--max_new_tokens=200 --temperature=0.8 --top_k=50 --top_p=0.95 --seed=0 --tp=1]

Reads the run's config (WORKDIR/config.json), its trained parameters (WORKDIR/params, or the
latest checkpoint when one was saved after them) and its tokenizer (WORKDIR/tokenizer/; bytes
for byte and synthetic data), encodes each --prompt (repeat the flag for a batch), and decodes
with megajax.sampling's KV cache: the prompt, then the new text as each chunk of --chunk
tokens arrives (one prompt), or each sample in turn (several). Sampling stops at the
tokenizer's end-of-text token. --temperature=0 is greedy. --tp splits the heads over that
many devices. A prompt and --max_new_tokens that run past the model's seq_len are refused when
the model has a global layer (--allow_past_seq_len: sample anyway, with a warning). Any bad
input is one line on stderr and exit code 2.
"""

import sys

from absl import app
from absl import flags
from absl import logging

from megajax.checkpoint import CheckpointError
from megajax.config import ConfigError
from megajax.sampling import GenerationError, stream, tp_mesh
from megajax.launch.cli import QuietLibraries, fail, flags_parser, one_line_errors
from megajax.launch.cluster import request_host_devices
from megajax.launch.run_files import run_config, run_params, workdir_tokenizer
from megajax.model import ModelConfig
from megajax.tokenizer import TokenizerError

PROGRAM = "megajax-sample"
_WORKDIR = flags.DEFINE_string("workdir", None, "The run's workdir (config.json, params/ or checkpoints/).")
_PROMPT = flags.DEFINE_multi_string("prompt", [""], "Text to continue; repeat for a batch ('': from nothing).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 200, "Tokens to generate per prompt.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.8, "Softmax temperature; 0: greedy.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens (0: all).")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Sample among the most likely tokens holding this mass (1: all).")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_TP = flags.DEFINE_integer("tp", 1, "Devices to split the heads over.")
_CHUNK = flags.DEFINE_integer("chunk", 16, "Tokens decoded per device call (how often text is printed).")
_ALLOW_PAST = flags.DEFINE_bool("allow_past_seq_len", False, "Sample past the model's seq_len although it has "
                                "global layers (refused otherwise: they never attended that far in training).")
flags.mark_flags_as_required(["workdir"])


class _Printer:
  """Prints a growing token list's text as new tokens come, holding back a trailing
  incomplete character (a multi-byte UTF-8 sequence cut by the chunk)."""

  def __init__(self, tokenizer):
    self.tokenizer, self.tokens, self.printed = tokenizer, [], ""

  def add(self, tokens) -> None:
    self.tokens.extend(int(t) for t in tokens)
    text = self.tokenizer.decode(self.tokens)
    ready = text.rstrip("\ufffd")
    if ready.startswith(self.printed):
      sys.stdout.write(ready[len(self.printed):])
      self.printed = ready
    sys.stdout.flush()

  def end(self) -> None:
    text = self.tokenizer.decode(self.tokens)
    sys.stdout.write((text[len(self.printed):] if text.startswith(self.printed) else "") + "\n")
    sys.stdout.flush()


def _prompts(tokenizer, config) -> list[list[int]]:
  vocab = config.model.vocab_size
  prompts = []
  for text in _PROMPT.value:
    ids = [int(i) for i in tokenizer.encode(text)]
    if not ids:      # from nothing: the end-of-text token starts a document, as in training
      if tokenizer.eos_id >= vocab:
        fail(PROGRAM, "flag error", f"--prompt='': the model's vocabulary ({vocab}) has no end-of-text token "
                                    f"({tokenizer.eos_id}) to start from; give a prompt")
      ids = [tokenizer.eos_id]
    outside = [i for i in ids if i >= vocab]
    if outside:
      fail(PROGRAM, "flag error", f"--prompt={text!r}: encodes to id {outside[0]}, outside the model's vocabulary "
                                  f"({vocab}); use text the run's tokenizer covers")
    prompts.append(ids)
  return prompts


def main(argv):
  logging.get_absl_handler().addFilter(QuietLibraries())
  if len(argv) > 1:
    fail(PROGRAM, "usage error", f"unexpected arguments: {' '.join(argv[1:])}")
  if _TP.value < 1 or _CHUNK.value < 1:
    fail(PROGRAM, "flag error", f"--tp={_TP.value} --chunk={_CHUNK.value}: both must be >= 1")
  request_host_devices(_TP.value)      # a CPU-only machine: as many host devices, before jax starts
  with one_line_errors(PROGRAM, {ConfigError: "config error", CheckpointError: "checkpoint error",
                                 TokenizerError: "tokenizer error", GenerationError: "flag error"}):
    config = run_config(_WORKDIR.value)
    tokenizer = workdir_tokenizer(_WORKDIR.value)
    prompts = _prompts(tokenizer, config)
    params, source = run_params(_WORKDIR.value, config)
    logging.info("sampling from %s", source)
    model = ModelConfig.from_config(config.model)
    eos = tokenizer.eos_id if tokenizer.eos_id < model.vocab_size else None
    mesh = tp_mesh(_TP.value) if _TP.value > 1 else None
    chunks = stream(params, model, prompts, _MAX_NEW.value, _TEMPERATURE.value, _TOP_K.value, _TOP_P.value,
                    _SEED.value, eos_id=eos, mesh=mesh, chunk=_CHUNK.value, allow_past_seq_len=_ALLOW_PAST.value)
    printers = [_Printer(tokenizer) for _ in prompts]
    if len(prompts) == 1:
      printers[0].add(prompts[0])
    for new in chunks:
      for row, printer in enumerate(printers):
        if len(prompts) == 1:
          printer.add(_until_eos(new[row], eos))
        else:
          printer.tokens.extend(int(t) for t in _until_eos(new[row], eos))
  if len(prompts) == 1:
    printers[0].end()
    return
  for row, (prompt, printer) in enumerate(zip(prompts, printers)):
    print(f"--- sample {row}")
    print(tokenizer.decode(prompt + printer.tokens))


def _until_eos(tokens, eos: int | None) -> list[int]:
  """A row's new tokens, up to and without its end-of-text token (the rest repeat it)."""
  tokens = [int(t) for t in tokens]
  return tokens[:tokens.index(eos)] if eos is not None and eos in tokens else tokens


def run():
  app.run(main, flags_parser=flags_parser(PROGRAM))


if __name__ == "__main__":
  run()
