r"""GPT 175B, MegaScale Table 1: 96 layers, hidden 12288, 128 heads, TP 8, PP 8.

Sequence 2048, vocabulary 64000 (paper section 6.1); batch 768 as in Table 2 on 256-1024
GPUs (6144 on 3072 and more). The paper runs interleaved 1F1B with 6 virtual stages.
"""

from megajax.config import default_config


def get_config():
  config = default_config()
  config.model.vocab_size = 64000
  config.model.seq_len = 2048
  config.model.num_layers = 96
  config.model.hidden_dim = 12288
  config.model.num_heads = 128
  config.model.window = 0          # full attention, as in the paper's Table 2 throughput
  config.model.remat = "full"
  config.parallel.tp = 8
  config.parallel.pp = 8
  config.train.steps = 100_000
  config.train.batch_size = 768
  config.train.microbatches = 768
  config.train.log_every = 1
  config.optimizer.learning_rate = 6e-4
  config.optimizer.warmup_steps = 2000
  return config
