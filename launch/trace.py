r"""megajax-trace: one traced step of every process -> a rank-aligned trace, heat map, stragglers.

  megajax-train ... --workdir=W --config.observe.trace_every=50
  megajax-trace W                    # the latest traced step (or --steps=N,M,...: together)

writes W/traces/analysis/:
  merged_trace.json.gz   Chrome / Perfetto trace, one track per rank DP{d}-PP{p}-TP{t},
                         every process on the reference process's clock
  heatmap.csv, heatmap.png   per-rank forward / backward / communication milliseconds,
                         laid out on the (dp, pp, tp) grid
  stragglers.json        root-cause ranks with their evidence, and their victims

The analysis is megajax.observe.trace_analysis; this is its command line.
"""

from __future__ import annotations

import sys

from absl import app
from absl import flags

from megajax.launch import cli
from megajax.observe.trace_analysis import HEATMAP_CSV, HEATMAP_PNG, MERGED_TRACE, STRAGGLERS, analyse

_STEPS = flags.DEFINE_list("steps", [], "The traced steps to analyse together, e.g. 400,500,600 (default: the "
                           "latest); a straggler must be slow in each.")
_REFERENCE = flags.DEFINE_integer("reference_process", 0, "The process whose clock the others are aligned to.")
_THRESHOLD = flags.DEFINE_float("threshold", 1.5, "A straggler's compute time over its groups' median, at least.")

PROGRAM = "megajax-trace"


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
  print(f"written to {result['analysis_dir']}: {', '.join((MERGED_TRACE, HEATMAP_CSV, HEATMAP_PNG, STRAGGLERS))}")


def run():
  app.run(main, flags_parser=cli.flags_parser(PROGRAM))


if __name__ == "__main__":
  sys.exit(run())
