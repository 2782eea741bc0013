"""Sampling from a trained model with a KV cache: prefill once, then one compiled decode step.

    tokens = megajax.generate(params, config, [[1, 2, 3], [4, 5]], max_new_tokens=64,
                              temperature=0.8, top_k=50, top_p=0.95, seed=0)   # int32[2, 64]

The model is the Flax GPT itself (megajax.model), so decoding runs the attention, masks,
grouped KV heads, rotary positions and block kinds that trained; only its "cache" collection
is new (megajax.layers.attention): a global layer keeps every position's key and value, a
local (sliding-window) layer a ring buffer of its window's, so the memory of a local layer
does not grow with the generated length.

  prefill   the prompts [b, P] in one jitted call: logits of every row's last prompt token,
            the cache filled (left- or right-padded rows: `prompt_mask` says which tokens are
            real; each row's positions count its own tokens).
  decode    a lax.scan of the decode step on device: sample a token (temperature, top-k,
            top-p), run the model on it at its row's next position, `steps` times per call;
            `stream` calls it chunk by chunk so a command can print as it goes.

On a tp mesh (`mesh` with the axis megajax.parallel.TP) the parameters are split by heads,
MLP units and vocabulary like the trainer's tensor parallelism, the cache by KV heads, and
XLA partitions the same program (no pipeline: sampling needs none).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterator, NamedTuple, Sequence

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from megajax.layers.attention import cache_slots, init_kv_cache
from megajax.model import GPT, ModelConfig, logical_axes
from megajax.parallel.mesh import TP
from megajax.parallel.sharding import TENSOR_PARALLEL_AXES


class GenerationError(ValueError):
  """A bad argument of generate(): the message is one line naming it and the fix."""


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How a token is drawn from the logits: divided by `temperature` (0: the argmax), then only
  the `top_k` most likely (0: all), then only the smallest set whose probability reaches
  `top_p` (1: all): Hugging Face's order."""
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0


class DecodeState(NamedTuple):
  cache: dict            # {"layer_i": {"attention": {"key", "value", "positions"}}}
  logits: jax.Array      # f32[b, vocab]: the distribution of each row's next token
  position: jax.Array    # i32[b]: where each row's next token goes
  done: jax.Array        # bool[b]: the row has sampled eos_id


def decoding_config(config: ModelConfig) -> ModelConfig:
  """The model as it decodes: no recomputation (there is no backward), XLA attention (the
  cache's; a kernel would see one query)."""
  return dataclasses.replace(config, remat="none", attention_impl="xla")


def init_cache(config: ModelConfig, batch: int, max_len: int) -> dict:
  """The empty cache of every layer: global layers hold max_len positions, local ones their window."""
  return {f"layer_{layer}": {"attention": init_kv_cache(
              batch, cache_slots(config.layer_window(layer), max_len), config.num_kv_heads, config.head_dim,
              config.compute_dtype)}
          for layer in range(config.num_layers)}


