"""A megajax model in PyTorch for transformers (trust_remote_code): written next to the weights
by megajax-export-hf, loaded by `AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`.
Self-contained (torch and transformers, no megajax import); it computes what megajax.model.GPT
computes, parameter for parameter under megajax's own names and layouts:

  blocks      parallel   x + attn(norm(x)) + mlp(norm(x))              (one norm, MegaScale's)
              parallel_two_norms   x + attn(attention_norm(x)) + mlp(mlp_norm(x))
              serial     z = x + attn(attention_norm(x)); z + mlp(mlp_norm(z))
  norms       layernorm (scale, bias), layernorm_nobias (scale) or rmsnorm (scale), statistics in fp32
  mlp         gelu (tanh form), gelu_exact, swiglu (silu(wi_gate x) * wi_up x); biases optional
  attention   rotary positions (halves rotated, RoFormer), grouped KV heads, a sliding window per
              layer (token i sees keys j with i - window < j <= i; null: all j <= i), softmax in fp32;
              global layers without rotary positions when global_rope is false (NoPE)
  head        the embedding transposed when tied, else its own; logits in fp32, times logit_scale

Generation keeps every layer's keys and values in transformers' DynamicCache; a windowed
layer's mask reads only the last `window` of them.
"""

import math

import torch
from torch import nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_megajax import MegajaxConfig


class Norm(nn.Module):
  def __init__(self, kind: str, size: int, eps: float):
    super().__init__()
    self.kind, self.eps = kind, eps
    self.scale = nn.Parameter(torch.ones(size))
    if kind == "layernorm":
      self.bias = nn.Parameter(torch.zeros(size))
    self.centered = kind in ("layernorm", "layernorm_nobias")

  def forward(self, x):
    x32 = x.float()
    if self.centered:
      mean = x32.mean(-1, keepdim=True)
      variance = (x32 - mean).pow(2).mean(-1, keepdim=True)
      y = (x32 - mean) * torch.rsqrt(variance + self.eps) * self.scale.float()
      if self.kind == "layernorm":
        y = y + self.bias.float()
    else:
      y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale.float()
    return y.to(x.dtype)


class Dense(nn.Module):
  """megajax's Dense / DenseGeneral: kernel [*in, *out] (flax's layout), optional bias [*out]."""

  def __init__(self, in_shape: tuple, out_shape: tuple, use_bias: bool):
    super().__init__()
    self.contracted = len(in_shape)
    self.kernel = nn.Parameter(torch.zeros(*in_shape, *out_shape))
    self.bias = nn.Parameter(torch.zeros(*out_shape)) if use_bias else None

  def forward(self, x):
    y = torch.tensordot(x, self.kernel.to(x.dtype), dims=self.contracted)
    return y + self.bias.to(x.dtype) if self.bias is not None else y


