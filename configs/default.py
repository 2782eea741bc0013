r"""The default job: a tiny parallel-block GPT with sliding-window attention on the full 3D
mesh dp=2 x pp=2 x tp=2, pipelined with interleaved 1F1B (2 chunks per stage).

  megajax-train --config=configs/default.py --workdir=/tmp/megajax-default

On a machine without 8 GPUs the launcher asks XLA for 8 CPU devices, so the same ZeRO-2
data parallelism, interleaved pipeline, tensor + sequence parallelism and collective matmul
run on a laptop.

Trains on the synthetic Markov-plus-copy source; the loss falls from ~ln(256) = 5.5 to
well under half of that within the run (1 to 3.5 minutes on 2 CPU cores).
"""

from megajax.config import default_config


def get_config():
  config = default_config()
  config.model.num_layers = 4
  config.model.hidden_dim = 128
  config.model.num_heads = 8
  config.model.num_kv_heads = 4        # grouped-query attention, two KV heads per tp rank
  config.model.seq_len = 128
  config.model.window = 64
  config.model.window_pattern = "LG"   # alternate local (w=64) and global layers
  config.train.steps = 200
  config.train.batch_size = 16
  config.train.log_every = 25
  config.optimizer.learning_rate = 1e-2
  config.optimizer.warmup_steps = 20
  config.train.microbatches = 4       # flowing through the pipeline, a multiple of pp
  config.parallel.dp = 2
  config.parallel.pp = 2
  config.parallel.tp = 2
  config.parallel.virtual_stages = 2   # 4 layers = 2 stages x 2 chunks of 1 layer
  config.parallel.schedule = "interleaved_1f1b"
  return config
