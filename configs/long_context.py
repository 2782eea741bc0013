r"""Long context, `--config=configs/long_context.py:<size>`: rows split over the cp mesh axis.

  megajax-train --config=configs/long_context.py --workdir=/tmp/long
  megajax-plan --config=configs/long_context.py:7b --gpus=64 --hardware=h100-80g --batch=8

  tiny   (the default) rows of 4,096 tokens split over cp = 4 devices, tensor parallel over
         2 inside each (8 devices; on CPU the launcher asks XLA for 8): a Mistral-style sliding
         window of 256 on three layers of four and a global layer of full causal attention.
         A rank holds two chunks of 512 positions (the dual-chunk layout); a local layer
         receives the 255 keys and values before each chunk from a neighbour (the halo: the
         same bytes at any sequence length), the global layer passes the shards' keys and values
         round the cp ring. About 3 minutes on 2 CPU cores, where the attention is XLA's (dense
         within a shard: its work grows with the shard's square); on GPUs set
         --config.model.attention_impl=pallas and raise model.seq_len with parallel.cp.
  7b     Mistral-7B's shape (32 layers of 4096, 32 heads over 8 KV heads, SwiGLU 14336, window
         4096 on every layer) on rows of 131,072 tokens, cp = 8 x tp = 4 (32 H100s), remat full,
         the Pallas kernels: compiled for described H100s (megajax-plan --compile --gpus=32),
         35.1 GiB a device.
"""

from megajax.config import default_config

SIZES = ("tiny", "7b")


def get_config(size: str = "tiny"):
  if size not in SIZES:
    raise ValueError(f"no size {size!r}; use configs/long_context.py:<size> with one of {', '.join(SIZES)}")
  config = default_config()
  m, p, t = config.model, config.parallel, config.train
  if size == "tiny":
    m.num_layers, m.hidden_dim, m.num_heads, m.num_kv_heads = 4, 128, 8, 4
    m.seq_len, m.window, m.window_pattern, m.remat = 4096, 256, "LLLG", "full"
    t.steps, t.batch_size, t.log_every = 20, 1, 5
    config.optimizer.warmup_steps, config.optimizer.learning_rate = 5, 1e-2
    p.cp, p.tp = 4, 2
  else:
    m.vocab_size, m.seq_len, m.num_layers, m.hidden_dim, m.num_heads, m.num_kv_heads = 32000, 131072, 32, 4096, 32, 8
    m.mlp_dim, m.mlp, m.norm, m.block, m.use_bias = 14336, "swiglu", "rmsnorm", "serial", False
    m.window, m.window_pattern, m.remat, m.attention_impl = 4096, "L", "full", "pallas"
    t.steps, t.batch_size = 100_000, 1
    p.cp, p.tp = 8, 4
  return config
