r"""GPT 13B: the paper's convergence model (section 6.2; shape from GPT-3 13B).

The paper compares baseline (serial block, full attention, Adam) against PTB + SWA and
LAMB at 4x batch on this size. For the baseline arm:
  --config.model.block=serial --config.model.window=0 --config.optimizer.name=adamw
"""

from megajax.config import default_config


def get_config():
  config = default_config()
  config.model.vocab_size = 64000
  config.model.seq_len = 2048
  config.model.num_layers = 40
  config.model.hidden_dim = 5120
  config.model.num_heads = 40
  config.model.window = 1024
  config.model.remat = "full"
  config.parallel.tp = 8
  config.parallel.pp = 1
  config.train.steps = 100_000
  config.train.batch_size = 2048   # LAMB at 4x the Adam batch of 512
  config.train.microbatches = 16
  config.train.log_every = 10
  config.optimizer.learning_rate = 2e-3
  config.optimizer.warmup_steps = 2000
  return config
