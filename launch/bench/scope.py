"""MegaScope's explorer: per-token decode latency with and without capture, and what a page's
inspection of the finished sequence costs.

  python -m megajax.launch.bench scope [--repeats=20] [--new_tokens=32]

Two models, parameters freshly initialized (speed does not depend on training), greedy, a
16-token prompt, one row (what the page decodes): the tests' tiny explorer model (3 layers,
hidden 64, GQA, local and global layers) and configs/gpt_125m.py. Per token, as the page
streams them: one compiled decode step through the KV cache (megajax.observe.scope.decode)

  plain     the step returns the logits
  capture   the step also returns every layer's Q, K, V, attention output, MLP output and
            residual stream at the new token (the interceptor recording them)

Each figure is the median over --repeats decodes (after a warm-up that compiles; plain and
capture alternately) of the mean seconds per token; "inspect" is one forward pass over prompt + new tokens with every
internal recorded, then layer 0 head 0's attention map and the residual PCA (a page's view).
"""

from __future__ import annotations

import time

import jax
import numpy as np

from megajax.config import CONFIGS_DIR, default_config, load_config
from megajax.launch.bench.timing import median_seconds
from megajax.model import GPT, ModelConfig, count_params, init_params
from megajax.observe import scope
from megajax.sampling import Sampling

PROMPT = list(range(1, 17))


def _tiny() -> ModelConfig:
  m = default_config().model
  m.num_layers, m.hidden_dim, m.num_heads, m.num_kv_heads, m.seq_len, m.vocab_size = 3, 64, 4, 2, 64, 256
  m.window, m.window_pattern = 16, "LLG"
  return ModelConfig.from_config(m)


def _per_token(params, config, new_tokens: int, capture: bool) -> float:
  started = time.perf_counter()
  list(scope.decode(params, config, PROMPT, new_tokens, Sampling(0.0, 0, 1.0), capture=capture))
  return (time.perf_counter() - started) / new_tokens


def _inspect(params, config, tokens) -> None:
  inside = scope.internals(params, config, tokens)
  scope.attention_map(config, inside, 0, 0)
  scope.residual_pca(config, inside)


def run(repeats: int = 20, new_tokens: int = 32, sizes: tuple[str, ...] = ("tiny", "gpt_125m")) -> list[dict]:
  """Prints and returns a row per model of `sizes` ("tiny", "gpt_125m")."""
  models = {"tiny (3 layers, h 64)": _tiny} if "tiny" in sizes else {}
  if "gpt_125m" in sizes:
    models["gpt_125m"] = lambda: ModelConfig.from_config(load_config(f"{CONFIGS_DIR}/gpt_125m.py").model)
  rows = []
  print(f"{'model':24s} {'params':>10s} {'plain ms/token':>15s} {'capture ms/token':>17s} {'capture/plain':>14s} "
        f"{'inspect ms':>11s}")
  for name, make in models.items():
    config = make()
    params = init_params(GPT(config), jax.random.key(0))
    count = count_params(params)
    plain, captured = _side_by_side(lambda: _per_token(params, config, new_tokens, False),
                                    lambda: _per_token(params, config, new_tokens, True), repeats)
    tokens = PROMPT + list(range(100, 100 + new_tokens))
    inspect = median_seconds(_inspect, params, config, tokens, repeats=max(3, repeats // 4))
    rows.append(dict(model=name, params=count, plain_ms=1e3 * plain, capture_ms=1e3 * captured,
                     inspect_ms=1e3 * inspect))
    print(f"{name:24s} {count:>10,d} {1e3 * plain:15.2f} {1e3 * captured:17.2f} {captured / plain:14.2f} "
          f"{1e3 * inspect:11.1f}")
  return rows


def _side_by_side(first, second, repeats: int) -> tuple[float, float]:
  """Medians of two measurements taken alternately (after a warm-up of each), so a machine's
  drift falls on both alike."""
  first(), second()
  values = [(first(), second()) for _ in range(repeats)]
  return float(np.median([a for a, _ in values])), float(np.median([b for _, b in values]))
