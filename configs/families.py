r"""Small models of the Hugging Face families, one config, big_vision style:
`--config=configs/families.py:<family>`. Each trains on a CPU in minutes and exports natively
(megajax-export-hf; docs/huggingface.md says what maps to what):

  megajax-train --config=configs/families.py:qwen2 --workdir=/tmp/qwen2
  megajax-export-hf --workdir=/tmp/qwen2 --out=/tmp/qwen2-hf     # Qwen2ForCausalLM

The families (FAMILIES), each 4 layers of 128 (4 heads, 2 KV heads), sequence 128, SwiGLU of
384, tied embeddings:

  cohere2  Cohere2ForCausalLM (Command R7B's family): one LayerNorm without bias before a
           parallel block, no biases, three sliding-window layers then a global one without
           positions (NoPE), a logit scale.
  llama    LlamaForCausalLM: pre-norm serial blocks with RMSNorm, no biases, every layer global.
  qwen2    Qwen2ForCausalLM: Llama's with biases on the query, key and value projections alone
           (model.qkv_bias), rope theta 1e6.

configs/cohere2.py loads the same as :cohere2 (Mistral's block on the default job's mesh:
configs/mistral_tiny.py).
"""

from megajax.config import default_config

# family -> its model fields over the shared small shape.
FAMILIES = {
    "cohere2": {"window": 32, "window_pattern": "LLLG", "block": "parallel", "norm": "layernorm_nobias",
                "use_bias": False, "global_rope": False, "logit_scale": 0.0625},
    "llama": {"window": 0, "block": "serial", "norm": "rmsnorm", "use_bias": False, "layernorm_epsilon": 1e-6},
    "qwen2": {"window": 0, "block": "serial", "norm": "rmsnorm", "use_bias": False, "qkv_bias": True,
              "layernorm_epsilon": 1e-6, "rope_theta": 1e6},
}


def get_config(family: str = "qwen2"):
  if family not in FAMILIES:
    raise ValueError(f"no family {family!r}; use configs/families.py:<family> with one of {', '.join(FAMILIES)}")
  config = default_config()
  config.model.update(num_layers=4, hidden_dim=128, num_heads=4, num_kv_heads=2, seq_len=128, mlp="swiglu",
                      mlp_dim=384, tie_embeddings=True, attention_impl="xla", **FAMILIES[family])
  config.train.steps, config.train.batch_size, config.train.log_every = 200, 16, 20
  config.optimizer.warmup_steps = 20
  return config
