"""Wall-clock timing, the one timer the benchmarks (megajax.launch.bench) share."""

import gc
import statistics
import time

import jax


def is_out_of_memory(error: Exception) -> bool:
  """XLA's allocation failure (RESOURCE_EXHAUSTED; its exception type moves between jax versions)."""
  return "RESOURCE_EXHAUSTED" in str(error) or "out of memory" in str(error).lower()


def median_seconds(fn, *args, repeats: int, warmed: bool = False) -> float:
  """Median wall time of fn(*args) over `repeats` runs, after one untimed run (the compile;
  `warmed`: the caller has run it already)."""
  if not warmed:
    jax.block_until_ready(fn(*args))
  gc.collect()   # what died in cycles so far, before the timed runs (the benchmarks run without automatic collections)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)
