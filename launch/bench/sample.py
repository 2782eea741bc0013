"""Decoding speed: megajax.sampling's KV cache vs recomputing the full forward for every token.

  python -m megajax.launch.bench sample [--repeats=20] [--new_tokens=512]

The default job's model (configs/default.py: 4 layers, hidden 128, GQA, window 64 on every
other layer), its parameters freshly initialized (speed does not depend on training), greedy
decoding of --new_tokens tokens after a 16-token prompt, for a batch of 1 and of 8:

  cache      megajax.sampling: the prompt prefilled once, then one compiled decode step per
             token in a lax.scan on device (local layers read a ring buffer of w keys)
  recompute  what one writes without a cache: the whole forward of a fixed-length buffer
             (prompt + new tokens) per new token, also in a lax.scan on device (one compile)

Both run the same model and produce the same tokens (checked: the count is printed). Each
time is the median of --repeats runs (the recompute's of at most 3) after a compile, prefill
included; tokens/s counts the new tokens of every row. Compute is fp32 on a CPU (no bf16 units there), the config's dtype
on a GPU. On a GPU it also prints the decode step's time against the time to read the
parameters and the cache from HBM once (the step's floor).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from megajax import sampling as gen
from megajax.config import CONFIGS_DIR, load_config
from megajax.launch.bench.timing import median_seconds
from megajax.model import GPT, ModelConfig, init_params

PROMPT = 16
# H100 SXM / H200 HBM bandwidth, bytes/s (NVIDIA's data sheets: 3.35 TB/s, 4.8 TB/s).
HBM_BYTES_PER_S = {"h100": 3.35e12, "h200": 4.8e12}


@functools.partial(jax.jit, static_argnames=("config", "new"))
def recompute_decode(params, prompt, config: ModelConfig, new: int):
  """Greedy tokens i32[b, new], the full forward of the whole buffer per token."""
  batch, length = prompt.shape
  model = GPT(config)
  buffer = jnp.zeros((batch, length + new), jnp.int32).at[:, :length].set(prompt)

  def step(buffer, t):
    logits = model.apply({"params": params}, buffer)                      # [b, length + new, vocab]
    token = jnp.argmax(logits[:, t - 1], axis=-1).astype(jnp.int32)
    return buffer.at[:, t].set(token), token

  _, tokens = lax.scan(step, buffer, length + jnp.arange(new))
  return tokens.T


def cached_decode(params, prompt, config: ModelConfig, new: int):
  # Past model.seq_len on purpose: the cache's speed and bytes as the generated length grows.
  return gen.generate(params, config, prompt, new, temperature=0, allow_past_seq_len=True)


def _cache_bytes(config: ModelConfig, batch: int, max_len: int) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(jax.eval_shape(lambda: gen.init_cache(config, batch, max_len))))


def sample(repeats: int, new_tokens: int = 512) -> None:
  on_gpu = jax.default_backend() == "gpu"
  overrides = {} if on_gpu else {"model.compute_dtype": "float32"}
  config = gen.decoding_config(ModelConfig.from_config(load_config(f"{CONFIGS_DIR}/default.py", overrides).model))
  params = init_params(GPT(config), jax.random.key(0))
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  print(f"== sample: greedy decoding of {new_tokens} new tokens after a {PROMPT}-token prompt, the default model "
        f"({config.num_layers} layers, hidden {config.hidden_dim}, window {config.window} pattern "
        f"{config.window_pattern}, {config.compute_dtype.name}), on {jax.devices()[0].device_kind}; "
        f"median of {repeats}")
  print(f"{'batch':>5}  {'cache tok/s':>12}  {'recompute tok/s':>15}  {'cache / recompute':>17}  "
        f"{'same tokens':>11}  {'cache KiB (local / global layer)':>32}")
  for batch in (1, 8):
    prompt = np.asarray(jax.random.randint(jax.random.key(batch), (batch, PROMPT), 0, config.vocab_size), np.int32)
    ours = cached_decode(params, prompt, config, new_tokens)
    theirs = np.asarray(recompute_decode(params, prompt, config, new_tokens))
    cached_s = median_seconds(lambda: cached_decode(params, prompt, config, new_tokens), repeats=repeats, warmed=True)
    # The baseline is ~100x slower: at most 3 runs of it (a minute each at batch 8 on a CPU).
    recompute_s = median_seconds(recompute_decode, params, prompt, config, new_tokens, repeats=min(repeats, 3),
                                 warmed=True)
    cache = gen.init_cache(config, batch, PROMPT + new_tokens)
    local = next((c["attention"]["key"].nbytes * 2 for i, c in enumerate(cache.values())
                  if config.layer_window(i) is not None), 0)
    global_ = next((c["attention"]["key"].nbytes * 2 for i, c in enumerate(cache.values())
                    if config.layer_window(i) is None), 0)
    print(f"{batch:>5}  {batch * new_tokens / cached_s:>12.0f}  {batch * new_tokens / recompute_s:>15.0f}  "
          f"{recompute_s / cached_s:>16.1f}x  {int((ours == theirs).sum()):>5}/{ours.size:<5}  "
          f"{local / 1024:>15.1f} / {global_ / 1024:.1f}")
    if on_gpu:
      _hbm_floor(params, config, prompt, new_tokens, param_bytes)


def _hbm_floor(params, config: ModelConfig, prompt, new_tokens: int, param_bytes: int) -> None:
  """The decode step's time (from two runs that differ only in their new tokens) against one
  read of the parameters and the cache from HBM."""
  kind = jax.devices()[0].device_kind.lower()
  bandwidth = next((b for name, b in HBM_BYTES_PER_S.items() if name in kind), None)
  times = []
  for new in (new_tokens // 2, new_tokens):
    cached_decode(params, prompt, config, new)
    start = time.perf_counter()
    cached_decode(params, prompt, config, new)
    times.append(time.perf_counter() - start)
  step_s = (times[1] - times[0]) / (new_tokens - new_tokens // 2)
  read = param_bytes + _cache_bytes(config, prompt.shape[0], PROMPT + new_tokens)
  floor = read / bandwidth if bandwidth else float("nan")
  print(f"       decode step {step_s * 1e6:.1f} us; reading {read / 2**20:.2f} MiB once from HBM: "
        f"{floor * 1e6:.2f} us ({step_s / floor:.1f}x)" if bandwidth else
        f"       decode step {step_s * 1e6:.1f} us (HBM bandwidth of {kind} unknown)")
