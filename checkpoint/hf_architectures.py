"""Hugging Face architectures <-> megajax models: which HF class a megajax model is (the native
families' rows, checkpoint/hf_families.py), its config.json fields, and every tensor's name and
layout. No file is read or written here (checkpoint/huggingface.py does that).

  megajax model                                       Hugging Face
  layernorm + gelu[_exact], any block, no window, no GQA  GPTNeoXForCausalLM (gpt_neox)
  rmsnorm + swiglu, serial, no bias, every layer G    LlamaForCausalLM (llama)
  rmsnorm + swiglu, serial, no bias, every layer L    MistralForCausalLM (mistral, sliding_window)
  rmsnorm + swiglu, serial, biases on q, k, v alone (qkv_bias), every layer G
                                                      Qwen2ForCausalLM (qwen2)
  layernorm_nobias + swiglu, parallel, no bias, NoPE on G layers, any L/G pattern
                                                      Cohere2ForCausalLM (cohere2, layer_types, logit_scale)
  anything else                                       MegajaxForCausalLM (trust_remote_code)

Both sides rotate (x[..., :d/2], x[..., d/2:]) by theta^(-2i/d) (HF's rotate_half), scale
scores by 1/sqrt(head_dim) and attend i - w < j <= i in a window, so a tensor only changes
its name and its layout: torch's Linear weight is [out, in], megajax's kernel [in, ...];
GPT-NeoX fuses q, k and v per head ([heads, 3, head_dim] rows); Cohere rotates interleaved
pairs (2i, 2i + 1), so its q and k rows are megajax's head dims (i, i + d/2) interleaved (scores
are the same under one permutation of q and k). Exact both ways (fp32).
Anything one side cannot say is refused with one line naming it (HfFormatError).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from megajax.checkpoint.hf_families import FAMILY_OF, NATIVE_FAMILIES, HfFormatError, native_architecture
from megajax.layers import BLOCK_FAMILIES
from megajax.model import GPT, ModelConfig, init_params

NEOX, LLAMA, MISTRAL, COHERE2, QWEN2 = "gpt_neox", "llama", "mistral", "cohere2", "qwen2"
NATIVE = {f.model_type: f.hf_class for f in NATIVE_FAMILIES}     # the native families' (hf_families)
# Every other megajax model: its own code beside the weights (checkpoint/remote_code/, loaded
# with trust_remote_code=True), megajax's parameter names and layouts, nothing transformed.
REMOTE = "megajax"
ARCHITECTURES = {**NATIVE, REMOTE: "MegajaxForCausalLM"}
REMOTE_CODE_FILES = ("configuration_megajax.py", "modeling_megajax.py")
# megajax's GeLUs by HF's hidden_act names: model.mlp=gelu is the tanh form (HF writes it two
# ways; export writes gelu_new), gelu_exact the erf one (HF's "gelu", Pythia's).
HF_ACT_OF_MLP = {"gelu": "gelu_new", "gelu_exact": "gelu"}
MLP_OF_HF_ACT = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu": "gelu_exact"}
SILUS = ("silu", "swish")
# Buffers old transformers versions saved with GPT-NeoX / Llama weights: no parameters.
BUFFER_SUFFIXES = ("rotary_emb.inv_freq", "attention.bias", "attention.masked_bias")


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One HF tensor: its name, how it is laid out from megajax leaves (`kind`), the leaves'
  paths; `zeros` is its shape when megajax has no leaf for it (a bias-free model's biases)."""

  name: str
  kind: str
  paths: tuple = ()
  zeros: tuple | None = None


# --- Which architecture, and its config.json.

FORMATS = ("auto", "native", "remote")


def export_architecture(model: ModelConfig, format: str = "auto") -> tuple[str, str]:
  """(the architecture megajax-export-hf writes `model` as, why): a native one where it holds the
  model exactly ("auto", "native": refused naming the field it cannot carry), else megajax's own
  code beside the weights ("auto", "remote")."""
  if format not in FORMATS:
    raise HfFormatError(f"format={format!r}: one of {', '.join(FORMATS)}")
  if format == "remote":
    return REMOTE, "asked for (--format=remote)"
  try:
    arch = native_architecture(model)
  except HfFormatError as error:
    if format == "native":
      raise
    return REMOTE, f"no native architecture holds it: {error}"
  return arch, f"{NATIVE[arch]} holds it exactly"


