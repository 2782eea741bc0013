"""FLOPs per token against the MegaScale paper, and the MFU peak table."""

import pytest

from megajax import flops
from megajax.config import load_config
from megajax.model import ModelConfig
from tests.support import REPO


def model_config(name, **overrides):
  config = load_config(f"{REPO}/configs/{name}.py")
  for key, value in overrides.items():
    config.model[key] = value
  return ModelConfig.from_config(config.model)


def test_175b_matches_paper_table2():
  """Table 2: 2166.3 PFLOP/s at 1,984.0k tokens/s -> about 1.092e12 FLOPs per token."""
  paper = 2166.3e15 / 1984.0e3
  ours = flops.training_flops_per_token(model_config("gpt_175b", window=0))
  assert abs(ours / paper - 1) < 0.02, (ours, paper)


def test_megatron_closed_form():
  """72 L h^2 (1 + s/(6h) + V/(12 h L)) per token (Narayanan et al. 2021) for a plain GPT."""
  c = model_config("gpt_175b", window=0)
  L, h, s, V = c.num_layers, c.hidden_dim, c.seq_len, c.vocab_size
  closed_form = 72 * L * h * h * (1 + s / (6 * h) + V / (12 * h * L))
  assert flops.training_flops_per_token(c) == pytest.approx(closed_form, rel=1e-9)


def test_sliding_window_counts_only_the_window():
  full = model_config("gpt_1p3b", window=0)
  local = model_config("gpt_1p3b", window=512)
  half = model_config("gpt_1p3b", window=512, window_pattern="LG")
  h, L = full.hidden_dim, full.num_layers
  per_layer_saving = 3 * 2 * 2 * (full.seq_len - 512) * h
  assert flops.training_flops_per_token(full) - flops.training_flops_per_token(local) == pytest.approx(
      L * per_layer_saving)
  assert flops.training_flops_per_token(full) - flops.training_flops_per_token(half) == pytest.approx(
      L / 2 * per_layer_saving)


def test_grouped_kv_heads_and_block_type():
  mha = model_config("gpt_125m")
  gqa = model_config("gpt_125m", num_kv_heads=4)
  assert flops.training_flops_per_token(gqa) < flops.training_flops_per_token(mha)
  serial = model_config("gpt_125m", block="serial")
  assert flops.training_flops_per_token(serial) == flops.training_flops_per_token(mha)  # same matmuls


def test_swiglu_counts_three_mlp_matmuls_and_norms_none():
  """SwiGLU: wi_gate, wi_up and wo, 3 h f multiply-adds per token and layer against GeLU's
  2 h f; neither the norm nor the two-norm block changes the matmuls."""
  gelu = model_config("gpt_125m")
  swiglu = model_config("gpt_125m", mlp="swiglu")
  assert flops.projection_macs_per_token(swiglu) - flops.projection_macs_per_token(gelu) == (
      gelu.hidden_dim * gelu.mlp_dim)
  per_layer = 3 * 2 * gelu.hidden_dim * gelu.mlp_dim   # forward + backward, 2 FLOPs a multiply-add
  assert flops.training_flops_per_token(swiglu) - flops.training_flops_per_token(gelu) == pytest.approx(
      gelu.num_layers * per_layer)
  neox = model_config("gpt_125m", block="parallel_two_norms", norm="rmsnorm")
  assert flops.training_flops_per_token(neox) == flops.training_flops_per_token(gelu)


def test_peaks_and_mfu():
  assert flops.device_peak_tflops("NVIDIA H200") == 989.0
  assert flops.device_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
  assert flops.device_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
  assert flops.device_peak_tflops("cpu") is None
  assert flops.mfu(494.5, "NVIDIA H200") == pytest.approx(0.5)
  assert flops.mfu(1.0, "cpu") is None
