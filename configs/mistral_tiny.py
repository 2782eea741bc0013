r"""The default job with Mistral's block family: pre-norm serial blocks with RMSNorm, a SwiGLU
MLP, no biases, grouped-query attention and a sliding window on every layer, on the same
dp=2 x pp=2 x tp=2 mesh with interleaved 1F1B. What megajax-export-hf writes as a Hugging
Face MistralForCausalLM directory:

  megajax-train --config=configs/mistral_tiny.py --workdir=/tmp/megajax-mistral
  megajax-sample --workdir=/tmp/megajax-mistral --prompt="hello" --max_new_tokens=64
  megajax-export-hf --workdir=/tmp/megajax-mistral --out=/tmp/megajax-mistral-hf

(MegaScale's parallel block with alternating local and global layers, configs/default.py, has
no Hugging Face architecture; docs/huggingface.md lists what maps to what.)
"""

import os

from megajax.config import CONFIGS_DIR
from megajax.config_checks import read_config_file


def get_config():
  config = read_config_file(os.path.join(CONFIGS_DIR, "default.py"))
  config.model.block = "serial"
  config.model.norm = "rmsnorm"
  config.model.mlp = "swiglu"
  config.model.mlp_dim = 344          # about 8/3 x hidden, as Llama and Mistral size SwiGLU
  config.model.use_bias = False
  config.model.window_pattern = "L"   # every layer local (w = 64): Mistral's sliding_window
  return config
