"""`python -m megajax.launch.bench data`: what the input side delivers, side by side with what
the step consumes, in one run on this machine.

  prepare   megajax-prepare-data's library (text_inputs.prepare_text_files) on generated text
            files: tokens/s with the byte tokenizer and with a byte-level BPE, 1 worker vs all
  loader    one host's loader (grain, the job's read threads) over a token file of documents,
            rows of 2048 tokens: tokens/s without and with packing (segment ids, positions,
            the loss mask at boundaries)
  need      what the step consumes: 8 GPUs of a 1.3B model at 55% MFU (the model FLOPs per
            token, megajax.flops), and the default job measured here: its step time, the
            time it waits for the next batch, and the wait's share of the step

The goal (issue 18): one loader process delivers >= 1M tokens/s and the step's wait for data
stays under 1% of its time.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time

from absl import logging
import jax
import numpy as np

from megajax.config import CONFIGS_DIR, default_config, load_config
from megajax.data import DevicePrefetcher, make_iterator
from megajax.flops import PEAK_BF16_TFLOPS, training_flops_per_token
from megajax.model import ModelConfig
from megajax.text_inputs import prepare_text_files
from megajax.token_files import write_token_file
from megajax.trainer import build_parallel_step

_WORDS = ("the of and to in is that for it as with was on be by this are or from at an not have but "
          "def return self import class if else while yield lambda none true false print value index").split()


def _write_text_files(root: str, files: int, words_per_file: int) -> str:
  """`files` text files of pseudo-English paragraphs (blank-line separated), a fixed seed."""
  rng = np.random.default_rng(0)
  vocabulary = np.array(_WORDS + [f"w{i}" for i in range(2000)])
  for i in range(files):
    words = vocabulary[np.minimum(rng.zipf(1.3, words_per_file), len(vocabulary)) - 1]
    paragraphs = np.array_split(words, max(1, words_per_file // 150))
    with open(os.path.join(root, f"text_{i}.txt"), "w") as f:
      f.write("\n\n".join(" ".join(p) for p in paragraphs))
  return os.path.join(root, "text_*.txt")


def _prepare(root: str, pattern: str) -> None:
  print(f"{'prepare':10} {'tokenizer':>10} {'workers':>8} {'tokens':>12} {'seconds':>8} {'tokens/s':>12}")
  rates = {}
  for tokenizer in ("bytes", "bpe"):
    for workers in (1, os.cpu_count() or 1):
      kwargs = {"train_tokenizer": "bpe", "vocab_size": 4096} if tokenizer == "bpe" else {}
      output = os.path.join(root, f"{tokenizer}_{workers}.bin")
      _, _, stats = prepare_text_files([pattern], output, documents="blank_line", workers=workers, **kwargs)
      rates[tokenizer, workers] = stats["tokens"] / stats["seconds"]
      print(f"{'':10} {tokenizer:>10} {workers:>8} {stats['tokens']:>12,} {stats['seconds']:>8.2f} "
            f"{rates[tokenizer, workers]:>12,.0f}")
  print("prepare: bpe / bytes tokens/s (1 worker): "
        f"{rates['bpe', 1] / rates['bytes', 1]:.3f} (BPE includes training the tokenizer)")


def _loader_config(path: str, masking: bool):
  config = default_config()
  config.data.source, config.data.path, config.data.document_masking = "tokens", path, masking
  config.model.vocab_size, config.model.seq_len, config.train.batch_size = 32768, 2048, 16
  return config


def _token_file(root: str, tokens: int) -> str:
  """A token file of `tokens` ids (vocab 32768) in documents of geometric lengths (mean 1000)."""
  rng = np.random.default_rng(1)
  lengths = rng.geometric(1 / 1000, size=tokens // 1000 * 2)
  lengths = lengths[np.cumsum(lengths) <= tokens]
  documents = (rng.integers(0, 32767, size=n, dtype=np.int32) for n in lengths)
  path = os.path.join(root, "loader.bin")
  write_token_file(path, ([*d, 32767] for d in documents), vocab_size=32768)
  return path


def _loader(path: str, batches: int) -> float:
  print(f"{'loader':10} {'packing':>10} {'tokens/s':>14}   (one process, rows of 2048, 16 rows a batch)")
  rates = {}
  for masking in (False, True):
    iterator = make_iterator(_loader_config(path, masking), 0, 1)
    next(iterator)                                # opens the file, starts the read threads
    start = time.perf_counter()
    for _ in range(batches):
      batch = next(iterator)
    rates[masking] = batches * batch["inputs"].size / (time.perf_counter() - start)
    print(f"{'':10} {'on' if masking else 'off':>10} {rates[masking]:>14,.0f}")
  print(f"loader: packing on / off tokens/s: {rates[True] / rates[False]:.3f}")
  return rates[True]


def _step_wait(path: str, steps: int) -> tuple[float, float]:
  """The default job (configs/default.py) fed from the token file through the device
  prefetcher: (median step seconds, median seconds the loop waited for its next batch)."""
  config = load_config(os.path.join(CONFIGS_DIR, "default.py"))
  config.data.source, config.data.path = "tokens", path
  config.model.vocab_size = 32768
  parallel_step = build_parallel_step(config, jax.devices()[:8])
  state = parallel_step.init_state(jax.random.key(0))
  step = parallel_step.train_step()
  iterator = make_iterator(config, 0, 1)
  waits, times = [], []
  with DevicePrefetcher(iterator, parallel_step.put_batch, size=config.data.prefetch) as batches:
    state, metrics = step(state, next(batches))   # compiles
    jax.block_until_ready(metrics)
    for _ in range(steps):
      start = time.perf_counter()
      batch = next(batches)
      waited = time.perf_counter() - start
      state, metrics = step(state, batch)
      jax.block_until_ready(metrics)
      waits.append(waited)
      times.append(time.perf_counter() - start)
  return statistics.median(times), statistics.median(waits)


def data(batches: int = 50, steps: int = 20, words_per_file: int = 200_000, tokens: int = 20_000_000) -> None:
  logging.set_verbosity(logging.WARNING)
  root = tempfile.mkdtemp(prefix="megajax-bench-data-")
  try:
    print("\n== data: the input side against what the step consumes")
    _prepare(root, _write_text_files(root, files=4, words_per_file=words_per_file))
    path = _token_file(root, tokens=tokens)
    delivered = _loader(path, batches)
    c = ModelConfig.from_config(load_config(os.path.join(CONFIGS_DIR, "gpt_1p3b.py")).model)
    need = 8 * PEAK_BF16_TFLOPS["h100"] * 1e12 * 0.55 / training_flops_per_token(c)
    print(f"need: 8 H100 x 1.3B (seq {c.seq_len}) at 55% MFU consume {need:,.0f} tokens/s per host; "
          f"one loader delivers {delivered / need:.2f}x that (goal >= 1M tokens/s: "
          f"{'met' if delivered >= 1e6 else 'NOT met'})")
    step_s, wait_s = _step_wait(path, steps)
    print(f"default job on {jax.devices()[0].platform} (token data, packed): step {step_s * 1e3:.1f} ms, "
          f"waits {wait_s * 1e3:.3f} ms for its batch = {100 * wait_s / step_s:.2f}% of the step (goal < 1%)")
  finally:
    shutil.rmtree(root, ignore_errors=True)
