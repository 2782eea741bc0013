"""Where memory.XLA_GPU comes from: the single-stage step's memory terms fitted to XLA:GPU.

XLA:GPU fuses and schedules otherwise than XLA:CPU, so the bytes a GPU holds are measured on
XLA's GPU compiler itself, run on this machine for a described H100 (megajax.parallel.deviceless:
buffer assignment of the real compiled step, no GPU needed):

  GPU_FIT_CASES   the fit set: GPU_BASE (bf16, cuDNN attention, remat dots) with one or two
                  fields changed (shapes, block, MLP, attention, optimizer, dp, tp, microbatches),
                  the shapes under each remat policy.
  GPU_HELD_OUT    configs never fitted on: the MFU suite's 1.3B rows (s = 2048) and 3B rows
                  (s = 8192, remat full), and mid-sized ones unlike the fit set's. The goal:
                  every one within 10% (`within`: of its 80 GB bytes, or, under-predicted, of
                  the device it fits; tests/unit/test_planner.py).
  measure         XLA:GPU's bytes of each, and measure_under_budget's smaller-device compiles
                  (`python -m megajax.launch.bench planner --measure_memory_gpu` writes them to
                  memory_measured_gpu.py; ~25 min).
  fit             non-negative least squares of the weights of memory.single_stage_terms, in relative error.
"""

from __future__ import annotations

import itertools

from megajax.config import apply_overrides, default_config, validate
from megajax.model import ModelConfig
from megajax.parallel import deviceless
from megajax.parallel.planner import calibration, memory
from megajax.parallel.planner.calibration import MemoryCase
from megajax.parallel.planner.fits import plan_of
from megajax.parallel.planner.memory_fit import fit_platform, write_data

TARGET = "h100-80g"
GPU_BASE = {"model.num_layers": 4, "model.hidden_dim": 512, "model.num_heads": 4, "model.seq_len": 512,
            "model.vocab_size": 8192, "model.window": 0, "model.compute_dtype": "bfloat16",
            "model.attention_impl": "cudnn", "model.remat": "dots", "train.batch_size": 4}
_SHAPES = {
    "base": {},
    "h 1024": {"model.hidden_dim": 1024, "model.num_heads": 8},
    "8 layers": {"model.num_layers": 8},
    "seq 1024": {"model.seq_len": 1024},
    "batch 8": {"train.batch_size": 8},
    "vocab 32768": {"model.vocab_size": 32768},
    "parallel block": {"model.block": "parallel"},
}
_LARGE = {"model.hidden_dim": 2048, "model.num_heads": 16, "model.num_layers": 8, "model.seq_len": 2048,
          "model.vocab_size": 32768, "train.batch_size": 8}
