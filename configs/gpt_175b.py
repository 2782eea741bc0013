r"""GPT 175B, MegaScale Table 1: 96 layers, hidden 12288, 128 heads, TP 8, PP 8.

Sequence 2048, vocabulary 64000 (paper section 6.1); batch 768 as in Table 2 on 256-1024
GPUs (6144 on 3072 and more). The paper runs interleaved 1F1B with 6 virtual stages.

Sliding window 1024: MegaScale runs SWA (Table 3), and its Table 2 MFU column implies
~1.066e12 model FLOPs per token, the windowed count (megajax.flops: 1.063e12 at w = 1024;
1.077e12 with full attention, which the Megatron-LM rows imply). For the Megatron-LM
baseline: --config.model.window=0 --config.model.block=serial --config.optimizer.name=adamw.

Plan it on a cluster (megajax.parallel.planner.cost_model):
  megajax-plan --config=configs/gpt_175b.py --gpus=12288 --hardware=a100-80g --batch=6144
"""

from megajax.config import default_config


def get_config():
  config = default_config()
  config.model.vocab_size = 64000
  config.model.seq_len = 2048
  config.model.num_layers = 96
  config.model.hidden_dim = 12288
  config.model.num_heads = 128
  config.model.window = 1024
  config.model.remat = "full"
  config.parallel.tp = 8
  config.parallel.pp = 8
  config.parallel.virtual_stages = 6
  config.train.steps = 100_000
  config.train.batch_size = 768
  config.train.microbatches = 768
  config.train.log_every = 1
  config.optimizer.learning_rate = 6e-4
  config.optimizer.warmup_steps = 2000
  return config
