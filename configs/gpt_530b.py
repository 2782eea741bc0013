r"""GPT 530B, MegaScale Table 1: 105 layers, hidden 20480, 160 heads, TP 8, PP 35.

Sequence 2048, vocabulary 64000 (paper section 6.1); the paper runs interleaved 1F1B with
3 virtual stages and scales the batch with the GPU count (Figure 9).
"""

from megajax.config import default_config


def get_config():
  config = default_config()
  config.model.vocab_size = 64000
  config.model.seq_len = 2048
  config.model.num_layers = 105
  config.model.hidden_dim = 20480
  config.model.num_heads = 160
  config.model.window = 0
  config.model.remat = "full"
  config.parallel.tp = 8
  config.parallel.pp = 35
  config.train.steps = 100_000
  config.train.batch_size = 1120
  config.train.microbatches = 1120
  config.train.log_every = 1
  config.optimizer.learning_rate = 4e-4
  config.optimizer.warmup_steps = 2000
  return config