_WIDE = {"model.hidden_dim": 1024, "model.num_heads": 8}
_WIDE_SHORT = {**_WIDE, "model.seq_len": 128}
_FP32 = {"model.compute_dtype": "float32", "model.attention_impl": "xla"}   # cuDNN attention takes bf16 only
_OTHERS = {
    "swiglu": {"model.mlp": "swiglu"},
    "xla attention": {"model.attention_impl": "xla"},
    "xla attention, remat none": {"model.attention_impl": "xla", "model.remat": "none"},
    "lamb": {"optimizer.name": "lamb"},
    "dp 2": {"parallel.dp": 2, "train.batch_size": 8},
    "tp 2": {"parallel.tp": 2},
    "dp 2, tp 2": {"parallel.dp": 2, "parallel.tp": 2, "train.batch_size": 8},
    "2 microbatches": {"train.batch_size": 8, "train.microbatches": 2},
    "4 microbatches, dp 2": {"parallel.dp": 2, "train.batch_size": 16, "train.microbatches": 4},
    "tp 4": {"parallel.tp": 4},
    "tp 2, remat none": {"parallel.tp": 2, "model.remat": "none"},
    "tp 2, h 1024": {"parallel.tp": 2, "model.hidden_dim": 1024, "model.num_heads": 8},
    "tp 2, seq 1024": {"parallel.tp": 2, "model.seq_len": 1024},
    "8 layers, 4 microbatches": {"model.num_layers": 8, "train.batch_size": 16, "train.microbatches": 4},
    # Parameters outweighing activations (short sequences): what the param-sized terms are fitted on.
    "h 1024, seq 128": {**_WIDE_SHORT, "train.batch_size": 4},
    "h 1024, seq 128, 2 microbatches": {**_WIDE_SHORT, "train.batch_size": 8, "train.microbatches": 2},
    # The regime the planner is used in (tens of GB a device, where XLA's scheduler works under
    # memory pressure): a 0.4B-parameter slice at s = 2048.
    "h 2048, 8 layers, seq 2048, batch 8": _LARGE,
    "h 2048, 8 layers, seq 2048, batch 8, remat full": {**_LARGE, "model.remat": "full"},
    "h 2048, 8 layers, seq 2048, batch 32, 4 microbatches, lamb": {**_LARGE, "train.batch_size": 32,
                                                                   "train.microbatches": 4, "optimizer.name": "lamb"},
    "h 2048, 8 layers, seq 2048, batch 16, 2 microbatches, dp 2, tp 2": {
        **_LARGE, "train.batch_size": 16, "train.microbatches": 2, "parallel.dp": 2, "parallel.tp": 2},
    "h 1024, seq 128, 3 microbatches": {**_WIDE_SHORT, "train.batch_size": 12, "train.microbatches": 3},
    "h 1024, seq 128, 4 microbatches, lamb": {**_WIDE_SHORT, "train.batch_size": 16, "train.microbatches": 4,
                                              "optimizer.name": "lamb"},
    # Added 2026-12-06 to tell apart terms the cases above have in fixed proportion: tp with 16
    # layers (`deferred` grows with the layers, `ring` does not), tp 8, and fp32 compute (the
    # compute-dtype copy and the first microbatch's gradients against the params term; cuDNN
    # attention takes bf16 only, so XLA's there).
    "tp 2, 16 layers": {"parallel.tp": 2, "model.num_layers": 16},
    "tp 2, 16 layers, remat full": {"parallel.tp": 2, "model.num_layers": 16, "model.remat": "full"},
    "tp 4, 16 layers, h 1024": {"parallel.tp": 4, "model.num_layers": 16, **_WIDE},
    "tp 4, 16 layers, h 1024, remat full": {"parallel.tp": 4, "model.num_layers": 16, **_WIDE, "model.remat": "full"},
    "tp 8, h 1024": {"parallel.tp": 8, **_WIDE},
    "tp 8, h 1024, 8 layers, seq 1024": {"parallel.tp": 8, **_WIDE, "model.num_layers": 8, "model.seq_len": 1024},
    "fp32, xla attention": _FP32,
    "fp32, xla attention, tp 2, h 1024": {**_FP32, "parallel.tp": 2, **_WIDE},
    "fp32, xla attention, h 1024, seq 128, 2 microbatches": {**_FP32, **_WIDE_SHORT, "train.batch_size": 8,
                                                             "train.microbatches": 2},
}
GPU_FIT_CASES = tuple(
    MemoryCase(f"{shape}, remat {remat}", {**GPU_BASE, **overrides, "model.remat": remat})
    for (shape, overrides), remat in itertools.product(_SHAPES.items(), ("none", "dots", "full"))
) + tuple(MemoryCase(name, {**GPU_BASE, **overrides}) for name, overrides in _OTHERS.items())


def _suite_row(size: dict, seq: int, remat: str, row: int) -> dict:
  """The MFU suite's row `row` (launch/bench/train.py's ROWS) as overrides, without the bench."""
  overrides = {**size, "model.seq_len": seq, "model.window": seq // 4 if row >= 2 else 0,
               "model.compute_dtype": "bfloat16", "model.remat": remat,
               "model.block": "parallel" if row >= 1 else "serial",
               "model.attention_impl": "pallas" if row >= 3 else "cudnn",
               "optimizer.name": "lamb" if row >= 4 else "adamw"}
  batch = overrides.pop("batch")
  return {**overrides, "train.batch_size": batch * (4 if row >= 4 else 1), "train.microbatches": 4 if row >= 4 else 1}


