r"""A Qwen2-shaped model (transformers' Qwen2ForCausalLM), small: Llama's serial block (RMSNorm,
SwiGLU, no biases) with biases on the query, key and value projections alone
(model.qkv_bias), grouped KV heads, tied embeddings, every layer global. megajax-export-hf writes
it natively and megajax-import-hf reads Qwen2 checkpoints whose layers are all global
(docs/huggingface.md).

  megajax-train --config=configs/qwen2.py --workdir=/tmp/qwen2
  megajax-export-hf --workdir=/tmp/qwen2 --out=/tmp/qwen2-hf     # Qwen2ForCausalLM
"""

from megajax.config import default_config


def get_config():
  config = default_config()
  m = config.model
  m.num_layers, m.hidden_dim, m.num_heads, m.num_kv_heads = 4, 128, 4, 2
  m.seq_len, m.window = 128, 0                                   # every layer global, as Qwen2 exports
  m.block, m.norm, m.mlp, m.use_bias, m.qkv_bias = "serial", "rmsnorm", "swiglu", False, True
  m.layernorm_epsilon, m.rope_theta, m.tie_embeddings = 1e-6, 1e6, True
  m.mlp_dim = 384
  m.attention_impl = "xla"
  config.train.steps, config.train.batch_size, config.train.log_every = 200, 16, 20
  config.optimizer.warmup_steps = 20
  return config
