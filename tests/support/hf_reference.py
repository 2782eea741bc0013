"""Independent NumPy forward passes of the Hugging Face architectures megajax exports, written
from transformers' modeling_gpt_neox.py, modeling_llama.py, modeling_mistral.py,
modeling_qwen2.py and modeling_cohere2.py (not from
megajax): read a model directory's config.json and safetensors, return the logits of a batch of
token ids, in float64. No megajax code is imported here.

GPT-NeoX: LayerNorm; fused query_key_value viewed as [heads, 3 * head_dim] per token and split
q | k | v; rotary on the first rotary_pct of each head (rotate_half); parallel residual
x + attn(ln1(x)) + mlp(ln2(x)) or sequential; GELU of hidden_act; embed_out (lm_head).
Llama / Mistral: RMSNorm (weight * x / sqrt(mean(x^2) + eps)); q/k/v/o projections with
num_key_value_heads shared KV heads; SwiGLU down(silu(gate(x)) * up(x)); Mistral's
sliding_window: query i sees keys i - sliding_window < j <= i. Qwen2: Llama's with biases on
q_proj, k_proj and v_proj (every layer global here).
Cohere2: one LayerNorm without bias before both branches, x + attn(ln(x)) + mlp(ln(x)); rotary
on interleaved pairs (2i, 2i + 1) on the sliding_attention layers only (layer_types), no
positions on the full_attention ones; SwiGLU; logits times logit_scale.
"""

import json
import math
import os

import numpy as np
import safetensors.numpy


def load(hf_dir: str) -> tuple[dict, dict]:
  """(config.json, {tensor name: float64 array}) of a model directory, sharded or not."""
  with open(os.path.join(hf_dir, "config.json")) as f:
    config = json.load(f)
  index = os.path.join(hf_dir, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as f:
      files = sorted(set(json.load(f)["weight_map"].values()))
  else:
    files = ["model.safetensors"]
  tensors = {}
  for name in files:
    tensors.update(safetensors.numpy.load_file(os.path.join(hf_dir, name)))
  return config, {name: t.astype(np.float64) for name, t in tensors.items()}


def logits(hf_dir: str, tokens: np.ndarray) -> np.ndarray:
  """float64[batch, seq, vocab] for int tokens [batch, seq]."""
  config, tensors = load(hf_dir)
  forward = {"gpt_neox": _neox, "llama": _llama, "mistral": _llama, "qwen2": _llama, "cohere2": _cohere2}[
      config["model_type"]]
  return forward(config, tensors, np.asarray(tokens))


def _linear(x, tensors, name, bias=True):
  y = x @ tensors[name + ".weight"].T
  return y + tensors[name + ".bias"] if bias and name + ".bias" in tensors else y


def _layer_norm(x, tensors, name, eps):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + eps) * tensors[name + ".weight"] + tensors[name + ".bias"]


def _rms_norm(x, tensors, name, eps):
  return tensors[name + ".weight"] * (x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps))


def _rotate_half(x):
  half = x.shape[-1] // 2
  return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _rotary(x, theta, rotary_dims):
  """x: [batch, heads, seq, head_dim]; the first rotary_dims rotated, positions 0..seq-1."""
  seq = x.shape[2]
  inv_freq = 1.0 / theta ** (np.arange(0, rotary_dims, 2, dtype=np.float64) / rotary_dims)
  freqs = np.outer(np.arange(seq, dtype=np.float64), inv_freq)            # [seq, rotary_dims / 2]
  emb = np.concatenate([freqs, freqs], axis=-1)
  cos, sin = np.cos(emb), np.sin(emb)
  rot, rest = x[..., :rotary_dims], x[..., rotary_dims:]
  return np.concatenate([rot * cos + _rotate_half(rot) * sin, rest], axis=-1)


def _attention(q, k, v, sliding_window=None):
  """q: [b, heads, s, d]; k, v: [b, kv_heads, s, d] (repeated to heads, as repeat_kv)."""
  groups = q.shape[1] // k.shape[1]
  k, v = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)
  scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(q.shape[-1])
  s = q.shape[2]
  i, j = np.arange(s)[:, None], np.arange(s)[None, :]
  allowed = j <= i
  if sliding_window is not None:
    allowed &= j > i - sliding_window
  scores = np.where(allowed, scores, -np.inf)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  return probs @ v


def _gelu(x, act):
  if act in ("gelu_new", "gelu_pytorch_tanh"):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
  if act == "gelu":                                   # the erf form (Pythia)
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))
  raise ValueError(f"hidden_act {act}")


def _silu(x):
  return x / (1.0 + np.exp(-x))


def _rope(config, default_partial):
  params = config.get("rope_parameters") or {}
  theta = params.get("rope_theta", config.get("rotary_emb_base", config.get("rope_theta", 10000.0)))
  partial = params.get("partial_rotary_factor", config.get("rotary_pct", default_partial))
  return theta, partial


