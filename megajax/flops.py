"""Model FLOPs and MFU.

Model FLOPs count the matmuls of one training step (forward + backward = 3x forward, 2 FLOPs
per multiply-add), as Megatron-LM and the MegaScale paper do. Recomputation is not counted
(that would be hardware FLOPs). Embedding lookups are gathers (0 FLOPs); the output logits
are counted. Attention counts, per query, the keys its window covers: min(w, s) with a
window, s without one (the paper's convention, which does not discount the causal triangle).
"""

from __future__ import annotations

from megajax.layers import MLP_FAMILIES
from megajax.model import ModelConfig

# bf16 dense tensor-core peaks, TFLOP/s per device.
PEAK_BF16_TFLOPS = {"a100": 312.0, "h100": 989.0, "h200": 989.0}


def device_peak_tflops(device_kind: str) -> float | None:
  """The bf16 dense peak of a device from `jax.Device.device_kind`, or None when unknown."""
  kind = device_kind.lower()
  for name, peak in PEAK_BF16_TFLOPS.items():
    if name in kind:
      return peak
  return None


def attention_keys_per_query(seq_len: int, window: int | None) -> int:
  return seq_len if window is None else min(window, seq_len)


def projection_macs_per_token(config: ModelConfig) -> int:
  """One layer's weight matmuls per token, in multiply-adds: q, k, v, out, the MLP's input
  projections (GeLU: wi; SwiGLU: wi_gate and wi_up) and its output (wo), each h x mlp_dim."""
  h = config.hidden_dim
  q_dim = config.num_heads * config.head_dim
  kv_dim = config.num_kv_heads * config.head_dim
  mlp_matmuls = len(MLP_FAMILIES[config.mlp].inputs) + 1
  return h * (q_dim + 2 * kv_dim) + q_dim * h + mlp_matmuls * h * config.mlp_dim


def forward_flops_per_token(config: ModelConfig) -> float:
  q_dim = config.num_heads * config.head_dim
  projections = projection_macs_per_token(config)
  total = 0.0
  for layer in range(config.num_layers):
    keys = attention_keys_per_query(config.seq_len, config.layer_window(layer))
    total += projections + 2 * keys * q_dim                                    # + QK^T and PV
  total += config.hidden_dim * config.vocab_size                               # logits
  return 2.0 * total


def training_flops_per_token(config: ModelConfig) -> float:
  return 3.0 * forward_flops_per_token(config)


def mfu(tflops_per_device: float, device_kind: str) -> float | None:
  peak = device_peak_tflops(device_kind)
  return None if peak is None else tflops_per_device / peak