def _sized(hidden: int, layers: int, seq: int, fields: dict) -> dict:
  """GPU_BASE at a planner-sized shape (heads of 128, a 32,768-entry vocabulary) with `fields` on top."""
  return {**GPU_BASE, "model.hidden_dim": hidden, "model.num_heads": hidden // 128, "model.num_layers": layers,
          "model.seq_len": seq, "model.vocab_size": 32768, **fields}


_1P3B = {"model.num_layers": 24, "model.hidden_dim": 2048, "model.num_heads": 16, "model.vocab_size": 64000, "batch": 8}
_3B = {"model.num_layers": 32, "model.hidden_dim": 2560, "model.num_heads": 20, "model.vocab_size": 64000, "batch": 4}
GPU_HELD_OUT = (
    MemoryCase("MFU 1.3B s=2048 baseline, remat dots", _suite_row(_1P3B, 2048, "dots", 0)),
    MemoryCase("MFU 1.3B s=2048 + Pallas, remat dots", _suite_row(_1P3B, 2048, "dots", 3)),
    MemoryCase("MFU 1.3B s=2048 + LAMB 4x, remat dots", _suite_row(_1P3B, 2048, "dots", 4)),
    MemoryCase("MFU 3B s=8192 baseline, remat full", _suite_row(_3B, 8192, "full", 0)),
    MemoryCase("MFU 3B s=8192 + LAMB 4x, remat full", _suite_row(_3B, 8192, "full", 4)),
    MemoryCase("h 768, 6 layers, seq 2048, swiglu, remat dots",
               {**GPU_BASE, "model.hidden_dim": 768, "model.num_heads": 6, "model.num_layers": 6,
                "model.seq_len": 2048, "model.mlp": "swiglu"}),
    MemoryCase("dp 4, tp 2, h 1024, parallel block, remat full",
               {**GPU_BASE, "parallel.dp": 4, "parallel.tp": 2, "model.hidden_dim": 1024, "model.num_heads": 8,
                "model.block": "parallel", "model.remat": "full", "train.batch_size": 16}),
    MemoryCase("tp 4, seq 2048, vocab 50304, remat none",
               {**GPU_BASE, "parallel.tp": 4, "model.seq_len": 2048, "model.vocab_size": 50304,
                "model.remat": "none"}),
    # Added, and measured, once the terms and the fit set were frozen (the cases above were looked
    # at while the terms took shape: XLA_GPU's note says how).
    MemoryCase("MFU 1.3B s=2048 + PTB, remat full", _suite_row(_1P3B, 2048, "full", 1)),
    MemoryCase("h 2560, 16 layers, seq 4096, batch 2, swiglu, remat full",
               {**GPU_BASE, "model.hidden_dim": 2560, "model.num_heads": 20, "model.num_layers": 16,
                "model.seq_len": 4096, "model.vocab_size": 50304, "model.mlp": "swiglu", "model.remat": "full",
                "train.batch_size": 2}),
    MemoryCase("dp 2, tp 4, h 2048, 8 layers, seq 2048, 2 microbatches",
               {**_LARGE, **{k: v for k, v in GPU_BASE.items() if k.startswith("model.") and k not in _LARGE},
                "parallel.dp": 2, "parallel.tp": 4, "train.batch_size": 16, "train.microbatches": 2}),
    MemoryCase("h 1536, 12 layers, seq 1024, 4 microbatches, parallel block",
               {**GPU_BASE, "model.hidden_dim": 1536, "model.num_heads": 12, "model.num_layers": 12,
                "model.seq_len": 1024, "model.block": "parallel", "train.batch_size": 16, "train.microbatches": 4}),
) + tuple(
    # A second audit (2026-12-05) of tp with microbatches, where the case above was the only one:
    # the fit set's small shape and its large one with tp 2-4 and 2-4 microbatches under each remat
    # policy, measured once, after the fit, never fitted on.
    MemoryCase(name, {**GPU_BASE, **overrides}) for name, overrides in {
        "tp 4, 2 microbatches": {"parallel.tp": 4, "train.batch_size": 8, "train.microbatches": 2},
        "tp 2, 2 microbatches": {"parallel.tp": 2, "train.batch_size": 8, "train.microbatches": 2},
        "tp 4, 3 microbatches": {"parallel.tp": 4, "train.batch_size": 12, "train.microbatches": 3},
        "tp 4, 4 microbatches, dp 2": {"parallel.dp": 2, "parallel.tp": 4, "train.batch_size": 16,
                                       "train.microbatches": 4},
        "tp 4, 2 microbatches, remat none": {"parallel.tp": 4, "train.batch_size": 8, "train.microbatches": 2,
                                             "model.remat": "none"},
        "tp 4, 2 microbatches, remat full": {"parallel.tp": 4, "train.batch_size": 8, "train.microbatches": 2,
                                             "model.remat": "full"},
        "tp 2, 2 microbatches, remat full": {"parallel.tp": 2, "train.batch_size": 8, "train.microbatches": 2,
                                             "model.remat": "full"},
        "tp 4, h 1024, 2 microbatches": {"parallel.tp": 4, "model.hidden_dim": 1024, "model.num_heads": 8,
                                         "train.batch_size": 8, "train.microbatches": 2},
        "h 1024, seq 128, 2 microbatches, tp 4": {**_WIDE_SHORT, "parallel.tp": 4, "train.batch_size": 8,
                                                  "train.microbatches": 2},
        "h 2048, 8 layers, seq 2048, batch 8, tp 4": {**_LARGE, "parallel.tp": 4},
        "h 2048, 8 layers, seq 2048, batch 16, 2 microbatches, tp 2": {
            **_LARGE, "train.batch_size": 16, "train.microbatches": 2, "parallel.tp": 2},
        "h 2048, 8 layers, seq 2048, batch 16, 2 microbatches, tp 4": {
            **_LARGE, "train.batch_size": 16, "train.microbatches": 2, "parallel.tp": 4},
    }.items()) + (
    # configs/long_context.py:7b, compiled for the context-parallel work (2026-12-06) and entered
    # here unchanged, never fitted on: the first held-out case with cp > 1 (test_planner_cp holds
    # it to the config file).
    MemoryCase("7B shape, s 131072, cp 8, tp 4, window 4096, remat full, Pallas (long_context.py:7b)",
               {"model.vocab_size": 32000, "model.seq_len": 131072, "model.num_layers": 32, "model.hidden_dim": 4096,
                "model.num_heads": 32, "model.num_kv_heads": 8, "model.mlp_dim": 14336, "model.mlp": "swiglu",
                "model.norm": "rmsnorm", "model.block": "serial", "model.use_bias": False, "model.window": 4096,
                "model.window_pattern": "L", "model.remat": "full", "model.attention_impl": "pallas",
                "train.batch_size": 1, "parallel.cp": 8, "parallel.tp": 4}),
    # Compiled once after the `deferred` term was shaped (on the dp 2 tp 4 case's live ranges) and
    # its predictions written down with and without it (2026-12-06): unseen by both.
    MemoryCase("tp 2, h 3072, 6 layers, seq 4096, batch 4, 2 microbatches, remat full",
               _sized(3072, 6, 4096, {"train.batch_size": 4, "train.microbatches": 2, "parallel.tp": 2,
                                      "model.remat": "full"})),
    MemoryCase("tp 8, h 4096, 4 layers, seq 2048, batch 8, remat dots",
               _sized(4096, 4, 2048, {"train.batch_size": 8, "parallel.tp": 8})),
    MemoryCase("cp 4 tp 2, h 2048, 8 layers, seq 32768, window 4096, remat full, Pallas",
               _sized(2048, 8, 32768, {"train.batch_size": 1, "parallel.cp": 4, "parallel.tp": 2, "model.window": 4096,
                                       "model.window_pattern": "L", "model.attention_impl": "pallas",
                                       "model.remat": "full"})),
    MemoryCase("dp 2 tp 4, h 2560, 8 layers, seq 4096, batch 8, 4 microbatches, swiglu",
               _sized(2560, 8, 4096, {"train.batch_size": 8, "train.microbatches": 4, "parallel.dp": 2,
                                      "parallel.tp": 4, "model.mlp": "swiglu"})),
    # Written down with their predictions (2026-12-06) to judge a refit that was then not kept (the
    # first m = 2 accumulator term; docs/planner.md); in view when the `first` term took shape.
    MemoryCase("tp 2, h 2560, 12 layers, seq 2048, batch 8, 2 microbatches, swiglu, remat dots",
               _sized(2560, 12, 2048, {"train.batch_size": 8, "train.microbatches": 2, "parallel.tp": 2,
                                       "model.mlp": "swiglu"})),
    MemoryCase("tp 4, h 4096, 8 layers, seq 4096, batch 4, GQA 8, rmsnorm, remat full",
               _sized(4096, 8, 4096, {"model.num_kv_heads": 8, "model.norm": "rmsnorm", "train.batch_size": 4,
                                      "parallel.tp": 4, "model.remat": "full"})),
    MemoryCase("dp 2 tp 2, h 3072, 8 layers, seq 2048, batch 16, 2 microbatches, lamb, remat full",
               _sized(3072, 8, 2048, {"train.batch_size": 16, "train.microbatches": 2, "parallel.dp": 2,
                                      "parallel.tp": 2, "optimizer.name": "lamb", "model.remat": "full"})),
    MemoryCase("tp 8, h 6144, 4 layers, seq 4096, batch 2, remat dots",
               _sized(6144, 4, 4096, {"train.batch_size": 2, "parallel.tp": 8})),
    # Written down with both weights' predictions (2026-12-06) to judge the refit that added the
    # `first` term and nine fit cases, by the same rule: kept (mean error 13.1% against 13.4%; the
    # written-down candidate, the term at 2 bytes a parameter whatever the dtype, 12.9%).
    MemoryCase("tp 4, h 3072, 12 layers, seq 2048, batch 8, 2 microbatches, remat dots",
               _sized(3072, 12, 2048, {"train.batch_size": 8, "train.microbatches": 2, "parallel.tp": 4})),
    MemoryCase("tp 2, h 2048, 16 layers, seq 4096, batch 2, swiglu, remat full",
               _sized(2048, 16, 4096, {"train.batch_size": 2, "parallel.tp": 2, "model.mlp": "swiglu",
                                       "model.remat": "full"})),
    MemoryCase("dp 2 tp 4, h 4096, 6 layers, seq 2048, batch 16, 4 microbatches, GQA 8, remat dots",
               _sized(4096, 6, 2048, {"model.num_kv_heads": 8, "train.batch_size": 16, "train.microbatches": 4,
                                      "parallel.dp": 2, "parallel.tp": 4})),
    MemoryCase("tp 8, h 5120, 6 layers, seq 2048, batch 8, 2 microbatches, remat full",
               _sized(5120, 6, 2048, {"train.batch_size": 8, "train.microbatches": 2, "parallel.tp": 8,
                                      "model.remat": "full"})),
)

