"""A megajax model's configuration for transformers (trust_remote_code): written next to the
weights by megajax-export-hf. Self-contained: transformers only, no megajax import."""

from transformers import PretrainedConfig


class MegajaxConfig(PretrainedConfig):
  """The megajax model fields (megajax.model.ModelConfig) under transformers' usual names where
  one exists: `layer_windows` is each layer's sliding window (null: global, causal over all)."""

  model_type = "megajax"

  def __init__(self, vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=None, intermediate_size=None, max_position_embeddings=128, block="parallel",
               norm="layernorm", mlp="gelu", use_bias=True, qkv_bias=False, rope_theta=10000.0, layer_norm_eps=1e-5,
               layer_windows=None, tie_embeddings=False, initializer_range=0.02, global_rope=True, logit_scale=1.0,
               **kwargs):
    self.vocab_size = vocab_size
    self.hidden_size = hidden_size
    self.num_hidden_layers = num_hidden_layers
    self.num_attention_heads = num_attention_heads
    self.num_key_value_heads = num_key_value_heads or num_attention_heads
    self.intermediate_size = intermediate_size or 4 * hidden_size
    self.max_position_embeddings = max_position_embeddings
    self.block = block                  # "parallel", "parallel_two_norms" or "serial"
    self.norm = norm                    # "layernorm", "layernorm_nobias" or "rmsnorm"
    self.mlp = mlp                      # "gelu" (tanh form), "gelu_exact" or "swiglu"
    self.use_bias = use_bias
    self.qkv_bias = qkv_bias            # biases on q, k and v even without use_bias (Qwen2's)
    self.rope_theta = rope_theta
    self.layer_norm_eps = layer_norm_eps
    self.layer_windows = list(layer_windows) if layer_windows is not None else [None] * num_hidden_layers
    self.tie_embeddings = tie_embeddings
    self.initializer_range = initializer_range
    self.global_rope = global_rope      # False: global layers without rotary positions (NoPE)
    self.logit_scale = logit_scale      # the logits times this
    # The head reads the embedding itself when tied: nothing for transformers to tie.
    kwargs["tie_word_embeddings"] = False
    super().__init__(**kwargs)
