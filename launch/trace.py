r"""megajax-trace: one traced step of every process -> a rank-aligned trace, heat map, stragglers.

  megajax-train ... --workdir=W --config.observe.trace_every=50
  megajax-trace W                    # the latest traced step (or --steps=N,M,...: together)

writes W/traces/analysis/:
  merged_trace.json.gz   Chrome / Perfetto trace, one track per rank DP{d}-PP{p}-TP{t},
                         every process on the reference process's clock
  heatmap.csv, heatmap.png   per-rank forward / backward / communication milliseconds,
                         laid out on the (dp, pp, tp) grid
  stragglers.json        root-cause ranks with their evidence, and their victims
"""

from __future__ import annotations

import csv
import gzip
import json
import os
import sys

from absl import app
import numpy as np
from absl import flags

from megajax.launch import cli
from megajax.launch import trace_analysis as analysis
from megajax.tracing import TRACES

_STEPS = flags.DEFINE_list("steps", [], "The traced steps to analyse together, e.g. 400,500,600 (default: the "
                           "latest); a straggler must be slow in each.")
_REFERENCE = flags.DEFINE_integer("reference_process", 0, "The process whose clock the others are aligned to.")
_THRESHOLD = flags.DEFINE_float("threshold", 1.5, "A straggler's compute time over its groups' median, at least.")

PROGRAM = "megajax-trace"
HEATMAP_PANELS = ("forward_ms", "backward_ms", "communication_ms")


def plot_heat_map(rows: list[dict], path: str) -> None:
  """One panel per quantity; rows of each panel are (dp, pp) pairs, columns tp ranks."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np
  dp, pp, tp = (max(r[k] for r in rows) + 1 for k in ("dp", "pp", "tp"))
  fig, axes = plt.subplots(1, len(HEATMAP_PANELS), figsize=(4 + 1.2 * tp * len(HEATMAP_PANELS), 1.5 + 0.5 * dp * pp),
                           squeeze=False)
  for ax, quantity in zip(axes[0], HEATMAP_PANELS):
    grid = np.zeros((dp * pp, tp))
    for r in rows:
      grid[r["dp"] * pp + r["pp"], r["tp"]] = r[quantity]
    image = ax.imshow(grid, cmap="magma", aspect="auto")
    for (i, j), value in np.ndenumerate(grid):
      ax.text(j, i, f"{value:.1f}", ha="center", va="center", color="white" if value < grid.max() / 2 else "black",
              fontsize=8)
    ax.set_title(quantity.replace("_ms", " (ms)"))
    ax.set_xticks(range(tp), [f"TP{t}" for t in range(tp)])
    ax.set_yticks(range(dp * pp), [f"DP{d}-PP{p}" for d in range(dp) for p in range(pp)])
    fig.colorbar(image, ax=ax, fraction=0.046)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _analyse_step(step_dir: str, reference: int, threshold: float):
  ranks = analysis.load_ranks(step_dir)
  shifts = analysis.align(ranks, reference)
  rows = analysis.heat_map(ranks)
  return ranks, shifts, rows, analysis.find_stragglers(ranks, threshold, rows)


def analyse(workdir: str, steps: list[int] | None = None, reference: int = 0, threshold: float = 1.5) -> dict:
  """Reads WORKDIR/traces/step_<n> for each of `steps` (None: the latest traced step), writes
  WORKDIR/traces/analysis/ (the merged trace of the last of them); returns a summary (clock
  shifts, collective end spread, stragglers).

  Over several steps the heat map is their mean, and a straggler must be flagged in every one
  of them: a persistent straggler is, while a rank that one step's noise slowed is not.
  """
  traces = os.path.join(workdir, TRACES)
  step_dirs = ([os.path.join(traces, f"step_{n}") for n in steps] if steps
               else [analysis.latest_step_dir(traces)])
  per_step = [_analyse_step(d, reference, threshold) for d in step_dirs]
  ranks, shifts, _, last_findings = per_step[-1]
  out = os.path.join(traces, "analysis")
  os.makedirs(out, exist_ok=True)
  with gzip.open(os.path.join(out, "merged_trace.json.gz"), "wt") as f:
    json.dump(analysis.merged_trace(ranks), f)
  rows = analysis.mean_heat_map([rows for _, _, rows, _ in per_step])
  with open(os.path.join(out, "heatmap.csv"), "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
  plot_heat_map(rows, os.path.join(out, "heatmap.png"))
  persistent = set.intersection(*({s["rank"] for s in findings["stragglers"]} for *_, findings in per_step))
  findings = {"threshold": threshold,
              "stragglers": [s for s in last_findings["stragglers"] if s["rank"] in persistent],
              "victims": [v for v in last_findings["victims"] if v["evidence"]["waits_for"] in persistent]}
  spreads = analysis.collective_end_spreads(ranks)
  traced = [int(os.path.basename(d).split("_")[1]) for d in step_dirs]
  summary = {"step": traced[-1], "steps": traced, "ranks": len(ranks), "clock_shift_us": shifts,
             "collective_end_spread_us": {"median": float(np.median(spreads)) if spreads.size else 0.0,
                                          "max": float(spreads.max()) if spreads.size else 0.0,
                                          "collectives": int(spreads.size)}}
  with open(os.path.join(out, "stragglers.json"), "w") as f:
    json.dump({**findings, **summary}, f, indent=2)
  return {**summary, **findings, "analysis_dir": out}


def main(argv):
  if len(argv) != 2:
    cli.fail(PROGRAM, "usage", "megajax-trace WORKDIR [--steps=N,M,...] [--reference_process=P] [--threshold=X]")
  try:
    steps = [int(n) for n in _STEPS.value]
  except ValueError:
    cli.fail(PROGRAM, "flag error", f"--steps={','.join(_STEPS.value)}: not step numbers; e.g. --steps=400,500")
  try:
    result = analyse(argv[1], steps, _REFERENCE.value, _THRESHOLD.value)
  except (FileNotFoundError, ValueError) as error:
    cli.fail(PROGRAM, "cannot analyse", f"{argv[1]}: {error}")
  spread = result["collective_end_spread_us"]
  print(f"step{'s' if len(result['steps']) > 1 else ''} {','.join(map(str, result['steps']))}: {result['ranks']} ranks; clocks aligned on the ends of {spread['collectives']} "
        f"cross-process collectives (gap between participants' ends: median {spread['median']:.0f} us, "
        f"max {spread['max']:.0f} us; shifts "
        + ", ".join(f"process {p}: {s / 1e3:+.1f} ms" for p, s in sorted(result["clock_shift_us"].items())) + ")")
  if result["stragglers"]:
    for s in result["stragglers"]:
      ratios = {k: v for k, v in s["evidence"].items() if k.endswith("ratio")}
      print(f"straggler {s['rank']} (process {s['process']}): compute {s['evidence']['compute_ms']:.1f} ms, {ratios}")
    print("victims: " + (", ".join(v["rank"] for v in result["victims"]) or "none"))
  else:
    print("no straggler")
  print(f"written to {result['analysis_dir']}: merged_trace.json.gz, heatmap.csv, heatmap.png, stragglers.json")


def run():
  app.run(main, flags_parser=cli.flags_parser(PROGRAM))


if __name__ == "__main__":
  sys.exit(run())