# tp with microbatches off the planner's sizes: what the second audit found (2026-12-05), and its
# cause (2026-12-06).
_SMALL_TP_MICROBATCHES = (
    "under: tp 2-4 with 2-4 microbatches at 0.1-0.4 GiB a device (h 512-1024, seq 128-512). The cause, "
    "from XLA's dump (2026-12-06): the ring's GEMMs there are tiny (256 tokens a chunk), and XLA:GPU "
    "compiles them split-K, the contraction cut 4 ways into a batched dot with an fp32 output [4, tokens, "
    "f/tp] summed afterwards (a reduce over the split in the consumer fusion; 384 such dots in the tp 4 "
    "case's program): those partials are the \"forward ring's outputs at 4x their fp32 size\" seen before, "
    "live at the peak. No program at the planner's sizes has one (the h 2048 tp 4 cases, the dp 2 tp 4 case, "
    "configs/long_context.py:7b: none), so no term counts them. The split is not an autotuning choice a GPU "
    "would make otherwise: XLA:GPU's split-K rewrite (xla/backends/gpu/transforms/splitk_rewriter.cc, "
    "ChooseSplitK, in jax 0.10.2's XLA) picks it by a cost model with Hopper's weights before any autotuning "
    "(reproduced on single dots, 2026-12-06: M 256, K 512-1024, N 512-2048 split 4, N 3072 split 2, N 4096 "
    "none), and it also splits these cases' weight-gradient GEMMs (M x N = a layer's weight shard, K = the "
    "microbatch's 2048 tokens: f32[4, 512, 896] partials at tp 4), which with 2 microbatches XLA holds at "
    "the peak. A term for those partials (its weight fitted) was tried (2026-12-06): without cases of this "
    "regime in the fit set it left these at -12% to -37%; with six (tp 2-4, 2-4 microbatches) it moved the tp "
    "terms off the deferred gradients and put the 7B cp case at -23%. Compiled for a device of 1.1 x the "
    "estimate, these 5 do not fit it (of the 9 cases of this family, the other 4 are within the goal). "
    "Tried and not adopted "
    "(2026-12-05): six more "
    "cases of that regime in the fit set (tp 2-4, 2-4 microbatches, 0.27-0.67 GiB; the held-out ones left "
    "out): the refit held 41 of its 49 cases within 10% (was 43 of 43), left these -20..-39% and put the "
    "1.3B LAMB row at +23%")

