"""MegaScope's explorer core: decode token by token with the model's internals in view, and
perturb what passes between layers (MegatronApp, section 6).

Everything here runs the model that trains: the same Flax modules (megajax.model.GPT, the
decoding form megajax.generate uses: megajax.sampling.decoding_config) and parameters, read
through Flax's method interception. An interceptor sees each module's call: it records the
outputs of the attention's query / key / value projections, of the attention and the MLP, and
of each block (the residual stream), and it may change two of them:

  noise           the residual stream after layer L plus N(0, std^2), element by element
  bitflip         the residual stream after layer L with bits flipped: each element, with
                  chance `rate`, has one uniformly chosen bit of its own dtype flipped
  zero_heads      layer L's attention heads `heads` zeroed before the out projection
  mask_positions  the residual stream after layer L zeroed at token positions `positions`
  offset          the residual stream after layer L plus a constant

Randomness is a function of (seed, layer, token position, unit) only, so a perturbed token is
perturbed alike in the prefill and in a decode step, and the same request gives the same page.
Without a perturbation the interceptor only reads: the logits are megajax.generate's (tested).

Decoding is a prefill and one compiled step per token (so a page can stream them), each
token drawn as megajax.sampling draws it (the key of new token t: fold_in(key(seed), t)).
What a page asks about a finished sequence (attention maps, activations, PCA) comes from one
forward pass over it: the model is causal, so position i's internals are those it had when
token i was decoded. Attention maps are computed for the one layer asked, on request.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from megajax.layers.attention import attention_probs, rotary_embedding
from megajax.model import GPT, ModelConfig
from megajax.sampling import Sampling, decoding_config, init_cache, sample_logits

PERTURBATIONS = ("noise", "bitflip", "zero_heads", "mask_positions", "offset")
TENSORS = ("q", "k", "v", "attn_out", "mlp_out", "residual")
_PROJECTIONS = {"query": "q", "key": "k", "value": "v"}


class ScopeError(ValueError):
  """A request the explorer refuses: one line naming the field, the problem and the fix."""

  def __init__(self, field: str, value, problem: str, fix: str):
    super().__init__(f"{field}={value!r}: {problem}; {fix}")


@dataclasses.dataclass(frozen=True)
class Perturbation:
  """One perturbation at one layer (the module docstring lists the kinds); hashable, so each
  one is its own compiled program."""
  layer: int
  kind: str
  std: float = 0.0
  rate: float = 0.0
  heads: tuple[int, ...] = ()
  positions: tuple[int, ...] = ()
  offset: float = 0.0
  seed: int = 0

  def check(self, config: ModelConfig) -> None:
    if self.kind not in PERTURBATIONS:
      raise ScopeError("perturbation.kind", self.kind, "not a perturbation", f"use one of {', '.join(PERTURBATIONS)}")
    if not 0 <= self.layer < config.num_layers:
      raise ScopeError("perturbation.layer", self.layer, f"the model has layers 0 .. {config.num_layers - 1}",
                       "pick one of them")
    if self.kind == "noise" and not (math.isfinite(self.std) and self.std > 0):
      raise ScopeError("perturbation.std", self.std, "noise needs a positive finite std", "e.g. 0.5")
    if self.kind == "bitflip" and not 0 < self.rate <= 1:
      raise ScopeError("perturbation.rate", self.rate, "a bit-flip rate is a chance per element in (0, 1]",
                       "e.g. 0.001")
    if self.kind == "zero_heads" and (not self.heads or not all(0 <= h < config.num_heads for h in self.heads)):
      raise ScopeError("perturbation.heads", list(self.heads), f"heads are 0 .. {config.num_heads - 1}",
                       "give at least one of them, e.g. [0]")
    if self.kind == "mask_positions" and (not self.positions or min(self.positions) < 0):
      raise ScopeError("perturbation.positions", list(self.positions), "positions are token indices >= 0",
                       "give at least one, e.g. [0]")
    if self.kind == "offset" and not math.isfinite(self.offset):
      raise ScopeError("perturbation.offset", self.offset, "not a finite number", "e.g. 1.0")


# --- The interceptor: what each module call shows, and where a perturbation lands.

def _position_keys(seed: int, layer: int, positions: jax.Array) -> jax.Array:
  """One key per token position (positions [b, t] -> keys [b, t]): the same in any call."""
  base = jax.random.fold_in(jax.random.key(seed), layer)
  return jax.vmap(jax.vmap(lambda p: jax.random.fold_in(base, p)))(positions)


def _perturb_residual(x: jax.Array, positions: jax.Array, p: Perturbation) -> jax.Array:
  """x [b, t, hidden] at `positions` [b, t] -> x perturbed by p (not zero_heads)."""
  hidden = x.shape[-1]
  if p.kind == "offset":
    return (x.astype(jnp.float32) + p.offset).astype(x.dtype)
  if p.kind == "mask_positions":
    hit = jnp.isin(positions, jnp.asarray(p.positions, jnp.int32))
    return jnp.where(hit[..., None], jnp.zeros_like(x), x)
  keys = _position_keys(p.seed, p.layer, positions)
  if p.kind == "noise":
    noise = jax.vmap(jax.vmap(lambda k: jax.random.normal(k, (hidden,))))(keys)
    return (x.astype(jnp.float32) + p.std * noise).astype(x.dtype)
  # bitflip: in the tensor's own representation (bf16: 16 bits, fp32: 32).
  bits = jnp.dtype(x.dtype).itemsize * 8
  unsigned = {16: jnp.uint16, 32: jnp.uint32}[bits]

  def masks(key):
    hit_key, bit_key = jax.random.split(key)
    hit = jax.random.uniform(hit_key, (hidden,)) < p.rate
    bit = jax.random.randint(bit_key, (hidden,), 0, bits).astype(unsigned)
    return jnp.where(hit, jnp.left_shift(jnp.ones((), unsigned), bit), jnp.zeros((), unsigned))

  flips = jax.vmap(jax.vmap(masks))(keys)
  return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(x, unsigned) ^ flips, x.dtype)


def _interceptor(perturbation: Perturbation | None, captured: dict | None):
  """A Flax method interceptor recording internals into `captured` ({(layer, tensor): array};
  layer -1's "residual" is the embedding) and applying `perturbation`."""
  p = perturbation

  def intercept(next_fun, args, kwargs, context):
    path = context.module.path if context.method_name == "__call__" else ()
    if not path or not path[0].startswith("layer_"):
      return next_fun(*args, **kwargs)
    layer = int(path[0][len("layer_"):])
    if (p is not None and p.kind == "zero_heads" and layer == p.layer and path[1:] == ("attention", "out")):
      heads = args[0]                                                      # [b, t, heads, d]
      keep = jnp.ones((heads.shape[2],), heads.dtype).at[jnp.asarray(p.heads)].set(0)
      args = (heads * keep[:, None],) + tuple(args[1:])
    if len(path) == 1 and layer == 0 and captured is not None:
      captured[(-1, "residual")] = args[0]
    out = next_fun(*args, **kwargs)
    if len(path) == 1:                                                     # the block: the residual stream
      if p is not None and p.layer == layer and p.kind != "zero_heads":
        out = _perturb_residual(out, args[1], p)
      tensor = "residual"
    elif path[1:2] == ("attention",) and len(path) == 3 and path[2] in _PROJECTIONS:
      tensor = _PROJECTIONS[path[2]]
    else:
      tensor = {("attention",): "attn_out", ("mlp",): "mlp_out"}.get(tuple(path[1:]))
    if captured is not None and tensor is not None:
      captured[(layer, tensor)] = out
    return out

  return intercept


def _apply(config: ModelConfig, variables: dict, tokens, positions, perturbation, captured, mutable=False):
  with nn.intercept_methods(_interceptor(perturbation, captured)):
    return GPT(config).apply(variables, tokens, positions, mutable=["cache"] if mutable else False)


# --- Decoding.

@functools.partial(jax.jit, static_argnames=("config", "max_len", "perturbation"))
def _prefill(params, tokens, config: ModelConfig, max_len: int, perturbation: Perturbation | None):
  positions = jnp.arange(tokens.shape[1])[None]
  logits, variables = _apply(config, {"params": params, "cache": init_cache(config, 1, max_len)}, tokens,
                             positions, perturbation, None, mutable=True)
  return variables["cache"], logits[:, -1]


@functools.partial(jax.jit, static_argnames=("config", "perturbation", "capture"), donate_argnames=("cache",))
def _decode_step(params, cache, token, position, config: ModelConfig, perturbation: Perturbation | None,
                 capture: bool):
  """One new token through the cache -> (cache, f32[1, vocab], {tensor: [layers(+1), width]} or {})."""
  captured = {} if capture else None
  logits, variables = _apply(config, {"params": params, "cache": cache}, token.reshape(1, 1),
                             position.reshape(1, 1), perturbation, captured, mutable=True)
  internals = {}
  if capture:
    for tensor in TENSORS:
      first = -1 if tensor == "residual" else 0
      internals[tensor] = jnp.stack([captured[(layer, tensor)][0, 0].reshape(-1).astype(jnp.float32)
                                     for layer in range(first, config.num_layers)])
  return variables["cache"], logits[:, 0], internals


@functools.partial(jax.jit, static_argnames=("sampling",))
def _draw(logits, seed, step, sampling: Sampling):
  return sample_logits(logits, jax.random.fold_in(jax.random.key(seed), step), sampling)[0]


@dataclasses.dataclass(frozen=True)
class Step:
  """One decoded token: its id, the logits it was drawn from (f32[vocab]), seconds it took,
  and (capture) every layer's internals at its position."""
  token: int
  logits: np.ndarray
  seconds: float
  internals: dict


def decode(params, config: ModelConfig, prompt: list[int], max_new_tokens: int, sampling: Sampling, seed: int = 0,
           perturbation: Perturbation | None = None, capture: bool = False) -> Iterator[Step]:
  """The prompt's continuation, one Step per new token as it is decoded (no end-of-text stop:
  the page shows what the model does)."""
  config = decoding_config(config)
  cache, logits = _prefill(params, jnp.asarray([prompt], jnp.int32), config, len(prompt) + max_new_tokens,
                           perturbation)
  for step in range(max_new_tokens):
    started = time.perf_counter()
    token = _draw(logits, seed, step, sampling)
    drawn_from = logits
    cache, logits, internals = _decode_step(params, cache, token, jnp.int32(len(prompt) + step), config,
                                            perturbation, capture)
    token = int(token)
    drawn = np.asarray(drawn_from[0])
    internals = {k: np.asarray(v) for k, v in internals.items()}
    yield Step(token, drawn, time.perf_counter() - started, internals)


def softmax(logits: np.ndarray) -> np.ndarray:
  z = logits.astype(np.float64) - np.max(logits, axis=-1, keepdims=True)
  e = np.exp(z)
  return e / e.sum(axis=-1, keepdims=True)


def kl_divergence(p_logits: np.ndarray, q_logits: np.ndarray) -> float | None:
  """KL(p || q) in nats of the two distributions the logits give (temperature 1); None when
  either has a non-finite logit (a flipped exponent bit makes infinities, then NaNs)."""
  if not (np.all(np.isfinite(p_logits)) and np.all(np.isfinite(q_logits))):
    return None
  p, q = softmax(p_logits), softmax(q_logits)
  return float(np.sum(p * (np.log(np.maximum(p, 1e-300)) - np.log(np.maximum(q, 1e-300)))))


def first_divergence(a: list[int], b: list[int]) -> int | None:
  return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


# --- A finished sequence, inspected.

@functools.partial(jax.jit, static_argnames=("config",))
def _internals(params, tokens, config: ModelConfig) -> dict:
  captured = {}
  _apply(config, {"params": params}, tokens, jnp.arange(tokens.shape[1])[None], None, captured)
  return {f"{layer}:{tensor}": value[0].astype(jnp.float32) for (layer, tensor), value in captured.items()}


def internals(params, config: ModelConfig, tokens: list[int]) -> dict[str, np.ndarray]:
  """{"<layer>:<tensor>": f32[n, ...]} of one forward pass over `tokens` (layer -1: the
  embedding's "residual"), through the decoding model (XLA attention: the cache's math)."""
  values = _internals(params, jnp.asarray([tokens], jnp.int32), decoding_config(config))
  return {name: np.asarray(value) for name, value in values.items()}


@functools.partial(jax.jit, static_argnames=("window", "theta", "rope"))
def _layer_probs(q, k, window, theta, rope=True):
  positions = jnp.arange(q.shape[0])[None]
  q, k = q[None], k[None]
  if rope:               # (model.global_rope=False: a global layer's q and k carry no positions)
    q, k = rotary_embedding(q, positions, theta), rotary_embedding(k, positions, theta)
  return attention_probs(q, k, window)[0]                                  # [kv_h, g, n, n]


def attention_map(config: ModelConfig, inside: dict[str, np.ndarray], layer: int, head: int) -> np.ndarray:
  """f32[n, n]: query head `head` of `layer` over the sequence (masked entries 0), computed from
  that layer's recorded q and k with the model's own rotary embedding and mask."""
  window = config.layer_window(layer)
  probs = np.asarray(_layer_probs(jnp.asarray(inside[f"{layer}:q"]), jnp.asarray(inside[f"{layer}:k"]),
                                  window, config.rope_theta, rope=window is not None or config.global_rope))
  group = config.num_heads // config.num_kv_heads
  return probs[head // group, head % group]


def residual_pca(config: ModelConfig, inside: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
  """(coords f32[layers + 1, n, 2], the two components' share of the variance): the residual
  stream of every position after the embedding and after each layer, projected on its two
  principal components over all of them."""
  stream = np.stack([inside[f"{layer}:residual"] for layer in range(-1, config.num_layers)])   # [L+1, n, h]
  flat = stream.reshape(-1, stream.shape[-1]).astype(np.float64)
  centred = flat - flat.mean(axis=0)
  _, singular, vt = np.linalg.svd(centred, full_matrices=False)
  total = float(np.sum(singular ** 2)) or 1.0
  coords = centred @ vt[:2].T
  if coords.shape[1] < 2:
    coords = np.pad(coords, ((0, 0), (0, 2 - coords.shape[1])))
  share = np.pad(singular[:2] ** 2 / total, (0, max(0, 2 - len(singular))))
  return coords.reshape(stream.shape[0], stream.shape[1], 2).astype(np.float32), share


def heatmap(inside: dict[str, np.ndarray], config: ModelConfig, layer: int, tensor: str, head: int,
            features: int = 128) -> tuple[np.ndarray, int]:
  """(values f32[n, <= features], the tensor's width): Q for query head `head`, K and V for
  its key/value head, the others their first `features` units."""
  value = inside[f"{layer}:{tensor}"]
  if tensor == "q":
    value = value[:, head]
  elif tensor in ("k", "v"):
    value = value[:, head // (config.num_heads // config.num_kv_heads)]
  value = value.reshape(value.shape[0], -1)
  return value[:, :features], value.shape[1]
