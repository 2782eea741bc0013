"""`python -m megajax.launch.bench checkpoint`: what a checkpoint costs the step loop, measured
side by side in one run on a training state of at least 1 GB (fp32 params + LAMB moments of
a ~170M-parameter GPT, on a dp=2 x tp=4 mesh of this machine's devices; one GPU: 1x1x1).

  save      synchronous save time (the baseline: the step waits for the write) vs the
            asynchronous save's blocking time (device -> host) and total time (to commit)
  checksums the asynchronous save with array checksums (the default) vs without, alternated
            over --checkpoint_repeats saves each (medians): what the step waits, the time to
            commit; the fingerprint's own time on the devices (overlapped with the write) and
            the time its dispatch takes (the part of it the step waits for)
  restore   direct (every device group reads its own shards) vs broadcast (data-parallel
            replica 0 reads, the other replica receives), seconds and bytes read

Storage is this machine's disk, written and read back at once: the restore may be served
from the page cache, so its times are an upper bound on the speed of real storage.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time

from absl import logging
import jax

from megajax.checkpoint import TrainingCheckpointer
from megajax.checkpoint.integrity import checksums, fingerprints
from megajax.config import default_config
from megajax.launch.bench.timing import median_seconds
from megajax.trainer import build_parallel_step


def _bench_config(hidden_dim: int, devices: int):
  """dp=2 x tp=4 on 8 devices or more (this machine's CPU devices), else dp over what there is
  (one GPU: 1x1x1, where the restore has no replica to broadcast to)."""
  c = default_config()
  c.model.vocab_size, c.model.hidden_dim, c.model.num_layers, c.model.num_heads = 32768, hidden_dim, 8, 16
  c.model.seq_len, c.train.batch_size = 128, 8
  c.parallel.dp, c.parallel.pp, c.parallel.tp = (2, 1, 4) if devices >= 8 else (min(devices, 2), 1, 1)
  return c


def _keys(tree):
  leaves, treedef = jax.tree.flatten(tree)
  return jax.tree.unflatten(treedef, list(jax.random.split(jax.random.key(1), len(leaves))))


def _checksums_side_by_side(config, state, root: str, repeats: int) -> None:
  """Async saves with and without checksums, alternated (the machine's drift hits both alike)."""
  checkpointers = {on: TrainingCheckpointer(os.path.join(root, f"checksums_{on}"), config, checksums=on)
                   for on in (True, False)}
  times = {True: [], False: []}
  for step in range(repeats + 1):         # step 0: warm-up (compiles the fingerprint and the copy)
    for on, checkpointer in checkpointers.items():
      start = time.perf_counter()
      blocking = checkpointer.save(step, state, {"next_index": step})
      checkpointer.wait()
      if step:
        times[on].append((blocking, time.perf_counter() - start))
  for checkpointer in checkpointers.values():
    checkpointer.close()
  fingerprint = median_seconds(fingerprints, state, repeats=repeats)
  dispatches = []
  for _ in range(repeats):
    start = time.perf_counter()
    fingerprinted = fingerprints(state)
    dispatches.append(time.perf_counter() - start)
    jax.block_until_ready(fingerprinted)
  median = {on: [statistics.median(t[i] for t in times[on]) for i in (0, 1)] for on in times}
  print(f"{'checksums':10} {'step waits':>11} {'to commit':>10}   (async, median of {repeats})")
  for on in (False, True):
    print(f"{'on' if on else 'off':10} {median[on][0]:>10.3f}s {median[on][1]:>9.3f}s")
  print(f"checksums on / off: step waits {median[True][0] / median[False][0]:.3f}, to commit "
        f"{median[True][1] / median[False][1]:.3f}; the fingerprint alone {fingerprint:.3f} s on the devices "
        f"({len(checksums(fingerprints(state)))} arrays), overlapped with the write; its dispatch "
        f"{statistics.median(dispatches):.3f} s")


def checkpoint(hidden_dim: int = 1024, repeats: int = 5) -> None:
  """hidden_dim=1024: the 1.9 GiB state; smaller for a quick run (the tests)."""
  logging.set_verbosity(logging.WARNING)      # Orbax logs every step of every save at INFO
  config = _bench_config(hidden_dim, len(jax.devices()))
  dp, tp = config.parallel.dp, config.parallel.tp
  parallel_step = build_parallel_step(config, jax.devices()[:dp * tp])
  state = parallel_step.init_state(jax.random.key(0))
  # A trained state's moments are not zeros (which the storage format would compress away).
  random_like = lambda x, key: jax.random.normal(key, x.shape, x.dtype) * 1e-3 if x.ndim else x
  opt_state = jax.jit(lambda tree: jax.tree.map(random_like, tree, _keys(tree)),
                      out_shardings=parallel_step.state_shardings.opt_state)(state.opt_state)
  state = jax.block_until_ready(state._replace(opt_state=opt_state))
  size = sum(x.nbytes for x in jax.tree.leaves(state))
  print(f"\n== checkpoint: a {size / 2**30:.2f} GiB training state (fp32 params + LAMB moments) on "
        f"{jax.devices()[0].platform} mesh dp={dp} x tp={tp}")
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
    _checksums_side_by_side(config, state, root, repeats)

    print(f"{'restore':10} {'seconds':>9} {'bytes read':>12}")
    restored = {}
    for mode in ("direct", "broadcast") if dp > 1 else ("direct",):
      config.checkpoint.restore_mode = mode
      checkpointer = TrainingCheckpointer(os.path.join(root, "async"), config)
      checkpointer.restore_latest(parallel_step)                # warm-up: compiles the broadcast / reshards
      start = time.perf_counter()
      result = checkpointer.restore_latest(parallel_step)
      jax.block_until_ready(result.state)
      restored[mode] = (time.perf_counter() - start, result.bytes_read)
      checkpointer.close()
      print(f"{mode:10} {restored[mode][0]:>8.3f}s {restored[mode][1] or 0:>12}")
    if dp > 1:
      print(f"broadcast / direct restore time: {restored['broadcast'][0] / restored['direct'][0]:.3f} "
            "(one process: replica 1 receives over the host's memory, not a network)")
    else:
      print("broadcast restore: not run (one data-parallel replica: nobody to broadcast to)")
  finally:
    shutil.rmtree(root, ignore_errors=True)
