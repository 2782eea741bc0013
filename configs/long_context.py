r"""Long context: rows of 16,384 tokens split over cp = 4 devices, tensor parallel over 2 inside
each (8 devices), a Mistral-style sliding window of 512 on three layers of four and a global
layer of full causal attention.

  megajax-train --config=configs/long_context.py --workdir=/tmp/long

A rank holds two chunks of 2,048 positions (the dual-chunk layout); a local layer receives
the 511 keys and values before each chunk from a neighbour (the halo: the same bytes at any
sequence length), the global layer passes the shards' keys and values round the cp ring.
On CPU the launcher asks XLA for 8 devices; the attention there is XLA's, dense within a
shard (on GPUs set --config.model.attention_impl=pallas for the sliding-window kernel).
"""

from megajax.config import default_config


def get_config():
  config = default_config()
  config.model.num_layers = 4
  config.model.hidden_dim = 128
  config.model.num_heads = 8
  config.model.num_kv_heads = 4
  config.model.seq_len = 16384
  config.model.window = 512
  config.model.window_pattern = "LLLG"
  config.model.remat = "full"
  config.train.steps = 30
  config.train.batch_size = 1
  config.train.log_every = 5
  config.optimizer.warmup_steps = 5
  config.optimizer.learning_rate = 1e-2
  config.parallel.cp = 4
  config.parallel.tp = 2
  return config
