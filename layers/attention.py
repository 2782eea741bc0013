"""Causal self-attention: rotary positions, grouped KV heads, an optional sliding window,
optional packed documents.

Token i attends to token j when  i - window < j <= i  (window=None: plain causal) and, with
`segment_ids` (int32[b, s], the document of each token, non-decreasing along a row),
segment_ids[i] == segment_ids[j]: attention never crosses a document boundary. Rotary
positions are then each token's position within its document.
`xla_attention` is the reference implementation every kernel is tested against.

Decoding (megajax.sampling) runs the same module with a "cache" collection: each layer keeps
its keys and values by position, all of them for a global layer, the last `window` in a ring
buffer for a local one (slot = position % window), so a local layer's cache does not grow
with the generated length. `positions` then says where each new token sits (-1: padding).
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from megajax.layers import initializers
from megajax.layers.kernels import pallas_attention


def rotary_embedding(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotates pairs (x[..., :d/2], x[..., d/2:]) by position-dependent angles (RoFormer)."""
  head_dim = x.shape[-1]
  half = head_dim // 2
  inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)      # [d/2]
  angles = positions.astype(jnp.float32)[..., None] * inv_freq            # [b, s, d/2]
  sin = jnp.sin(angles)[:, :, None, :]                                    # [b, s, 1, d/2]
  cos = jnp.cos(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)                   # [b, s, h, d/2] each
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x.dtype)


def sliding_window_mask(q_len: int, kv_len: int, window: int | None,
                        segment_ids: jax.Array | None = None) -> jax.Array:
  """bool[q_len, kv_len], True where query i may attend to key j; with segment_ids [b, s]
  (q_len == kv_len == s) bool[b, s, s], also only within a document."""
  i = jnp.arange(q_len)[:, None]
  j = jnp.arange(kv_len)[None, :]
  mask = j <= i
  if window is not None:
    mask &= j > i - window
  if segment_ids is not None:
    mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
  return mask


def attention_probs(q: jax.Array, k: jax.Array, window: int | None,
                    segment_ids: jax.Array | None = None) -> jax.Array:
  """softmax(q k^T / sqrt(d)) under the mask, fp32 [b, kv_h, g, q, s] (g = h / kv_h query heads
  per KV head; masked entries 0). q: [b, s, h, d]; k: [b, s, kv_h, d]; segment_ids [b, s]."""
  s = q.shape[1]
  mask = sliding_window_mask(s, s, window, segment_ids)
  return masked_probs(q, k, mask if segment_ids is not None else mask[None])


def masked_probs(q: jax.Array, k: jax.Array, mask: jax.Array) -> jax.Array:
  """softmax(q k^T / sqrt(d)) where `mask` [b, q, s] allows, fp32 [b, kv_h, g, q, s]: the math
  every XLA attention here shares (training's and the KV cache's). q: [b, q, h, d]; k: [b, s, kv_h, d]."""
  b, t, h, d = q.shape
  kv_heads = k.shape[2]
  q = q.reshape(b, t, kv_heads, h // kv_heads, d)                          # [b, q, kv_h, g, d]
  scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32)
  scores = scores / math.sqrt(d)                                          # [b, kv_h, g, q, s] fp32
  scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
  return jax.nn.softmax(scores, axis=-1)


def attend(probs: jax.Array, v: jax.Array) -> jax.Array:
  """probs [b, kv_h, g, q, s] (fp32) applied to v [b, s, kv_h, d] -> [b, q, h, d] in v's dtype."""
  b, kv_heads, g, t, _ = probs.shape
  out = jnp.einsum("bkgqs,bskd->bqkgd", probs.astype(v.dtype), v)           # [b, q, kv_h, g, d]
  return out.reshape(b, t, kv_heads * g, v.shape[-1])


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, window: int | None,
                  segment_ids: jax.Array | None = None) -> jax.Array:
  """Reference attention. q: [b, s, h, d]; k, v: [b, s, kv_h, d] with h % kv_h == 0."""
  return attend(attention_probs(q, k, window, segment_ids), v)


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, window: int | None,
                    segment_ids: jax.Array | None = None, implementation: str | None = "cudnn") -> jax.Array:
  """jax.nn.dot_product_attention with the same mask: cuDNN's fused kernel on GPU (bf16 /
  fp16), the comparator and fallback for our kernels. Its window (left, right) counts the
  keys besides the diagonal: ours, i - w < j <= i, is (w - 1, 0).

  It takes no segment ids (jax 0.10-0.11): documents go in as its boolean `mask`
  [b, 1, s, s], which cuDNN turns into a dense additive bias, O(b s^2) memory; for long
  packed rows model.attention_impl=pallas skips the other documents' blocks instead."""
  mask = None if segment_ids is None else (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
  return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=implementation,
                                      local_window_size=None if window is None else (window - 1, 0))


