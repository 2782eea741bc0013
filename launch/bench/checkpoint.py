"""`python -m megajax.launch.bench checkpoint`: what a checkpoint costs the step loop, measured
side by side in one run on a training state of at least 1 GB (fp32 params + LAMB moments of
a ~170M-parameter GPT, on a dp=2 x tp=4 mesh of this machine's devices).

  save      synchronous save time (the baseline: the step waits for the write) vs the
            asynchronous save's blocking time (device -> host) and total time (to commit)
  restore   direct (every device group reads its own shards) vs broadcast (data-parallel
            replica 0 reads, the other replica receives), seconds and bytes read

Storage is this machine's disk, written and read back at once: the restore may be served
from the page cache, so its times are an upper bound on the speed of real storage.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

from absl import logging
import jax

from megajax.checkpoint import TrainingCheckpointer
from megajax.config import default_config
from megajax.trainer import build_parallel_step


def _bench_config(hidden_dim: int):
  c = default_config()
  c.model.vocab_size, c.model.hidden_dim, c.model.num_layers, c.model.num_heads = 32768, hidden_dim, 8, 16
  c.model.seq_len, c.train.batch_size = 128, 8
  c.parallel.dp, c.parallel.pp, c.parallel.tp = 2, 1, 4
  return c


def _keys(tree):
  leaves, treedef = jax.tree.flatten(tree)
  return jax.tree.unflatten(treedef, list(jax.random.split(jax.random.key(1), len(leaves))))


def checkpoint(hidden_dim: int = 1024) -> None:
  """hidden_dim=1024: the 1.9 GiB state; smaller for a quick run (the tests)."""
  logging.set_verbosity(logging.WARNING)      # Orbax logs every step of every save at INFO
  config = _bench_config(hidden_dim)
  parallel_step = build_parallel_step(config, jax.devices()[:8])
  state = parallel_step.init_state(jax.random.key(0))
  # A trained state's moments are not zeros (which the storage format would compress away).
  random_like = lambda x, key: jax.random.normal(key, x.shape, x.dtype) * 1e-3 if x.ndim else x
  opt_state = jax.jit(lambda tree: jax.tree.map(random_like, tree, _keys(tree)),
                      out_shardings=parallel_step.state_shardings.opt_state)(state.opt_state)
  state = jax.block_until_ready(state._replace(opt_state=opt_state))
  size = sum(x.nbytes for x in jax.tree.leaves(state))
  print(f"\n== checkpoint: a {size / 2**30:.2f} GiB training state (fp32 params + LAMB moments) on "
        f"{jax.devices()[0].platform} mesh dp=2 x tp=4")
  root = tempfile.mkdtemp(prefix="megajax-bench-checkpoint-")
  try:
    times = {}
    for mode in ("sync", "async"):
      config.checkpoint.async_save = mode == "async"
      checkpointer = TrainingCheckpointer(os.path.join(root, mode), config)
      checkpointer.save(0, state, {"next_index": 0})   # warm-up: compiles the device -> host path
      checkpointer.wait()
      start = time.perf_counter()
      blocking = checkpointer.save(1, state, {"next_index": 1})
      checkpointer.wait()
      times[mode] = (blocking, time.perf_counter() - start)
      checkpointer.close()
    (sync, _), (blocking, total) = times["sync"], times["async"]
    print(f"{'save':10} {'step waits':>11} {'to commit':>10}")
    print(f"{'sync':10} {sync:>10.3f}s {sync:>9.3f}s")
    print(f"{'async':10} {blocking:>10.3f}s {total:>9.3f}s")
    print(f"async blocking / sync save: {blocking / sync:.3f}; async total / sync save: {total / sync:.3f}")

    print(f"{'restore':10} {'seconds':>9} {'bytes read':>12}")
    restored = {}
    for mode in ("direct", "broadcast"):
      config.checkpoint.restore_mode = mode
      checkpointer = TrainingCheckpointer(os.path.join(root, "async"), config)
      checkpointer.restore_latest(parallel_step)                # warm-up: compiles the broadcast / reshards
      start = time.perf_counter()
      result = checkpointer.restore_latest(parallel_step)
      jax.block_until_ready(result.state)
      restored[mode] = (time.perf_counter() - start, result.bytes_read)
      checkpointer.close()
      print(f"{mode:10} {restored[mode][0]:>8.3f}s {restored[mode][1] or 0:>12}")
    print(f"broadcast / direct restore time: {restored['broadcast'][0] / restored['direct'][0]:.3f} "
          "(one process: replica 1 receives over the host's memory, not a network)")
  finally:
    shutil.rmtree(root, ignore_errors=True)