# Where the peak is: XLA:GPU's peak for a step sits either where the activations are largest (a
# microbatch's head, before any layer's backward) or late in the backward (the deferred weight
# gradients' operands, the gradients so far); the estimate sums terms of both (2026-12-06).
_WHICH_PEAK = (
    "{}. A sum of terms cannot say which of the two peaks XLA's schedule reaches: the deferred term "
    "(every layer's column-parallel output gradient, weight 1.0 since the refit that gave tp with 16 "
    "layers to the fit set) counts what the late peak holds; a max of two candidate peaks, each "
    "weighed on fit cases whose peak XLA places there, is the way on")

# Held-out cases outside the goal (memory_gpu_fit.within), and why as far as known (the unit
# test holds the list).
GPU_KNOWN_MISSES = {
    "h 2048, 8 layers, seq 2048, batch 16, 2 microbatches, tp 2": _WHICH_PEAK.format(
        "+13.9% (over: the safe side; +7.1% before the refit with the first-microbatch term). XLA's live "
        "ranges put the peak at the second microbatch's head, before any layer's backward: the saved "
        "projections of the 8 layers (2.0 GiB), the fp32 logits and cross-entropy (2.0 GiB), the first "
        "microbatch's bf16 weight gradients of 7 layers; no deferred gradient is live there yet"),
    "tp 2, h 2560, 12 layers, seq 2048, batch 8, 2 microbatches, swiglu, remat dots": _WHICH_PEAK.format(
        "+17.6% (over: the safe side; unseen, +6.5% before the refit); the case above's family (tp 2, 2 "
        "microbatches, remat dots)"),
    "tp 2, h 2048, 16 layers, seq 4096, batch 2, swiglu, remat full": _WHICH_PEAK.format(
        "+26.9% (over: the safe side; unseen, +17.1% with the weights before). XLA's live ranges put the "
        "peak at the head's backward: the layers' weights concatenated in bf16 (1.0 GiB), the 16 layer "
        "inputs remat full keeps, the fp32 cross-entropy; none of the 16 layers' deferred gradients (2.4 "
        "GiB as the term counts them) is live there"),
    "tp 8, h 5120, 6 layers, seq 2048, batch 8, 2 microbatches, remat full":
        "-16.7% (under; unseen, -28.1% with the weights before; compiled for a device of 1.1 x the estimate, "
        "5.41 GiB, XLA:GPU holds 6.10). XLA's live ranges at the peak, late in a backward: 96 ring transfers "
        "in flight (0.47 GiB; at tp 8 the rings have 7 hops each way and XLA starts them all; the ring term "
        "weighs 0), every layer's weights concatenated in bf16 (0.65 GiB), four layers' deferred gradients "
        "and the split-K partials of weight-gradient GEMMs (f32[2, 512, 3200]). tp 8 is the fit set's worst "
        "(-17% at h 1024)",
    **{name: _SMALL_TP_MICROBATCHES for name in (
        "tp 4, 2 microbatches", "tp 4, 3 microbatches", "tp 4, 4 microbatches, dp 2",
        "tp 4, 2 microbatches, remat none", "tp 4, 2 microbatches, remat full")},
}