def hf_config(arch: str, model: ModelConfig, eos_id: int | None, bos_id: int | None) -> dict:
  """The config.json of `model` as `arch`: the keys transformers 4.x reads and 5.x's
  rope_parameters, both."""
  dtype = np.dtype(model.param_dtype).name
  if arch == REMOTE:
    return remote_config(model, eos_id, bos_id)
  config = {
      "architectures": [ARCHITECTURES[arch]], "model_type": arch, "vocab_size": model.vocab_size,
      "hidden_size": model.hidden_dim, "num_hidden_layers": model.num_layers, "num_attention_heads": model.num_heads,
      "intermediate_size": model.mlp_dim, "max_position_embeddings": model.seq_len,
      "tie_word_embeddings": model.tie_embeddings, "bos_token_id": bos_id, "eos_token_id": eos_id,
      "initializer_range": model.init_std, "attention_dropout": 0.0, "use_cache": True, "torch_dtype": dtype,
      "dtype": dtype}
  if arch == NEOX:
    return {**config, "hidden_act": HF_ACT_OF_MLP[model.mlp], "layer_norm_eps": model.layernorm_epsilon,
            "use_parallel_residual": BLOCK_FAMILIES[model.block].parallel, "attention_bias": True, "hidden_dropout": 0.0,
            "rotary_pct": 1.0, "rotary_emb_base": model.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": model.rope_theta, "partial_rotary_factor": 1.0}}
  if arch == COHERE2:
    return {**config, "hidden_act": "silu", "layer_norm_eps": model.layernorm_epsilon,
            "num_key_value_heads": model.num_kv_heads, "head_dim": model.head_dim, "attention_bias": False,
            "logit_scale": model.logit_scale, "rope_theta": model.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": model.rope_theta},
            "sliding_window": model.window or model.seq_len,
            "layer_types": ["full_attention" if model.layer_window(i) is None else "sliding_attention"
                            for i in range(model.num_layers)]}
  config.update({"hidden_act": "silu", "rms_norm_eps": model.layernorm_epsilon, "num_key_value_heads": model.num_kv_heads,
                 "head_dim": model.head_dim, "attention_bias": False, "rope_theta": model.rope_theta,
                 "rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": model.rope_theta}})
  if arch == LLAMA:
    return {**config, "mlp_bias": False, "pretraining_tp": 1}
  if arch == QWEN2:       # q, k and v biased (Qwen2's attention always is), every layer global
    return {**config, "use_sliding_window": False, "sliding_window": None, "max_window_layers": model.num_layers,
            "layer_types": ["full_attention"] * model.num_layers}
  return {**config, "sliding_window": model.window}


def _int(hf: dict, key: str, default=None) -> int:
  value = hf.get(key, default)
  if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
    raise HfFormatError(f"{key}={value!r}: not a positive integer")
  return value


def _rope(hf: dict, arch: str) -> float:
  """rope_theta; partial rotary or scaled rope is refused."""
  params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  if not isinstance(params, dict) or "full_attention" in params or "sliding_attention" in params:
    raise HfFormatError(f"rope_parameters={params!r}: megajax has one default rotary embedding for every layer")
  kind = params.get("rope_type", params.get("type", "default"))
  if kind != "default":
    raise HfFormatError(f"rope_type={kind!r} (rope scaling): megajax's rotary embedding is the default one")
  if arch == NEOX:
    partial = params.get("partial_rotary_factor", hf.get("rotary_pct", 0.25))
    theta = params.get("rope_theta", hf.get("rotary_emb_base", hf.get("rope_theta", 10000.0)))
  else:
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
  if partial != 1.0:
    raise HfFormatError(f"partial_rotary_factor={partial} (rotary_pct): megajax rotates every head dimension (1.0)")
  return float(theta)


