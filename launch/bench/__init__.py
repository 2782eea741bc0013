r"""Benchmarks that print ratios measured side by side in one run: `python -m megajax.launch.bench NAME`.

  pipeline     the 1F1B executor's memory vs GPipe by autodiff, LAMB's bubble, lockstep costs
  attention    our Pallas sliding-window attention vs XLA and cuDNN
  operators    the fused LayerNorm and bias + GeLU kernels vs XLA's own fusion
  checkpoint   synchronous vs asynchronous saves, direct vs broadcast restores
  startup      cold vs warm compilation cache: process start to the first step
  faults       kill -9 soak under megajax-supervise: recoveries and bitwise-equal runs
  observe      the always-on bookkeeping (the goodput clock among it) and a sampled traced step vs a bare step
  planner      the cost model vs the paper's Tables 2 and 3, its refit, memory vs XLA
  peer         megajax's 3D step vs jax.jit + GSPMD (DP, FSDP, Megatron-TP, TP+FSDP) on the same mesh
  fbd          MegaFBD (forward and backward on two device groups) vs the co-located 3D step
  train        the MFU suite: a Table-3 style ablation on one device
  gpu          the GPU check: tests/gpu, the attention table, the MFU rows, megajax-train per attention_impl

One module per benchmark; `__main__` is the dispatcher (the table BENCHMARKS) and holds the
flags; `timing.median_seconds` is the one timer they share.
"""