def case_config(case: MemoryCase):
  config = apply_overrides(default_config(), case.overrides)
  validate(config)
  return config


def predicted_bytes(case: MemoryCase) -> float:
  config = case_config(case)
  return memory.memory(ModelConfig.from_config(config.model), plan_of(config, "gpu"), platform="gpu").total


def measure(cases, log=print, target: str = TARGET) -> dict[str, int]:
  """{case name: XLA:GPU's bytes a device}, each case's step compiled for described H100s."""
  measured = {}
  for case in cases:
    compiled = deviceless.compile_for_gpu(case_config(case), target)
    measured[case.name] = compiled.bytes_per_device()
    log(f"  {case.name}: {measured[case.name] / 2**20:.1f} MiB ({compiled.compile_seconds:.0f} s)")
  return measured


# What a case needs, not only what it holds. XLA:GPU schedules for the device it compiles for:
# on an 80 GB H100 a program of a few GB starts collectives early and defers weight gradients
# because there is room, and one compiled for a smaller device is scheduled (and rematerialized)
# to fit it. A held-out case that XLA's 80 GB compile puts more than 10% above its estimate is
# therefore compiled again for a device of BUDGET x the estimate; if it fits there, the estimate is
# within 10% of the device the case needs (the question a fit decision asks). Found 2026-12-06:
# the tp 4 h 4096 GQA case holds 9.91 GiB at 80 GB and 8.17 GiB on a device of 8.39 GiB.
BUDGET = 1 + calibration.MEMORY_TOLERANCE


