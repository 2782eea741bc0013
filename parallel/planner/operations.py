"""One transformer layer's operations on one GPU for one microbatch, timed one by one.

Each operation's time comes from its own work through hardware.py's measured models: the
GEMMs by their shapes (forward, and the backward's input and weight gradients), attention as
FlashAttention-2 or as Megatron-LM's unfused kernels (two batched GEMMs around a fused
scale-mask-softmax and a dropout, which stream the [s, s] scores through HBM), the memory-bound
kernels by the bytes they move, and the tensor-parallel collectives by their bytes. Nothing
here is fitted but what `k` (a cost_model.Calibration) holds: the share of the GEMM rate a run
sustains and the HBM fraction streaming kernels reach.

The byte counts of the memory-bound kernels are counted from the kernels Megatron-LM runs
(apex's fused LayerNorm, fused bias-GeLU, bias-dropout-add, fused scale-mask-softmax), per
element of the tensor they stream, in bf16 (2 bytes) with a 1-byte dropout mask:
"""

from __future__ import annotations

import dataclasses

from megajax import flops
from megajax.layers import BLOCK_FAMILIES, MLP_FAMILIES
from megajax.model import ModelConfig
from megajax.parallel.planner import hardware
from megajax.parallel.planner.hardware import Hardware

# Bytes per element, (forward, backward):
NORM_BYTES = (4, 6)          # LayerNorm: read x, write y | read x and dy, write dx
BRANCH_BYTES = (7, 5)        # bias-dropout-add of a branch into the residual: read branch and
                             # residual, write the sum and the mask | read dy and the mask, write dx
SCORE_BYTES = (9, 11)        # fused scale-mask-softmax (read, write) and dropout (read, write the
                             # probabilities and the mask) | dropout and softmax backward


@dataclasses.dataclass(frozen=True)
class LayerTimes:
  """Seconds of one layer's operations for one microbatch on one GPU."""
  gemm_forward: float
  gemm_input_grad: float       # dX of every linear
  gemm_weight_grad: float      # dW of every linear
  attention_forward: float
  attention_backward: float    # FlashAttention's backward reruns its forward inside (counted here)
  elementwise_forward: float
  elementwise_backward: float

  @property
  def forward(self) -> float:
    return self.gemm_forward + self.attention_forward + self.elementwise_forward


def norms_per_layer(c: ModelConfig) -> int:
  return len(BLOCK_FAMILIES[c.block].norms)


def tp_pairs_per_layer(c: ModelConfig) -> int:
  """The tp all-gather / reduce-scatter pairs of a block's forward: one per column / row
  matmul group (the serial block's halves; both parallel blocks fuse theirs)."""
  return BLOCK_FAMILIES[c.block].tp_pairs


