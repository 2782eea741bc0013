"""`python -m megajax.launch.bench attention`: our Pallas sliding-window kernels against the
attention a user would pick (cuDNN through jax.nn.dot_product_attention, and XLA), timed
side by side in one run.

Per (s, w, impl): forward and forward+backward milliseconds (median of --repeats), TFLOP/s
counting only in-window FLOPs (forward 4·d per visible (query, key) pair and head, the
backward 2.5x the forward: FlashAttention-2's convention), and each row's fwd+bwd time over
pallas'. Then time(32k) / time(8k) per impl at fixed w (linear in s: 4; the goal <= 4.4).

On a GPU: s in {2k, 8k, 32k} at w = 1k, head dim 128, bf16, 16 heads, 32 sequences (2^20
tokens: one batch for every s, so the ratios show the growth in s). Rows: pallas (on Hopper
the Mosaic GPU forward + the Triton backward), hopper-bwd (Hopper: the Mosaic GPU forward and
the opt-in Mosaic GPU backward), fwd-inplace / fwd-regP / fwd-kT / fwd-sched / fwd-all4 (Hopper:
the forward's opt-in speed-ups, attention_hopper.ForwardOptions, one at a time and together),
triton (the portable kernels both ways),
cudnn (jax.nn.dot_product_attention, local window), xla. A row whose memory would not fit
the device (xla materializes fp32 scores b·h·s², about 137 GB at s=8k) is skipped with the
bytes it would need; one that runs out of memory anyway is skipped with XLA's message.
On a CPU: a reduced grid with the kernels in interpret mode, which times the interpreter.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import psutil

from megajax.launch.bench.timing import is_out_of_memory, median_seconds
from megajax.layers import cudnn_attention, xla_attention
from megajax.layers.kernels.attention import default_backend, pallas_attention
from megajax.layers.kernels.attention_hopper import ForwardOptions

GB = 1e9
FORWARD_ROWS = {"fwd-inplace": ForwardOptions(accumulate_in_place=True), "fwd-regP": ForwardOptions(p_in_registers=True),
                "fwd-kT": ForwardOptions(transpose_k_in_kernel=True), "fwd-sched": ForwardOptions(schedule_barrier=True),
                "fwd-all4": ForwardOptions(True, True, True, True)}
# fp32 [b, h, s, s] tensors XLA's attention keeps live: forward scores + probabilities;
# forward+backward adds the saved probabilities' cotangent and the scores' (counted, not
# measured: a bound the rows are skipped by, with a margin for the allocator).
XLA_SCORE_COPIES = {"fwd": 2, "fwd+bwd": 4}
FIT_MARGIN = 0.9


def visible_pairs(s: int, window: int | None) -> int:
  """Query-key pairs inside the causal window band."""
  if window is None or window >= s:
    return s * (s + 1) // 2
  return window * (window + 1) // 2 + (s - window) * window


def grid(on_gpu: bool) -> dict:
  if on_gpu:
    return dict(lengths=(2048, 8192, 32768), windows=(1024,), head_dim=128, dtype=jnp.bfloat16,
                tokens=2 ** 20, heads=16, kv_heads=16)
  return dict(lengths=(128, 512), windows=(32, None), head_dim=64, dtype=jnp.float32, tokens=1024, heads=2,
              kv_heads=1)


def impls(on_gpu: bool, backend: str) -> dict:
  rows = {"pallas": pallas_attention}
  if backend == "mosaic":    # Hopper: the opt-in Hopper backward, and the portable kernels both ways
    rows["hopper-bwd"] = functools.partial(pallas_attention, backward="mosaic")
    for name, options in FORWARD_ROWS.items():    # each opt-in forward speed-up, then all four
      rows[name] = functools.partial(pallas_attention, hopper_forward=options)
    rows["triton"] = functools.partial(pallas_attention, backend="triton")
  if on_gpu:
    rows["cudnn"] = cudnn_attention
  rows["xla"] = xla_attention
  return rows


def device_bytes() -> float:
  """What one device may allocate: XLA's bytes_limit on a GPU, the machine's memory on a CPU."""
  stats = jax.devices()[0].memory_stats() or {}
  return float(stats.get("bytes_limit") or psutil.virtual_memory().total)


def bytes_needed(impl: str, pass_: str, batch: int, s: int, g: dict) -> float:
  """The row's peak bytes, roughly: the inputs, outputs and gradients ([b, s, h, d] each),
  plus XLA's fp32 score copies for the xla row (the others stream the scores)."""
  itemsize = jnp.dtype(g["dtype"]).itemsize
  activations = batch * s * g["heads"] * g["head_dim"] * itemsize * (4 if pass_ == "fwd" else 9)
  if impl != "xla":
    return activations
  return activations + XLA_SCORE_COPIES[pass_] * batch * g["heads"] * s * s * 4


def _time_or_skip(fn, q, k, v, repeats):
  """(milliseconds, None) or (None, why): a row that runs out of memory is skipped, not fatal."""
  try:
    return median_seconds(fn, q, k, v, repeats=repeats) * 1e3, None
  except Exception as e:
    if not is_out_of_memory(e):
      raise
    return None, "out of memory: " + str(e).splitlines()[0][:120]


# `bench gpu`'s attention part (quick): our kernels against cuDNN at the lengths that show the
# window's gain, inside the part's time (the whole grid: `bench attention`).
QUICK_LENGTHS, QUICK_IMPLS = (2048, 8192), ("pallas", "cudnn")


