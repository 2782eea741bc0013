"""The Hugging Face architectures megajax writes natively, each stated once as what it carries of
a megajax model (NATIVE_FAMILIES, one row a family).

`native_architecture(model)` is the row that holds a model exactly; where none does, it names
the field that keeps the closest rows from it, and what they need (HfFormatError, one line).
hf_architectures.py has each row's config.json and tensor names. Adding a native family: its
row here, its config.json and tensors there, its case in tests/unit/test_huggingface.py.
"""

from __future__ import annotations

import dataclasses

from megajax.layers import BLOCK_FAMILIES
from megajax.model import ModelConfig


class HfFormatError(ValueError):
  """A model one side cannot represent, or files that are not what they claim; one line."""


def biases_of(model: ModelConfig) -> str:
  """Which linears have biases: "all" (model.use_bias), "qkv" (model.qkv_bias alone) or "none"."""
  return "all" if model.use_bias else "qkv" if model.qkv_bias else "none"


def layers_of(model: ModelConfig) -> str:
  """"global" (every layer full causal), "local" (every layer windowed) or "mixed"."""
  windows = {model.layer_window(layer) is None for layer in range(model.num_layers)}
  return "mixed" if len(windows) > 1 else "global" if True in windows else "local"


@dataclasses.dataclass(frozen=True)
class NativeFamily:
  """What one HF architecture holds of a megajax model."""
  model_type: str
  hf_class: str
  name: str
  norm: str                          # model.norm
  mlps: tuple[str, ...]              # model.mlp
  blocks: tuple[str, ...]            # model.block
  biases: tuple[str, ...]            # biases_of(model)
  layers: tuple[str, ...]            # layers_of(model)
  grouped_kv: bool                   # num_kv_heads < num_heads
  global_positions: bool | None      # its global layers rotate (True), see no positions (False); None: it has none
  logit_scale: bool                  # a logit scale other than 1

  def mismatches(self, model: ModelConfig) -> list[tuple[str, str]]:
    """(the model's field=value, what this family needs instead) for each field it cannot carry."""
    found = []
    if model.block not in self.blocks:
      found.append((f"model.block={model.block}", f"{self.name} has {' or '.join(self.blocks)} blocks "
                                                   f"(model.block={self.blocks[0]})"))
    biases = biases_of(model)
    if biases not in self.biases:
      field = "model.use_bias=True" if biases == "all" else "model.qkv_bias=True" if biases == "qkv" else \
          "model.use_bias=False"
      need = {"all": "biases on every linear (model.use_bias=True)", "none": "no biases (model.use_bias=False, "
              "model.qkv_bias=False)", "qkv": "biases on q, k and v alone (model.use_bias=False, model.qkv_bias=True)"}
      found.append((field, f"{self.name} has " + " or ".join(need[b] for b in self.biases)))
    layers = layers_of(model)
    if layers not in self.layers:
      need = {"global": "every layer global (model.window=0)", "local": "every layer local (window_pattern L)",
              "mixed": "local and global layers"}
      found.append((f"model.window={model.window} (window_pattern={model.window_pattern!r})",
                    f"{self.name} has " + " or ".join(need[x] for x in self.layers)))
    if model.num_kv_heads != model.num_heads and not self.grouped_kv:
      found.append((f"model.num_kv_heads={model.num_kv_heads}", f"{self.name} has no grouped KV heads "
                                                               f"(num_kv_heads = num_heads = {model.num_heads})"))
    if layers != "local" and model.global_rope != self.global_positions:
      found.append((f"model.global_rope={model.global_rope}", f"{self.name}'s global layers "
                    + ("rotate their positions (model.global_rope=True)" if self.global_positions else
                       "have no positions (model.global_rope=False)")))
    if model.logit_scale != 1.0 and not self.logit_scale:
      found.append((f"model.logit_scale={model.logit_scale}", f"{self.name} has no logit scale (1.0)"))
    return found

  def fields(self) -> dict:
    """The megajax model fields its files leave no choice in (first choices where they do: GPT-NeoX's
    block and biases come from its config and weights)."""
    biases = self.biases[0]
    return {"norm": self.norm, "mlp": self.mlps[0], "block": self.blocks[0], "use_bias": biases == "all",
            "qkv_bias": biases == "qkv"}


NATIVE_FAMILIES = (
    NativeFamily("gpt_neox", "GPTNeoXForCausalLM", "GPT-NeoX", norm="layernorm", mlps=("gelu", "gelu_exact"),
                 blocks=tuple(BLOCK_FAMILIES), biases=("all", "none"), layers=("global",), grouped_kv=False,
                 global_positions=True, logit_scale=False),
    NativeFamily("llama", "LlamaForCausalLM", "Llama", norm="rmsnorm", mlps=("swiglu",), blocks=("serial",),
                 biases=("none",), layers=("global",), grouped_kv=True, global_positions=True, logit_scale=False),
    NativeFamily("mistral", "MistralForCausalLM", "Mistral", norm="rmsnorm", mlps=("swiglu",), blocks=("serial",),
                 biases=("none",), layers=("local",), grouped_kv=True, global_positions=True, logit_scale=False),
    NativeFamily("qwen2", "Qwen2ForCausalLM", "Qwen2", norm="rmsnorm", mlps=("swiglu",), blocks=("serial",),
                 biases=("qkv",), layers=("global",), grouped_kv=True, global_positions=True, logit_scale=False),
    NativeFamily("cohere2", "Cohere2ForCausalLM", "Cohere2", norm="layernorm_nobias", mlps=("swiglu",),
                 blocks=("parallel",), biases=("none",), layers=("global", "local", "mixed"), grouped_kv=True,
                 global_positions=False, logit_scale=True),
)

FAMILY_OF = {f.model_type: f for f in NATIVE_FAMILIES}


def native_architecture(model: ModelConfig) -> str:
  """The model_type of the native family that holds `model` exactly; else HfFormatError naming
  the first field that keeps the closest families (fewest fields they cannot carry) from it."""
  candidates = [f for f in NATIVE_FAMILIES if f.norm == model.norm and model.mlp in f.mlps]
  if not candidates:
    kinds = {}
    for f in NATIVE_FAMILIES:
      kinds.setdefault(f"{f.norm} + {' or '.join(f.mlps)}", []).append(f.name)
    have = "; ".join(f"{', '.join(names)}: {kind}" for kind, names in kinds.items())
    raise HfFormatError(f"model.norm={model.norm}, model.mlp={model.mlp}: no Hugging Face architecture megajax "
                        f"writes has it ({have})")
  misses = {f: f.mismatches(model) for f in candidates}
  exact = [f for f in candidates if not misses[f]]
  if exact:
    return exact[0].model_type
  fewest = min(len(m) for m in misses.values())
  closest = [f for f in candidates if len(misses[f]) == fewest]
  field = misses[closest[0]][0][0]
  needs = [need if got == field else f"{got}: {need}" for got, need in (misses[f][0] for f in closest)]
  raise HfFormatError(f"{field}: " + "; ".join(needs))