def position_mask(q_positions: jax.Array, k_positions: jax.Array, window: int | None) -> jax.Array:
  """bool[b, q, s]: the sliding-window causal mask by position (i - window < j <= i), keys at
  position -1 (empty cache slots, padding) masked: the mask of sliding_window_mask where the
  keys are not laid out by index (a KV cache's ring buffer)."""
  i, j = q_positions[:, :, None], k_positions[:, None, :]
  mask = (j >= 0) & (j <= i)
  if window is not None:
    mask &= j > i - window
  return mask


def cache_slots(window: int | None, max_len: int) -> int:
  """How many keys a layer's KV cache holds: the window for a local layer (its ring buffer),
  every position up to max_len for a global one."""
  return max_len if window is None else min(window, max_len)


def init_kv_cache(batch: int, slots: int, kv_heads: int, head_dim: int, dtype) -> dict:
  """One layer's empty cache: keys and values [b, slots, kv_h, d], each slot's position (-1: empty)."""
  return {"key": jnp.zeros((batch, slots, kv_heads, head_dim), dtype),
          "value": jnp.zeros((batch, slots, kv_heads, head_dim), dtype),
          "positions": jnp.full((batch, slots), -1, jnp.int32)}


def cached_attention(cache: dict, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
                     window: int | None) -> tuple[jax.Array, dict]:
  """New tokens (q, k, v [b, t, heads, d] after rotary; positions [b, t], -1 for padding)
  against the cache and each other -> (out [b, t, h, d], the cache with them written).

  A slot holds position p at p % slots; of the new tokens only a row's last `slots` are
  written (the others would be overwritten within this call), so no two writes meet."""
  keys = jnp.concatenate([cache["key"], k.astype(cache["key"].dtype)], axis=1)
  values = jnp.concatenate([cache["value"], v.astype(cache["value"].dtype)], axis=1)
  key_positions = jnp.concatenate([cache["positions"], positions], axis=1)
  out = attend(masked_probs(q, keys, position_mask(positions, key_positions, window)), values)

  slots = cache["positions"].shape[1]
  newest = jnp.max(positions, axis=1, keepdims=True)                     # [b, 1]
  written = (positions >= 0) & (positions > newest - slots)
  slot = jnp.where(written, positions % slots, slots)                     # slots: out of range, dropped
  rows = jnp.arange(positions.shape[0])[:, None]
  write = lambda buffer, new: buffer.at[rows, slot].set(new.astype(buffer.dtype), mode="drop")
  return out, {"key": write(cache["key"], k), "value": write(cache["value"], v),
               "positions": write(cache["positions"], positions)}


# model.attention_impl -> (q, k, v, window, segment_ids=None) -> out; every entry is tested against "xla". The
# names a config may give are megajax.config.ATTENTION_IMPL_CHOICES (kept equal, tested).
ATTENTION_IMPLS = {"xla": xla_attention, "pallas": pallas_attention, "cudnn": cudnn_attention}


class Attention(nn.Module):
  """Multi-head attention with `num_kv_heads` shared key/value heads (GQA when fewer)."""

  num_heads: int
  num_kv_heads: int
  head_dim: int
  window: int | None
  rope_theta: float = 10000.0
  rope: bool = True           # False: no rotary positions (NoPE: model.global_rope=False's global layers)
  use_bias: bool = True
  qkv_bias: bool = False      # biases on q, k and v even without use_bias (Qwen2's)
  init_std: float = 0.02
  out_init_std: float = 0.02
  impl: str = "xla"
  dtype: jnp.dtype = jnp.bfloat16
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    # x: [b, s, hidden]; positions, segment_ids: [b, s]
    hidden = x.shape[-1]

    def projection(heads: int, heads_axis: str, name: str):
      return nn.DenseGeneral(
          features=(heads, self.head_dim), use_bias=self.use_bias or self.qkv_bias, dtype=self.dtype,
          param_dtype=self.param_dtype, name=name,
          kernel_init=initializers.normal(self.init_std, ("embed", heads_axis, "head_dim")),
          bias_init=initializers.zeros((heads_axis, "head_dim")))

    q = projection(self.num_heads, "heads", "query")(x)                   # [b, s, h, d]
    k = projection(self.num_kv_heads, "kv_heads", "key")(x)               # [b, s, kv_h, d]
    v = projection(self.num_kv_heads, "kv_heads", "value")(x)
    if self.rope:
      q = rotary_embedding(q, positions, self.rope_theta)
      k = rotary_embedding(k, positions, self.rope_theta)
    if self.has_variable("cache", "key"):                                  # decoding: megajax.sampling
      names = ("key", "value", "positions")
      cache = {name: self.get_variable("cache", name) for name in names}
      out, cache = cached_attention(cache, q, k, v, positions, self.window)
      for name in names:
        self.put_variable("cache", name, cache[name])
    else:
      out = ATTENTION_IMPLS[self.impl](q, k, v, self.window, segment_ids)   # [b, s, h, d]
    return nn.DenseGeneral(
        features=hidden, axis=(-2, -1), use_bias=self.use_bias, dtype=self.dtype,
        param_dtype=self.param_dtype, name="out",
        kernel_init=initializers.normal(self.out_init_std, ("heads", "head_dim", "embed")),
        bias_init=initializers.zeros(("embed",)))(out)