def sample_logits(logits: jax.Array, rng: jax.Array, sampling: Sampling) -> jax.Array:
  """f32[b, vocab] -> i32[b], one draw per row."""
  if sampling.temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / sampling.temperature
  lowest = jnp.finfo(logits.dtype).min
  if sampling.top_k:
    kth = lax.top_k(logits, sampling.top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, lowest, logits)
  if sampling.top_p < 1.0:
    ordered = jnp.sort(logits, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs        # mass of the more likely tokens
    threshold = jnp.min(jnp.where(before < sampling.top_p, ordered, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < threshold, lowest, logits)
  return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


def _positions(mask: jax.Array) -> jax.Array:
  """Each real token's position within its row (padding -1), whichever side the padding is on."""
  return jnp.where(mask, jnp.cumsum(mask, axis=1) - 1, -1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("config", "max_len", "cache_shardings"))
def _prefill(params, tokens, mask, config: ModelConfig, max_len: int, cache_shardings=None) -> DecodeState:
  batch, length = tokens.shape
  cache = init_cache(config, batch, max_len)
  if cache_shardings is not None:
    by_head, replicated = cache_shardings
    cache = jax.tree_util.tree_map_with_path(
        lambda path, x: lax.with_sharding_constraint(x, replicated if path[-1].key == "positions" else by_head), cache)
  logits, variables = GPT(config).apply({"params": params, "cache": cache}, tokens, _positions(mask),
                                        mutable=["cache"])
  last = length - 1 - jnp.argmax(mask[:, ::-1], axis=1)                  # each row's last real token
  return DecodeState(variables["cache"], logits[jnp.arange(batch), last], jnp.sum(mask, axis=1, dtype=jnp.int32),
                     jnp.zeros((batch,), bool))


@functools.partial(jax.jit, static_argnames=("config", "steps", "sampling", "eos_id", "with_logits"),
                   donate_argnames=("state",))
def _decode(params, state: DecodeState, rng, start, config: ModelConfig, steps: int, sampling: Sampling,
            eos_id: int | None, with_logits: bool):
  """`steps` tokens per row -> (state, i32[b, steps], f32[b, steps, vocab] or None): token t's
  key is fold_in(rng, start + t), so the draws do not depend on how the calls are chunked."""
  model = GPT(config)

  def step(state: DecodeState, index):
    token = sample_logits(state.logits, jax.random.fold_in(rng, index), sampling)
    done = state.done
    if eos_id is not None:
      token = jnp.where(done, eos_id, token)
      done = done | (token == eos_id)
    logits, variables = model.apply({"params": params, "cache": state.cache}, token[:, None],
                                    state.position[:, None], mutable=["cache"])
    return DecodeState(variables["cache"], logits[:, 0], state.position + 1, done), \
        (token, state.logits if with_logits else None)

  state, (tokens, logits) = lax.scan(step, state, start + jnp.arange(steps))
  return state, tokens.T, None if logits is None else jnp.swapaxes(logits, 0, 1)


def pad_prompts(prompts: Sequence[Sequence[int]], padding: str = "left", pad_id: int = 0):
  """Token lists of any lengths -> (i32[b, P], bool[b, P] real-token mask), padded on `padding`'s side."""
  length = max(len(p) for p in prompts)
  tokens = np.full((len(prompts), length), pad_id, np.int32)
  mask = np.zeros((len(prompts), length), bool)
  for row, prompt in enumerate(prompts):
    cols = slice(length - len(prompt), length) if padding == "left" else slice(0, len(prompt))
    tokens[row, cols], mask[row, cols] = prompt, True
  return tokens, mask


def past_seq_len_ok(config: ModelConfig) -> bool:
  """Whether decoding past model.seq_len stays within what training saw: with rotary positions
  attention sees only offsets, and a model whose every layer is local (window <= seq_len)
  never attends over more than its window (its cache is a ring of the window). A global
  layer would."""
  return all(config.layer_window(layer) for layer in range(config.num_layers))


def _check(config: ModelConfig, tokens: np.ndarray, mask: np.ndarray, max_new_tokens: int, sampling: Sampling,
           mesh: Mesh | None, allow_past_seq_len: bool) -> None:
  def require(ok, name, value, problem, fix):
    if not ok:
      raise GenerationError(f"{name}={value}: {problem}; {fix}")
  require(isinstance(max_new_tokens, (int, np.integer)) and max_new_tokens >= 1, "max_new_tokens", max_new_tokens,
          "must be a positive integer", "ask for at least one token")
  require(sampling.temperature >= 0, "temperature", sampling.temperature, "must be >= 0", "0 samples greedily")
  require(0 <= sampling.top_k <= config.vocab_size, "top_k", sampling.top_k,
          f"must be between 0 and the vocabulary ({config.vocab_size})", "0 keeps every token")
  require(0 < sampling.top_p <= 1, "top_p", sampling.top_p, "must be in (0, 1]", "1 keeps every token")
  require(tokens.ndim == 2 and tokens.shape[0] >= 1 and tokens.shape == mask.shape, "prompts", tokens.shape,
          "must be a batch of token rows with a mask of the same shape", "pass lists of token ids")
  empty = np.flatnonzero(~mask.any(axis=1))
  require(empty.size == 0, "prompts", f"[{empty[0] if empty.size else ''}]", "has no token",
          "give every prompt at least one token (e.g. the tokenizer's end-of-text id)")
  bad = (tokens < 0) | (tokens >= config.vocab_size)
  if (bad & mask).any():
    row, col = np.argwhere(bad & mask)[0]
    require(False, f"prompts[{row}][{col}]", tokens[row, col], f"is not a token id of the model's vocabulary "
            f"[0, {config.vocab_size})", "encode the prompt with the run's tokenizer")
  longest = tokens.shape[1] + max_new_tokens
  if longest > config.seq_len and not past_seq_len_ok(config):
    require(allow_past_seq_len, "max_new_tokens", max_new_tokens,
            f"the prompt ({tokens.shape[1]} positions) and the new tokens reach position {longest}, past the "
            f"model.seq_len={config.seq_len} it was trained on: its global layers would attend over distances "
            "it never saw", f"ask for at most {max(config.seq_len - tokens.shape[1], 0)} new tokens, or allow it "
            "(allow_past_seq_len=True, --allow_past_seq_len) and expect worse text")
    logging.warning("sampling to position %d, past model.seq_len=%d: the global layers attend over distances "
                    "training never saw", longest, config.seq_len)
  if mesh is not None:
    tp = mesh.shape.get(TP, 1)
    require(config.num_heads % tp == 0, "mesh", f"tp={tp}", f"does not divide model.num_heads={config.num_heads}",
            "use a tp size that divides the heads")


def _mesh_shardings(params, config: ModelConfig, mesh: Mesh):
  """(params placed head- / unit- / vocab-split over tp, the cache's shardings: (keys and
  values by KV head, positions replicated))."""
  tp = mesh.shape[TP]

  def spec(logical: P, leaf) -> NamedSharding:
    axes = [TP if name in TENSOR_PARALLEL_AXES and leaf.shape[dim] % tp == 0 else None
            for dim, name in enumerate(logical)]
    return NamedSharding(mesh, P(*axes))

  logical = logical_axes(GPT(config))
  shardings = jax.tree.map(spec, logical, params, is_leaf=lambda x: isinstance(x, P))
  kv = TP if config.num_kv_heads % tp == 0 else None
  return jax.device_put(params, shardings), (NamedSharding(mesh, P(None, None, kv, None)), NamedSharding(mesh, P()))


def stream(params, config: ModelConfig | ml_collections.ConfigDict, prompts, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
           top_p: float = 1.0, seed: int = 0, *, prompt_mask=None, eos_id: int | None = None,
           mesh: Mesh | None = None, chunk: int = 64, with_logits: bool = False,
           allow_past_seq_len: bool = False) -> Iterator:
  """generate() as it goes: yields i32[b, k] (with_logits: (tokens, f32[b, k, vocab])) for each
  chunk of up to `chunk` new tokens; stops early once every row has sampled eos_id."""
  if prompt_mask is None:
    if isinstance(prompts, np.ndarray) or isinstance(prompts, jax.Array):
      tokens = np.asarray(prompts, np.int32)
      mask = np.ones(tokens.shape, bool)
    else:
      if not prompts:
        raise GenerationError("prompts=[]: no prompt; pass at least one list of token ids")
      tokens, mask = pad_prompts(prompts)
  else:
    tokens, mask = np.asarray(prompts, np.int32), np.asarray(prompt_mask, bool)
  sampling = Sampling(float(temperature), int(top_k), float(top_p))
  if isinstance(config, ml_collections.ConfigDict):     # the experiment's config: its model
    config = ModelConfig.from_config(config.model)
  config = decoding_config(config)
  _check(config, tokens, mask, max_new_tokens, sampling, mesh, allow_past_seq_len)
  cache_shardings = None
  if mesh is not None:
    params, cache_shardings = _mesh_shardings(params, config, mesh)
  # The cache holds every position a global layer will see: the longest prompt and the new tokens.
  state = _prefill(params, tokens, mask, config, tokens.shape[1] + max_new_tokens, cache_shardings)
  rng = jax.random.key(seed)
  made = 0
  while made < max_new_tokens:
    steps = min(chunk, max_new_tokens - made)
    state, new, logits = _decode(params, state, rng, made, config, steps, sampling, eos_id, with_logits)
    made += steps
    yield (np.asarray(new), np.asarray(logits)) if with_logits else np.asarray(new)
    if eos_id is not None and bool(np.all(np.asarray(state.done))):
      return


def generate(params, config: ModelConfig | ml_collections.ConfigDict, prompts, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, *, prompt_mask=None, eos_id: int | None = None,
             mesh: Mesh | None = None, with_logits: bool = False, allow_past_seq_len: bool = False):
  """New tokens i32[b, max_new_tokens] for a batch of prompts (with_logits: and the f32[b, n,
  vocab] logits each was drawn from).

  config: the model's (ModelConfig) or the experiment's (its model section is read).
  prompts: lists of token ids (left-padded here), or i32[b, P] with `prompt_mask` bool[b, P]
  (True: a real token; left or right padding). temperature 0 is greedy; top_k 0 and top_p 1
  keep every token. With eos_id, a row that samples it repeats it to the end. mesh: a Mesh
  with a tp axis to split the heads over (megajax.sampling.tp_mesh). Past model.seq_len a
  model with a global layer is refused (GenerationError) unless allow_past_seq_len, which
  logs a warning instead (past_seq_len_ok)."""
  chunks = list(stream(params, config, prompts, max_new_tokens, temperature, top_k, top_p, seed,
                       prompt_mask=prompt_mask, eos_id=eos_id, mesh=mesh, chunk=max_new_tokens,
                       with_logits=with_logits, allow_past_seq_len=allow_past_seq_len))
  if not with_logits:
    return np.concatenate(chunks, axis=1)
  return np.concatenate([c[0] for c in chunks], axis=1), np.concatenate([c[1] for c in chunks], axis=1)


def tp_mesh(tp: int, devices=None) -> Mesh:
  """A one-axis mesh of `tp` devices (the first of `devices`, default jax.devices()) for generate()."""
  devices = list(devices or jax.devices())
  if not 1 <= tp <= len(devices):
    raise GenerationError(f"tp={tp}: {len(devices)} devices here; use 1 .. {len(devices)}")
  return Mesh(np.array(devices[:tp]), (TP,))
