r"""GPT 125M (GPT-3 Small shape), MegaScale-style: parallel block, sliding window, LAMB.

On one node of 8 GPUs, data parallel (the batch of 256 x 2048 tokens does not fit one device:
megajax-train refuses a mesh it cannot fit, with the estimate, before anything starts):

  megajax-train --config=configs/gpt_125m.py --workdir=/tmp/gpt125m --config.parallel.dp=8 \
      --config.train.microbatches=4 --config.data.source=tokens --config.data.path=corpus.bin
"""

from megajax.config import default_config


def get_config():
  config = default_config()
  config.model.vocab_size = 64000
  config.model.seq_len = 2048
  config.model.num_layers = 12
  config.model.hidden_dim = 768
  config.model.num_heads = 12
  config.model.window = 1024
  config.train.steps = 100_000
  config.train.batch_size = 256
  config.train.log_every = 100
  config.optimizer.learning_rate = 6e-3
  config.optimizer.warmup_steps = 2000
  return config