def model_fields(hf: dict) -> tuple[str, dict]:
  """(arch, {megajax model field: value}) from a config.json, before the weights are read.
  GPT-NeoX's block ("parallel" or "parallel_two_norms") and use_bias depend on the weights
  (weight_dependent_fields)."""
  arch = hf.get("model_type")
  if arch not in ARCHITECTURES:
    raise HfFormatError(f"model_type={arch!r}: megajax reads gpt_neox (GPTNeoXForCausalLM), llama "
                        "(LlamaForCausalLM), mistral (MistralForCausalLM), cohere2 (Cohere2ForCausalLM), qwen2 "
                        "(Qwen2ForCausalLM) and its own megajax (MegajaxForCausalLM)")
  heads, hidden = _int(hf, "num_attention_heads"), _int(hf, "hidden_size")
  if hidden % heads:
    raise HfFormatError(f"hidden_size={hidden} is not divisible by num_attention_heads={heads}")
  fields = {"vocab_size": _int(hf, "vocab_size"), "seq_len": _int(hf, "max_position_embeddings"),
            "num_layers": _int(hf, "num_hidden_layers"), "hidden_dim": hidden, "num_heads": heads,
            "mlp_dim": _int(hf, "intermediate_size"), "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "rope_theta": _rope(hf, arch), "window": 0, "window_pattern": "L", "global_rope": True, "logit_scale": 1.0,
            "qkv_bias": False}
  if arch == REMOTE:
    return arch, remote_fields(hf, fields)
  act = hf.get("hidden_act")
  if arch == NEOX:
    if act not in MLP_OF_HF_ACT:
      tanh = " or ".join(name for name, mlp in MLP_OF_HF_ACT.items() if mlp == "gelu")
      raise HfFormatError(f"hidden_act={act!r}: megajax's GeLUs are the tanh form ({tanh}) and "
                          f"the exact one ({HF_ACT_OF_MLP['gelu_exact']})")
    parallel = hf.get("use_parallel_residual", True)
    return arch, {**fields, "norm": "layernorm", "mlp": MLP_OF_HF_ACT[act],
                  "num_kv_heads": heads,
                  "block": "parallel_two_norms" if parallel else "serial", "use_bias": True,
                  "layernorm_epsilon": float(hf.get("layer_norm_eps", 1e-5))}
  if act not in SILUS:
    raise HfFormatError(f"hidden_act={act!r}: megajax's SwiGLU gates with silu")
  if arch == COHERE2:
    return arch, _cohere2_fields(hf, fields)
  for key in ("attention_bias", "mlp_bias"):
    if hf.get(key):
      raise HfFormatError(f"{key}=true: megajax's rmsnorm + swiglu blocks have no biases but Qwen2's on q, k and v")
  if arch == QWEN2 and (hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or ())):
    raise HfFormatError("use_sliding_window=true: megajax reads Qwen2 models whose every layer is global")
  fields.update(FAMILY_OF[arch].fields(), num_kv_heads=_kv_heads(hf, fields),
                layernorm_epsilon=float(hf.get("rms_norm_eps", 1e-6)))
  window = hf.get("sliding_window") if arch == MISTRAL else None
  if window is not None:
    fields["window"] = min(_int(hf, "sliding_window"), fields["seq_len"])   # wider than a sequence: the same
  return arch, fields


