"""Wall-clock timing for the benchmarks (megajax.launch.bench*)."""

import statistics
import time


def median_seconds(fn, *args, repeats: int) -> float:
  """Median wall time of fn(*args) over `repeats` runs, after one untimed run (the compile)."""
  import jax  # after the caller has set XLA_FLAGS
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)
