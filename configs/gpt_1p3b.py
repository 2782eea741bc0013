r"""GPT 1.3B (GPT-3 XL shape, 16 heads of 128), parallel block, sliding window, LAMB.

On one node of 8 GPUs, data parallel:

  megajax-train --config=configs/gpt_1p3b.py --workdir=/tmp/gpt1p3b --config.parallel.dp=8
"""

from megajax.config import default_config


def get_config():
  config = default_config()
  config.model.vocab_size = 64000
  config.model.seq_len = 2048
  config.model.num_layers = 24
  config.model.hidden_dim = 2048
  config.model.num_heads = 16
  config.model.window = 1024
  config.model.remat = "dots"
  config.train.steps = 100_000
  config.train.batch_size = 512
  config.train.microbatches = 8   # 8 sequences per microbatch and replica on dp=8: fits an 80 GB GPU
  config.train.log_every = 100
  config.optimizer.learning_rate = 4e-3
  config.optimizer.warmup_steps = 2000
  return config
