"""Wall-clock timing, the one timer the benchmarks (megajax.launch.bench) share."""

import statistics
import time

import jax


def median_seconds(fn, *args, repeats: int, warmed: bool = False) -> float:
  """Median wall time of fn(*args) over `repeats` runs, after one untimed run (the compile;
  `warmed`: the caller has run it already)."""
  if not warmed:
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)
