r"""The GPT shapes of the papers as one config, big_vision style: `--config=configs/gpt.py:<shape>`.

  megajax-train --config=configs/gpt.py:1p3b --workdir=/tmp/gpt1p3b --config.parallel.dp=8
  megajax-plan --config=configs/gpt.py:175b --gpus=12288 --hardware=a100-80g --batch=6144

Every shape is MegaScale-style (parallel block, sliding window 1024 but 530B's full attention,
LAMB), sequence 2048, vocabulary 64000 (MegaScale section 6.1). The shapes (SHAPES):

  125m   GPT-3 Small: 12 layers of 768. One node of 8 GPUs, data parallel (the batch of
         256 x 2048 tokens does not fit one device: megajax-train refuses a mesh it cannot fit,
         with the estimate, before anything starts): --config.parallel.dp=8
         --config.train.microbatches=4 --config.data.source=tokens --config.data.path=corpus.bin
  1p3b   GPT-3 XL: 24 layers of 2048 (16 heads of 128), remat dots, batch 512 in 8 microbatches
         (8 sequences per microbatch and replica on dp=8 fit an 80 GB GPU).
  13b    MegaScale's convergence model (section 6.2; GPT-3 13B's shape), tp 8, remat full,
         LAMB at 4x the Adam batch of 512. The paper's baseline arm:
         --config.model.block=serial --config.model.window=0 --config.optimizer.name=adamw
  175b   MegaScale Table 1: 96 layers of 12288, 128 heads, tp 8, pp 8, interleaved 1F1B with 6
         virtual stages, batch 768 as in Table 2 on 256-1024 GPUs (6144 on 3072 and more). The
         window: MegaScale runs SWA (Table 3), and its Table 2 MFU column implies ~1.066e12
         model FLOPs per token, the windowed count (megajax.flops: 1.063e12 at w = 1024;
         1.077e12 with full attention, which the Megatron-LM rows imply). For the Megatron-LM
         baseline: --config.model.window=0 --config.model.block=serial --config.optimizer.name=adamw
  530b   MegaScale Table 1: 105 layers of 20480, 160 heads, tp 8, pp 35; the paper runs
         interleaved 1F1B with 3 virtual stages and scales the batch with the GPU count (Figure 9).

The old files (configs/gpt_125m.py ... gpt_530b.py) still load: each is this file's shape.
"""

from megajax.config import default_config

# shape -> (layers, hidden, heads, window, remat, tp, pp, virtual stages, batch, microbatches,
#           log_every, learning rate)
SHAPES = {
    "125m": (12, 768, 12, 1024, "none", 1, 1, 1, 256, 1, 100, 6e-3),
    "1p3b": (24, 2048, 16, 1024, "dots", 1, 1, 1, 512, 8, 100, 4e-3),
    "13b": (40, 5120, 40, 1024, "full", 8, 1, 1, 2048, 16, 10, 2e-3),
    "175b": (96, 12288, 128, 1024, "full", 8, 8, 6, 768, 768, 1, 6e-4),
    "530b": (105, 20480, 160, 0, "full", 8, 35, 1, 1120, 1120, 1, 4e-4),
}


def get_config(shape: str = "125m"):
  if shape not in SHAPES:
    raise ValueError(f"no shape {shape!r}; use configs/gpt.py:<shape> with one of {', '.join(SHAPES)}")
  layers, hidden, heads, window, remat, tp, pp, virtual, batch, microbatches, log_every, lr = SHAPES[shape]
  config = default_config()
  m, p, t = config.model, config.parallel, config.train
  m.vocab_size, m.seq_len = 64000, 2048
  m.num_layers, m.hidden_dim, m.num_heads, m.window, m.remat = layers, hidden, heads, window, remat
  p.tp, p.pp, p.virtual_stages = tp, pp, virtual
  t.steps, t.batch_size, t.microbatches, t.log_every = 100_000, batch, microbatches, log_every
  config.optimizer.learning_rate, config.optimizer.warmup_steps = lr, 2000
  return config