def linear_shapes(c: ModelConfig, tp: int) -> list[tuple[int, int]]:
  """(in, out) of each linear of a layer on one tp rank. The parallel blocks run their two
  column-parallel linears as one GEMM (q, k, v and the MLP's inputs) and their two
  row-parallel ones as one (attention out and the MLP's output)."""
  h, q, kv, f = c.hidden_dim, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.mlp_dim
  mlp_in = len(MLP_FAMILIES[c.mlp].inputs) * f
  if c.block != "serial":
    return [(h, (q + 2 * kv + mlp_in) // tp), ((q + f) // tp, h)]
  return [(h, (q + 2 * kv) // tp), (q // tp, h), (h, mlp_in // tp), (f // tp, h)]


def gemm_times(shapes, tokens: int, hw: Hardware, k, itemsize: int) -> tuple[float, float, float]:
  """(forward, input-gradient, weight-gradient) seconds of linears [(in, out)] over `tokens` rows."""
  gemm = lambda m, n, depth: hardware.gemm_seconds(m, n, depth, hw, k.hbm_efficiency, itemsize=itemsize,
                                                   sustained=k.gemm_sustained)
  forward = sum(gemm(tokens, out, inner) for inner, out in shapes)
  input_grad = sum(gemm(tokens, inner, out) for inner, out in shapes)
  weight_grad = sum(gemm(inner, out, tokens) for inner, out in shapes)
  return forward, input_grad, weight_grad


def attention_times(c: ModelConfig, micro_batch: int, tp: int, window: int | None, fused: bool, hw: Hardware,
                    k) -> tuple[float, float]:
  """(forward, backward) seconds of one layer's attention core (QK^T, softmax, dropout, PV)."""
  heads = micro_batch * c.num_heads // tp
  s, d, cb = c.seq_len, c.head_dim, c.compute_dtype.itemsize
  # Keys per query a kernel computes: the unfused kernels the whole [s, s] square (or, with a
  # window, its band); FlashAttention skips the blocks the causal mask empties.
  keys = flops.attention_keys_per_query(s, window)
  if fused:   # FlashAttention-2: FLOPs 4 s keys d per head forward, backward 2.5x (its convention)
    keys = keys / 2 if window is None else keys
    forward = 4 * heads * s * keys * d / (hw.peak_tflops * 1e12 * hardware.FLASH_ATTENTION_FRACTION)
    return forward, 2.5 * forward
  scores = heads * s * keys
  gemm = lambda m, n, depth: hardware.gemm_seconds(m, n, depth, hw, k.hbm_efficiency, batch=heads, itemsize=cb,
                                                   sustained=k.gemm_sustained)
  stream = lambda nbytes: hardware.streaming_seconds(nbytes, hw, k.hbm_efficiency)
  forward = gemm(s, keys, d) + gemm(s, d, keys) + stream(scores * SCORE_BYTES[0])
  backward = (gemm(s, keys, d) + gemm(keys, d, s)       # dP = dO V^T, dV = P^T dO
              + gemm(s, d, keys) + gemm(keys, d, s)     # dQ = dS K, dK = dS^T Q
              + stream(scores * SCORE_BYTES[1]))
  return forward, backward


def elementwise_times(c: ModelConfig, tokens: int, tp: int, norm_tokens: float, hw: Hardware,
                      k) -> tuple[float, float]:
  """(forward, backward) seconds of a layer's norms, residual branches and MLP activation:
  the norms and branches over `norm_tokens` rows of [h] (a sequence shard with sequence
  parallelism), the activation over the MLP's tp shard."""
  norms = norms_per_layer(c)
  per_row = c.hidden_dim * c.compute_dtype.itemsize / 2           # the byte counts are bf16's
  activation = MLP_FAMILIES[c.mlp].activation_bytes
  times = []
  for i in (0, 1):
    nbytes = norm_tokens * per_row * (norms * NORM_BYTES[i] + 2 * BRANCH_BYTES[i])
    nbytes += tokens * c.mlp_dim / tp * c.compute_dtype.itemsize / 2 * activation[i]
    times.append(hardware.streaming_seconds(nbytes, hw, k.hbm_efficiency))
  return times[0], times[1]


def layer_times(c: ModelConfig, micro_batch: int, tp: int, fused_attention: bool, sequence_parallel: bool,
                hw: Hardware, k, window: int | None) -> LayerTimes:
  """One layer (attention over `window` keys, None: causal over the sequence)."""
  tokens = micro_batch * c.seq_len
  shapes = linear_shapes(c, tp)
  forward, input_grad, weight_grad = gemm_times(shapes, tokens, hw, k, c.compute_dtype.itemsize)
  attention = attention_times(c, micro_batch, tp, window, fused_attention, hw, k)
  # A block's norms on the gathered sequence (the two-norm block's, megajax) or on a shard.
  norm_tokens = tokens / tp if sequence_parallel and not BLOCK_FAMILIES[c.block].norms_on_gathered else tokens
  elementwise = elementwise_times(c, tokens, tp, norm_tokens, hw, k)
  return LayerTimes(forward, input_grad, weight_grad, *attention, *elementwise)


def head_times(c: ModelConfig, micro_batch: int, tp: int, hw: Hardware, k) -> tuple[float, float]:
  """(forward, backward) seconds of the output layer's GEMM (vocabulary split over tp)."""
  forward, input_grad, weight_grad = gemm_times([(c.hidden_dim, c.vocab_size // tp)], micro_batch * c.seq_len, hw,
                                                k, c.compute_dtype.itemsize)
  return forward, input_grad + weight_grad