def measure(repeats: int, quick: bool = False) -> dict:
  """Every row of the grid: {'device', 'grid', 'rows': [...], 'growth': {...}}; `quick`: on a
  GPU the QUICK_LENGTHS x QUICK_IMPLS rows alone."""
  on_gpu = jax.devices()[0].platform == "gpu"
  g = grid(on_gpu)
  if quick and on_gpu:
    g["lengths"] = QUICK_LENGTHS
  backend = default_backend(g["dtype"], g["head_dim"])
  limit = device_bytes() * FIT_MARGIN
  batch = max(1, g["tokens"] // max(g["lengths"]))
  rows = []
  for s in g["lengths"]:
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (batch, s, g["heads"], g["head_dim"]), g["dtype"])
    k = jax.random.normal(keys[1], (batch, s, g["kv_heads"], g["head_dim"]), g["dtype"])
    v = jax.random.normal(keys[2], (batch, s, g["kv_heads"], g["head_dim"]), g["dtype"])
    cotangent = jax.random.normal(keys[3], q.shape, g["dtype"])
    for window in g["windows"]:
      flops = 4 * g["head_dim"] * g["heads"] * batch * visible_pairs(s, window)
      for name, fn in impls(on_gpu, backend).items():
        if quick and on_gpu and name not in QUICK_IMPLS:
          continue
        forward = jax.jit(lambda q, k, v, fn=fn, window=window: fn(q, k, v, window))
        both = jax.jit(jax.grad(lambda q, k, v, fn=fn, window=window: jnp.sum(
            (fn(q, k, v, window) * cotangent).astype(jnp.float32)), argnums=(0, 1, 2)))
        row = {"s": s, "window": window, "impl": name, "batch": batch}
        for pass_, program, pass_flops in (("fwd", forward, flops), ("fwd+bwd", both, 3.5 * flops)):
          need = bytes_needed(name, pass_, batch, s, g)
          if need > limit:
            ms, why = None, f"needs ~{need / GB:.0f} GB > {limit / GB:.0f} GB of the device"
          else:
            ms, why = _time_or_skip(program, q, k, v, repeats)
          row[f"{pass_} ms"] = ms
          row[f"{pass_} TFLOP/s"] = None if ms is None else pass_flops / (ms * 1e-3) / 1e12
          if why:
            row[f"{pass_} skipped"] = why
        rows.append(row)
        # Each row as it ends: a run cut short by its time limit still shows what it measured.
        print(f"  s={s} w={window} {name}: fwd {_cell(row['fwd ms'], '.3f')} ms, "
              f"fwd+bwd {_cell(row['fwd+bwd ms'], '.3f')} ms", flush=True)
  return {"device": jax.devices()[0].device_kind, "platform": jax.devices()[0].platform, "backend": backend,
          "grid": {k: (jnp.dtype(v).name if k == "dtype" else v) for k, v in g.items()},
          "rows": rows, "growth": growth(rows, g)}


def _ms(rows, s, window, impl, pass_="fwd+bwd"):
  for row in rows:
    if (row["s"], row["window"], row["impl"]) == (s, window, impl):
      return row[f"{pass_} ms"]
  return None


def growth(rows: list[dict], g: dict) -> dict:
  """time(largest s) / time(largest s / 4) per impl and window, where both ran."""
  large, small = g["lengths"][-1], g["lengths"][-1] // 4
  out = {}
  if small in g["lengths"]:
    for window in g["windows"]:
      for impl in dict.fromkeys(row["impl"] for row in rows):
        t_large, t_small = _ms(rows, large, window, impl), _ms(rows, small, window, impl)
        if t_large and t_small:
          out[f"{impl} fwd+bwd time(s={large}) / time(s={small}) at w={window}"] = t_large / t_small
  return out


def _cell(value, fmt):
  return "skipped" if value is None else format(value, fmt)


def table(result: dict) -> list[str]:
  lines = [f"{'s':>6} {'w':>6} {'impl':>10} {'fwd ms':>10} {'fwd+bwd ms':>11} {'fwd TF/s':>9} "
           f"{'f+b TF/s':>9} {'vs pallas':>10}"]
  skipped = []
  for row in result["rows"]:
    base = _ms(result["rows"], row["s"], row["window"], "pallas")
    both = row["fwd+bwd ms"]
    ratio = f"{both / base:.2f}x" if both and base else "-"
    lines.append(f"{row['s']:>6} {str(row['window']):>6} {row['impl']:>10} {_cell(row['fwd ms'], '.3f'):>10} "
                 f"{_cell(both, '.3f'):>11} {_cell(row['fwd TFLOP/s'], '.1f'):>9} "
                 f"{_cell(row['fwd+bwd TFLOP/s'], '.1f'):>9} {ratio:>10}")
    for pass_ in ("fwd", "fwd+bwd"):
      if f"{pass_} skipped" in row:
        skipped.append(f"  skipped s={row['s']} w={row['window']} {row['impl']} {pass_}: {row[f'{pass_} skipped']}")
  return lines + skipped + [f"{name}: {value:.2f}" for name, value in result["growth"].items()]


def attention(repeats: int, quick: bool = False) -> dict:
  on_gpu = jax.devices()[0].platform == "gpu"
  g = grid(on_gpu)
  print(f"\n== attention on {jax.devices()[0].device_kind} ({jax.devices()[0].platform}), head dim "
        f"{g['head_dim']}, {jnp.dtype(g['dtype']).name}, {g['heads']} heads / {g['kv_heads']} KV heads; "
        f"pallas = backend {default_backend(g['dtype'], g['head_dim'])!r}; median of {repeats}")
  if not on_gpu:
    print("CPU: reduced grid, Pallas kernels in interpret mode (times the interpreter: no GPU figure); "
          "cudnn needs a GPU")
  result = measure(repeats, quick)
  print("\n".join(table(result)))
  return result