def rotary(x, positions, theta: float):
  """x [b, t, heads, d] rotated by position [b, t]: the halves (x1, x2) by angles p * theta^(-i / (d/2))."""
  half = x.shape[-1] // 2
  inv_freq = theta ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
  angles = positions.float()[..., None] * inv_freq                      # [b, t, d/2]
  sin, cos = torch.sin(angles)[:, :, None, :], torch.cos(angles)[:, :, None, :]
  x1, x2 = x.float().chunk(2, dim=-1)
  return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Attention(nn.Module):
  def __init__(self, config: MegajaxConfig, window):
    super().__init__()
    hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    self.head_dim, self.window, self.theta = hidden // heads, window, config.rope_theta
    self.rope = window is not None or config.global_rope
    qkv_bias = config.use_bias or getattr(config, "qkv_bias", False)
    self.query = Dense((hidden,), (heads, self.head_dim), qkv_bias)
    self.key = Dense((hidden,), (kv_heads, self.head_dim), qkv_bias)
    self.value = Dense((hidden,), (kv_heads, self.head_dim), qkv_bias)
    self.out = Dense((heads, self.head_dim), (hidden,), config.use_bias)

  def forward(self, x, positions, index, key_mask, cache, layer):
    q, k = self.query(x), self.key(x)                                  # [b, t, h, d], [b, t, kv_h, d]
    if self.rope:
      q, k = rotary(q, positions, self.theta), rotary(k, positions, self.theta)
    v = self.value(x)
    if cache is not None:     # transformers' layout [b, kv_h, s, d]; every key since the start
      k, v = cache.update(k.transpose(1, 2), v.transpose(1, 2), layer)
      k, v = k.transpose(1, 2), v.transpose(1, 2)
    b, t, heads, d = q.shape
    kv_heads = k.shape[2]
    keys = torch.arange(k.shape[1], device=x.device)
    allowed = keys[None, None, :] <= index[:, :, None]                  # [b, t, s]: causal by cache index
    if self.window is not None:
      allowed &= keys[None, None, :] > index[:, :, None] - self.window
    if key_mask is not None:
      allowed &= key_mask[:, None, :k.shape[1]].bool()
    q = q.reshape(b, t, kv_heads, heads // kv_heads, d)
    scores = torch.einsum("bqkgd,bskd->bkgqs", q.float(), k.float()) / math.sqrt(d)
    scores = scores.masked_fill(~allowed[:, None, None], torch.finfo(torch.float32).min)
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bkgqs,bskd->bqkgd", probs.to(v.dtype), v).reshape(b, t, heads, d)
    return self.out(out)


class Mlp(nn.Module):
  def __init__(self, config: MegajaxConfig):
    super().__init__()
    hidden, units = config.hidden_size, config.intermediate_size
    self.family = config.mlp
    for name in (("wi_gate", "wi_up") if self.family == "swiglu" else ("wi",)):
      setattr(self, name, Dense((hidden,), (units,), config.use_bias))
    self.wo = Dense((units,), (hidden,), config.use_bias)

  def forward(self, x):
    if self.family == "swiglu":
      return self.wo(F.silu(self.wi_gate(x)) * self.wi_up(x))
    return self.wo(F.gelu(self.wi(x), approximate="tanh" if self.family == "gelu" else "none"))


class Block(nn.Module):
  def __init__(self, config: MegajaxConfig, window):
    super().__init__()
    self.kind = config.block
    norm = lambda: Norm(config.norm, config.hidden_size, config.layer_norm_eps)
    if self.kind == "parallel":
      self.norm = norm()
    else:
      self.attention_norm, self.mlp_norm = norm(), norm()
    self.attention = Attention(config, window)
    self.mlp = Mlp(config)

  def forward(self, x, *attention_inputs):
    if self.kind == "parallel":
      h = self.norm(x)
      return x + self.attention(h, *attention_inputs) + self.mlp(h)
    if self.kind == "parallel_two_norms":
      return x + self.attention(self.attention_norm(x), *attention_inputs) + self.mlp(self.mlp_norm(x))
    z = x + self.attention(self.attention_norm(x), *attention_inputs)
    return z + self.mlp(self.mlp_norm(z))


class MegajaxForCausalLM(PreTrainedModel, GenerationMixin):
  config_class = MegajaxConfig
  base_model_prefix = "megajax"
  _no_split_modules = ["Block"]
  _supports_cache_class = True

  def __init__(self, config: MegajaxConfig):
    super().__init__(config)
    self.embedding = nn.Parameter(torch.zeros(config.vocab_size, config.hidden_size))
    for layer, window in enumerate(config.layer_windows):
      setattr(self, f"layer_{layer}", Block(config, window))
    self.final_norm = Norm(config.norm, config.hidden_size, config.layer_norm_eps)
    if not config.tie_embeddings:
      self.head = nn.Parameter(torch.zeros(config.hidden_size, config.vocab_size))
    self.post_init()

  def _init_weights(self, module):
    pass      # megajax-export-hf writes every parameter

  def forward(self, input_ids=None, attention_mask=None, position_ids=None, use_cache=None, labels=None,
              return_dict=None, logits_to_keep=0, cache=None, **kwargs):
    # transformers 5 names the cache `cache`, 4 `past_key_values`; without a cache_position (5
    # stops passing it), the new tokens follow what the cache holds.
    past_key_values = cache if cache is not None else kwargs.get("past_key_values")
    cache_position = kwargs.get("cache_position")
    b, t = input_ids.shape
    use_cache = self.config.use_cache if use_cache is None else use_cache
    if use_cache and past_key_values is None:
      past_key_values = DynamicCache()
    past = past_key_values.get_seq_length() if past_key_values is not None else 0
    if cache_position is None:
      cache_position = torch.arange(past, past + t, device=input_ids.device)
    index = cache_position[None, :].expand(b, t)            # each token's place in the cache
    positions = position_ids if position_ids is not None else index
    x = F.embedding(input_ids, self.embedding)
    for layer in range(self.config.num_hidden_layers):
      x = getattr(self, f"layer_{layer}")(x, positions, index, attention_mask,
                                          past_key_values if use_cache else None, layer)
    x = self.final_norm(x)
    if logits_to_keep:
      x = x[:, -logits_to_keep:]
    head = self.embedding.t() if self.config.tie_embeddings else self.head
    logits = (x.float() @ head.float()) * self.config.logit_scale
    loss = None
    if labels is not None:
      loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                             ignore_index=-100)
    kept = past_key_values if use_cache else None
    return CausalLMOutputWithPast(loss=loss, logits=logits, **{name: kept for name in ("past_key_values", "cache")
                                                                if name in CausalLMOutputWithPast.__dataclass_fields__})
