r"""The default job: a tiny parallel-block GPT with sliding-window attention, on CPU.

  megajax-train --config=configs/default.py --workdir=/tmp/megajax-default

Trains on the synthetic Markov-plus-copy source; the loss falls from ~ln(256) = 5.5 to
well under half of that within the run (about a minute or two on 2 CPU cores).
"""

from megajax.config import default_config


def get_config():
  config = default_config()
  config.model.num_layers = 4
  config.model.hidden_dim = 128
  config.model.num_heads = 4
  config.model.num_kv_heads = 2
  config.model.seq_len = 128
  config.model.window = 64
  config.model.window_pattern = "LG"   # alternate local (w=64) and global layers
  config.train.steps = 300
  config.train.batch_size = 16
  config.train.log_every = 25
  config.optimizer.learning_rate = 1e-2
  config.optimizer.warmup_steps = 30
  return config