def _neox(config, t, tokens):
  heads, hidden = config["num_attention_heads"], config["hidden_size"]
  head_dim, eps = hidden // heads, config["layer_norm_eps"]
  theta, partial = _rope(config, 0.25)
  b, s = tokens.shape
  x = t["gpt_neox.embed_in.weight"][tokens]
  for layer in range(config["num_hidden_layers"]):
    p = f"gpt_neox.layers.{layer}."
    qkv = _linear(_layer_norm(x, t, p + "input_layernorm", eps), t, p + "attention.query_key_value")
    qkv = qkv.reshape(b, s, heads, 3 * head_dim).transpose(0, 2, 1, 3)   # [b, heads, s, 3 * head_dim]
    q, k, v = np.split(qkv, 3, axis=-1)
    rotary_dims = int(head_dim * partial)
    q, k = _rotary(q, theta, rotary_dims), _rotary(k, theta, rotary_dims)
    attended = _attention(q, k, v).transpose(0, 2, 1, 3).reshape(b, s, hidden)
    attended = _linear(attended, t, p + "attention.dense")

    def mlp(h):
      return _linear(_gelu(_linear(h, t, p + "mlp.dense_h_to_4h"), config["hidden_act"]), t, p + "mlp.dense_4h_to_h")

    if config.get("use_parallel_residual", True):
      x = x + attended + mlp(_layer_norm(x, t, p + "post_attention_layernorm", eps))
    else:
      x = x + attended
      x = x + mlp(_layer_norm(x, t, p + "post_attention_layernorm", eps))
  x = _layer_norm(x, t, "gpt_neox.final_layer_norm", eps)
  head = t["gpt_neox.embed_in.weight"] if config.get("tie_word_embeddings") else t.get("embed_out.weight",
                                                                                      t.get("lm_head.weight"))
  return x @ head.T


def _llama(config, t, tokens):
  heads, hidden = config["num_attention_heads"], config["hidden_size"]
  kv_heads = config.get("num_key_value_heads") or heads
  head_dim = config.get("head_dim") or hidden // heads
  eps = config["rms_norm_eps"]
  theta, partial = _rope(config, 1.0)
  window = config.get("sliding_window") if config["model_type"] == "mistral" else None
  b, s = tokens.shape
  x = t["model.embed_tokens.weight"][tokens]
  for layer in range(config["num_hidden_layers"]):
    p = f"model.layers.{layer}."
    h = _rms_norm(x, t, p + "input_layernorm", eps)
    q = _linear(h, t, p + "self_attn.q_proj").reshape(b, s, heads, head_dim).transpose(0, 2, 1, 3)
    k = _linear(h, t, p + "self_attn.k_proj").reshape(b, s, kv_heads, head_dim).transpose(0, 2, 1, 3)
    v = _linear(h, t, p + "self_attn.v_proj").reshape(b, s, kv_heads, head_dim).transpose(0, 2, 1, 3)
    rotary_dims = int(head_dim * partial)
    q, k = _rotary(q, theta, rotary_dims), _rotary(k, theta, rotary_dims)
    attended = _attention(q, k, v, window).transpose(0, 2, 1, 3).reshape(b, s, heads * head_dim)
    x = x + _linear(attended, t, p + "self_attn.o_proj")
    h = _rms_norm(x, t, p + "post_attention_layernorm", eps)
    x = x + _linear(_silu(_linear(h, t, p + "mlp.gate_proj")) * _linear(h, t, p + "mlp.up_proj"), t,
                    p + "mlp.down_proj")
  x = _rms_norm(x, t, "model.norm", eps)
  head = t["model.embed_tokens.weight"] if config.get("tie_word_embeddings") else t["lm_head.weight"]
  return x @ head.T


def _rotary_interleaved(x, theta):
  """Cohere's rotary: x [batch, heads, seq, d], pairs (2i, 2i + 1) rotated by inv_freq[i]."""
  seq, d = x.shape[2], x.shape[-1]
  inv_freq = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
  emb = np.repeat(np.outer(np.arange(seq, dtype=np.float64), inv_freq), 2, axis=-1)   # [seq, d]
  rotated = np.stack([-x[..., 1::2], x[..., ::2]], axis=-1).reshape(x.shape)
  return x * np.cos(emb) + rotated * np.sin(emb)


def _cohere2(config, t, tokens):
  heads, hidden = config["num_attention_heads"], config["hidden_size"]
  kv_heads = config.get("num_key_value_heads") or heads
  head_dim, eps = hidden // heads, config["layer_norm_eps"]
  theta, _ = _rope(config, 1.0)
  b, s = tokens.shape

  def norm(x, name):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps) * t[name + ".weight"]

  x = t["model.embed_tokens.weight"][tokens]
  for layer, kind in enumerate(config["layer_types"]):
    p = f"model.layers.{layer}."
    h = norm(x, p + "input_layernorm")
    q = _linear(h, t, p + "self_attn.q_proj").reshape(b, s, heads, head_dim).transpose(0, 2, 1, 3)
    k = _linear(h, t, p + "self_attn.k_proj").reshape(b, s, kv_heads, head_dim).transpose(0, 2, 1, 3)
    v = _linear(h, t, p + "self_attn.v_proj").reshape(b, s, kv_heads, head_dim).transpose(0, 2, 1, 3)
    window = None
    if kind == "sliding_attention":
      q, k, window = _rotary_interleaved(q, theta), _rotary_interleaved(k, theta), config["sliding_window"]
    attended = _attention(q, k, v, window).transpose(0, 2, 1, 3).reshape(b, s, heads * head_dim)
    mlp = _linear(_silu(_linear(h, t, p + "mlp.gate_proj")) * _linear(h, t, p + "mlp.up_proj"), t, p + "mlp.down_proj")
    x = x + _linear(attended, t, p + "self_attn.o_proj") + mlp
  x = norm(x, "model.norm")
  head = t["model.embed_tokens.weight"] if config.get("tie_word_embeddings", True) else t["lm_head.weight"]
  return (x @ head.T) * config["logit_scale"]
