r"""A Cohere2-shaped model (Cohere's Command R7B family, transformers' Cohere2ForCausalLM), small:
one LayerNorm without bias before a parallel block, SwiGLU, no biases, three sliding-window
layers then a global one without positions (NoPE), grouped KV heads, tied embeddings with a
logit scale. megajax-export-hf writes it natively (docs/huggingface.md).

  megajax-train --config=configs/cohere2.py --workdir=/tmp/cohere2
  megajax-export-hf --workdir=/tmp/cohere2 --out=/tmp/cohere2-hf     # Cohere2ForCausalLM
"""

from megajax.config import default_config


def get_config():
  config = default_config()
  m = config.model
  m.num_layers, m.hidden_dim, m.num_heads, m.num_kv_heads = 4, 128, 4, 2
  m.seq_len, m.window, m.window_pattern = 128, 32, "LLLG"     # Cohere2's layer_types: 3 sliding, 1 full
  m.block, m.norm, m.mlp, m.use_bias = "parallel", "layernorm_nobias", "swiglu", False
  m.global_rope, m.logit_scale, m.tie_embeddings = False, 0.0625, True
  m.mlp_dim = 384
  m.attention_impl = "xla"
  config.train.steps, config.train.batch_size, config.train.log_every = 200, 16, 20
  config.optimizer.warmup_steps = 20
  return config