def _under_by_more(predicted: float, measured: int) -> bool:
  """The estimate more than 10% under XLA:GPU's 80 GB bytes."""
  return predicted / measured - 1 < -calibration.MEMORY_TOLERANCE


def measure_under_budget(cases, measured: dict[str, int], log=print) -> dict[str, list[int]]:
  """{case name: [device bytes, XLA:GPU's bytes there]} for each of `cases` whose `measured`
  80 GB bytes are more than 10% above its estimate, compiled for a device of BUDGET x that."""
  budgeted = {}
  for case in cases:
    predicted = predicted_bytes(case)
    if _under_by_more(predicted, measured[case.name]):
      target = deviceless.with_memory(TARGET, predicted * BUDGET)
      device = deviceless.described(target).memory_bytes
      budgeted[case.name] = [device, measure([case], log, target)[case.name]]
  return budgeted


def within(name: str, predicted: float, measured: int, budgeted: dict[str, list[int]]) -> bool:
  """The memory goal for one held-out case: XLA:GPU's 80 GB bytes within 10% of the estimate,
  or, where they are above it by more, the program compiled to fit a device of BUDGET x the
  estimate (`budgeted`, measure_under_budget's data, measured at an estimate no lower than now)."""
  if abs(predicted / measured - 1) <= calibration.MEMORY_TOLERANCE:
    return True
  if not _under_by_more(predicted, measured) or name not in budgeted:
    return False
  device, held = budgeted[name]
  return device <= predicted * BUDGET and held <= device


def fit(measured: dict[str, int], cases=GPU_FIT_CASES) -> tuple[dict[str, float], dict[str, float]]:
  """(weights of memory.single_stage_terms, {case: relative error with them}), nnls on the relative errors."""
  return fit_platform(memory.XLA_GPU, cases, measured, case_config, "gpu")


def write_measured(path: str, fit_bytes: dict[str, int], held_out_bytes: dict[str, int],
                   budgeted: dict[str, list[int]]) -> None:
  """memory_measured_gpu.py: the fit set's and the held-out cases' bytes, and the held-out
  cases compiled for a device of BUDGET x their estimate ([device bytes, XLA:GPU's bytes])."""
  write_data(path, "XLA:GPU's bytes per device (a described H100, parallel.deviceless) of memory_gpu_fit's\n"
             "cases: generated by `python -m megajax.launch.bench planner --measure_memory_gpu`; do not edit.",
             FIT=fit_bytes, HELD_OUT=held_out_bytes, BUDGETED=budgeted)