def _kv_heads(hf: dict, fields: dict) -> int:
  """num_key_value_heads (default: one per query head), checked, with head_dim, against megajax's
  heads of hidden_size / num_attention_heads."""
  heads, hidden = fields["num_heads"], fields["hidden_dim"]
  if hf.get("head_dim") not in (None, hidden // heads):
    raise HfFormatError(f"head_dim={hf['head_dim']}: megajax's head dim is hidden_size / num_attention_heads = "
                        f"{hidden // heads}")
  kv_heads = _int(hf, "num_key_value_heads", heads)
  if heads % kv_heads:
    raise HfFormatError(f"num_key_value_heads={kv_heads} does not divide num_attention_heads={heads}")
  return kv_heads


def _cohere2_fields(hf: dict, fields: dict) -> dict:
  """Cohere2's model fields: its layer_types (or the older sliding_window_pattern, every n-th layer
  global) with sliding_window, its logit scale; NoPE on the global layers."""
  if hf.get("attention_bias"):
    raise HfFormatError("attention_bias=true: megajax's Cohere2 blocks have no biases")
  if hf.get("use_qk_norm"):
    raise HfFormatError("use_qk_norm=true: megajax has no query / key norms")
  kv_heads = _kv_heads(hf, fields)
  layers = fields["num_layers"]
  types = hf.get("layer_types")
  if types is None:
    pattern = _int(hf, "sliding_window_pattern", 4)
    types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
  if not isinstance(types, list) or len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
    raise HfFormatError(f"layer_types={types!r}: not sliding_attention / full_attention for each of {layers} layers")
  window = min(_int(hf, "sliding_window"), fields["seq_len"]) if "sliding_attention" in types else None
  windows = [window if kind == "sliding_attention" else None for kind in types]
  scale = hf.get("logit_scale", 0.0625)
  if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
    raise HfFormatError(f"logit_scale={scale!r}: not a positive number")
  return {**fields, **FAMILY_OF[COHERE2].fields(), "num_kv_heads": kv_heads, "global_rope": False,
          "logit_scale": float(scale),
          "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
          "layernorm_epsilon": float(hf.get("layer_norm_eps", 1e-5)), **_window_fields(windows)}


# --- Tensors.

def tensor_table(arch: str, model: ModelConfig) -> list[Tensor]:
  """Every tensor of the HF checkpoint of `model`, in the order HF lists them."""
  if arch == REMOTE:
    return [Tensor(".".join(path), "copy", (path,)) for path in parameter_shapes(model)]
  if arch == COHERE2:
    return _cohere2_table(model)
  if arch == NEOX:
    table = [Tensor("gpt_neox.embed_in.weight", "copy", (("embedding",),))]
    for layer in range(model.num_layers):
      table += _neox_layer(model, layer)
    table += [Tensor("gpt_neox.final_layer_norm.weight", "copy", (("final_norm", "scale"),)),
              Tensor("gpt_neox.final_layer_norm.bias", "copy", (("final_norm", "bias"),))]
    return table + ([] if model.tie_embeddings else [Tensor("embed_out.weight", "linear", (("head",),))])
  table = [Tensor("model.embed_tokens.weight", "copy", (("embedding",),))]
  for layer in range(model.num_layers):
    p, own = f"model.layers.{layer}.", f"layer_{layer}"
    table.append(Tensor(p + "input_layernorm.weight", "copy", ((own, "attention_norm", "scale"),)))
    for x, name in (("q", "query"), ("k", "key"), ("v", "value")):
      table.append(Tensor(f"{p}self_attn.{x}_proj.weight", "heads_in", ((own, "attention", name, "kernel"),)))
      if model.qkv_bias:     # Qwen2's
        table.append(Tensor(f"{p}self_attn.{x}_proj.bias", "heads_bias", ((own, "attention", name, "bias"),)))
    table += [Tensor(p + "self_attn.o_proj.weight", "heads_out", ((own, "attention", "out", "kernel"),)),
              Tensor(p + "post_attention_layernorm.weight", "copy", ((own, "mlp_norm", "scale"),)),
              *[Tensor(f"{p}mlp.{x}_proj.weight", "linear", ((own, "mlp", name, "kernel"),))
                for x, name in (("gate", "wi_gate"), ("up", "wi_up"), ("down", "wo"))]]
  table.append(Tensor("model.norm.weight", "copy", (("final_norm", "scale"),)))
  return table + ([] if model.tie_embeddings else [Tensor("lm_head.weight", "linear", (("head",),))])


def _cohere2_table(model: ModelConfig) -> list[Tensor]:
  table = [Tensor("model.embed_tokens.weight", "copy", (("embedding",),))]
  for layer in range(model.num_layers):
    p, own = f"model.layers.{layer}.", f"layer_{layer}"
    table += [Tensor(p + "input_layernorm.weight", "copy", ((own, "norm", "scale"),)),
              Tensor(p + "self_attn.q_proj.weight", "heads_in_interleaved", ((own, "attention", "query", "kernel"),)),
              Tensor(p + "self_attn.k_proj.weight", "heads_in_interleaved", ((own, "attention", "key", "kernel"),)),
              Tensor(p + "self_attn.v_proj.weight", "heads_in", ((own, "attention", "value", "kernel"),)),
              Tensor(p + "self_attn.o_proj.weight", "heads_out", ((own, "attention", "out", "kernel"),)),
              *[Tensor(f"{p}mlp.{x}_proj.weight", "linear", ((own, "mlp", name, "kernel"),))
                for x, name in (("gate", "wi_gate"), ("up", "wi_up"), ("down", "wo"))]]
  table.append(Tensor("model.norm.weight", "copy", (("final_norm", "scale"),)))
  return table + ([] if model.tie_embeddings else [Tensor("lm_head.weight", "linear", (("head",),))])


def _interleaved(head_dim: int) -> np.ndarray:
  """Cohere's rotary pairs (2i, 2i + 1) from megajax's (i, i + d/2): HF dim j is megajax dim perm[j]."""
  half = np.arange(head_dim // 2)
  return np.stack([half, half + head_dim // 2], axis=1).reshape(-1)


def _neox_layer(model: ModelConfig, layer: int) -> list[Tensor]:
  p, own, hidden = f"gpt_neox.layers.{layer}.", f"layer_{layer}", model.hidden_dim
  norms = BLOCK_FAMILIES[model.block].norms
  if len(norms) == 1:       # one norm before both branches: HF's two norms are that one's
    norms *= 2
  table = []
  for hf_norm, norm in zip(("input_layernorm", "post_attention_layernorm"), norms):
    table += [Tensor(f"{p}{hf_norm}.{hf}", "copy", ((own, norm, leaf),)) for hf, leaf in (("weight", "scale"),
                                                                                           ("bias", "bias"))]

  def bias(name: str, kind: str, paths: tuple, shape: tuple) -> Tensor:
    return Tensor(name, kind, paths) if model.use_bias else Tensor(name, kind, zeros=shape)

  qkv = ("query", "key", "value")
  return table + [
      Tensor(p + "attention.query_key_value.weight", "qkv", tuple((own, "attention", x, "kernel") for x in qkv)),
      bias(p + "attention.query_key_value.bias", "qkv_bias", tuple((own, "attention", x, "bias") for x in qkv),
           (3 * hidden,)),
      Tensor(p + "attention.dense.weight", "heads_out", ((own, "attention", "out", "kernel"),)),
      bias(p + "attention.dense.bias", "copy", ((own, "attention", "out", "bias"),), (hidden,)),
      Tensor(p + "mlp.dense_h_to_4h.weight", "linear", ((own, "mlp", "wi", "kernel"),)),
      bias(p + "mlp.dense_h_to_4h.bias", "copy", ((own, "mlp", "wi", "bias"),), (model.mlp_dim,)),
      Tensor(p + "mlp.dense_4h_to_h.weight", "linear", ((own, "mlp", "wo", "kernel"),)),
      bias(p + "mlp.dense_4h_to_h.bias", "copy", ((own, "mlp", "wo", "bias"),), (hidden,))]


def to_hf(kind: str, arrays: list[np.ndarray]) -> np.ndarray:
  """megajax leaves -> the HF tensor (torch Linear weights are [out, in])."""
  a = arrays[0]
  if kind == "copy":
    return a
  if kind == "linear":                                  # [in, out] -> [out, in]
    return a.T
  if kind == "heads_in":                                # [hidden, heads, d] -> [heads * d, hidden]
    return a.reshape(a.shape[0], -1).T
  if kind == "heads_in_interleaved":                    # the same, each head's dims in Cohere's order
    return a[..., _interleaved(a.shape[-1])].reshape(a.shape[0], -1).T
  if kind == "heads_out":                               # [heads, d, hidden] -> [hidden, heads * d]
    return a.reshape(-1, a.shape[-1]).T
  if kind == "heads_bias":                              # [heads, d] -> [heads * d]
    return a.reshape(-1)
  if kind == "qkv":                                     # 3 x [hidden, heads, d] -> [heads * 3 * d, hidden]
    return np.stack(arrays, axis=2).reshape(a.shape[0], -1).T
  if kind == "qkv_bias":                                # 3 x [heads, d] -> [heads * 3 * d]
    return np.stack(arrays, axis=1).reshape(-1)
  raise AssertionError(kind)


def from_hf(kind: str, tensor: np.ndarray, shapes: list[tuple]) -> list[np.ndarray]:
  """The HF tensor -> megajax leaves of `shapes` (to_hf's inverse)."""
  if kind == "copy":
    return [tensor]
  if kind == "linear":
    return [tensor.T]
  if kind in ("heads_in", "heads_out"):
    return [tensor.T.reshape(shapes[0])]
  if kind == "heads_bias":
    return [tensor.reshape(shapes[0])]
  if kind == "heads_in_interleaved":
    return [tensor.T.reshape(shapes[0])[..., np.argsort(_interleaved(shapes[0][-1]))]]
  if kind == "qkv":
    hidden, heads, d = shapes[0]
    fused = tensor.T.reshape(hidden, heads, 3, d)
    return [fused[:, :, i] for i in range(3)]
  if kind == "qkv_bias":
    fused = tensor.reshape(shapes[0][0], 3, shapes[0][1])
    return [fused[:, i] for i in range(3)]
  raise AssertionError(kind)


def hf_shape(kind: str, shapes: list[tuple]) -> tuple:
  """The HF tensor's shape for megajax leaves of `shapes`."""
  s = shapes[0]
  return {"copy": lambda: s, "linear": lambda: s[::-1], "heads_in": lambda: (s[1] * s[2], s[0]),
          "heads_in_interleaved": lambda: (s[1] * s[2], s[0]),
          "heads_out": lambda: (s[2], s[0] * s[1]), "heads_bias": lambda: (s[0] * s[1],),
          "qkv": lambda: (3 * s[1] * s[2], s[0]),
          "qkv_bias": lambda: (3 * s[0] * s[1],)}[kind]()


# --- megajax's own architecture (trust_remote_code).

def parameter_shapes(model: ModelConfig) -> dict[tuple, tuple]:
  """{path: shape} of the model's parameters, as megajax.init_params nests them (shapes only)."""
  abstract = jax.eval_shape(lambda: init_params(GPT(model), jax.random.key(0)))
  return {tuple(k.key for k in path): tuple(leaf.shape)
          for path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]}


def remote_config(model: ModelConfig, eos_id: int | None, bos_id: int | None) -> dict:
  """config.json of megajax's own architecture: what configuration_megajax.MegajaxConfig reads,
  `auto_map` naming the code files, each layer's window (null: global)."""
  dtype = np.dtype(model.param_dtype).name
  return {"architectures": [ARCHITECTURES[REMOTE]], "model_type": REMOTE,
          "auto_map": {"AutoConfig": "configuration_megajax.MegajaxConfig",
                       "AutoModelForCausalLM": "modeling_megajax.MegajaxForCausalLM"},
          "vocab_size": model.vocab_size, "hidden_size": model.hidden_dim, "num_hidden_layers": model.num_layers,
          "num_attention_heads": model.num_heads, "num_key_value_heads": model.num_kv_heads,
          "intermediate_size": model.mlp_dim, "max_position_embeddings": model.seq_len, "block": model.block,
          "norm": model.norm, "mlp": model.mlp, "use_bias": model.use_bias, "qkv_bias": model.qkv_bias,
          "rope_theta": model.rope_theta,
          "layer_norm_eps": model.layernorm_epsilon, "tie_embeddings": model.tie_embeddings,
          "global_rope": model.global_rope, "logit_scale": model.logit_scale,
          "layer_windows": [model.layer_window(layer) for layer in range(model.num_layers)],
          "initializer_range": model.init_std, "tie_word_embeddings": False, "use_cache": True,
          "bos_token_id": bos_id, "eos_token_id": eos_id, "torch_dtype": dtype, "dtype": dtype}


def _window_fields(windows: list) -> dict:
  """model.window and the shortest model.window_pattern that give each layer its window."""
  local = {w for w in windows if w is not None}
  if not local:
    return {"window": 0, "window_pattern": "L"}
  if len(local) > 1:
    raise HfFormatError(f"layer_windows={windows}: megajax's local layers share one window (model.window)")
  letters = "".join("G" if w is None else "L" for w in windows)
  period = next(p for p in range(1, len(letters) + 1)
                if all(letters[i] == letters[i % p] for i in range(len(letters))))
  return {"window": local.pop(), "window_pattern": letters[:period]}


def remote_fields(hf: dict, fields: dict) -> dict:
  """megajax's model fields from its own architecture's config.json (remote_config's inverse),
  over the fields every architecture's config.json gives (`fields`)."""
  windows = hf.get("layer_windows")
  if not isinstance(windows, list) or len(windows) != fields["num_layers"] or not all(
      w is None or (isinstance(w, int) and not isinstance(w, bool) and w > 0) for w in windows):
    raise HfFormatError(f"layer_windows={windows!r}: not one window (a positive integer, or null) per layer")
  return {**fields, "num_kv_heads": _kv_heads(hf, fields), "block": str(hf.get("block")),
          "norm": str(hf.get("norm")), "mlp": str(hf.get("mlp")), "use_bias": bool(hf.get("use_bias")),
          "qkv_bias": bool(hf.get("qkv_bias", False)),
          "layernorm_epsilon": float(hf.get("layer_norm_eps", 1e-5)),
          "tie_embeddings": bool(hf.get("tie_embeddings", False)), "global_rope": bool(hf.get("global_rope", True)),
          "logit_scale": float(hf.get("logit_scale", 1.0)), **_window_fields(windows)}