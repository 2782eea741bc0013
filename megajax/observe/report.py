r"""The run report: one static HTML page that summarizes a training run (megajax-report).

  write_report("/tmp/run")    # writes /tmp/run/report/index.html and its PNG figures

Reads what the run left in its workdir: metrics.jsonl (required; megajax-train),
incidents.jsonl (megajax-supervise), goodput/ (the goodput ledger), traces/analysis/ (megajax-trace) and activations.jsonl
(config.observe.capture). A missing input leaves its section as one line naming what would
produce it. The page has no JavaScript and no external resources, so the report folder can be
copied anywhere and opened offline.
"""

from __future__ import annotations

import csv
import html
import json
import os
import shutil
import statistics

from megajax.observe.goodput_ledger import CAUSES, LEDGER_CAUSES, job_ledger
from megajax.observe.metrics import read_metrics
from megajax.observe.probes import read_activations
from megajax.observe.records import ACTIVATIONS, INCIDENTS, METRICS, read_jsonl
from megajax.observe.trace_analysis import HEATMAP_CSV, HEATMAP_PNG, STRAGGLERS, analysis_dir
SECTIONS = (("loss", "Loss"), ("throughput", "Throughput and MFU"), ("checkpoints", "Checkpoints"),
            ("goodput", "Goodput"), ("incidents", "Incidents"), ("stragglers", "Heat map and stragglers"),
            ("activations", "Activations"), ("tensorboard", "TensorBoard"))
# The supervisor's incident fields, in reading order; any other field follows these.
INCIDENT_COLUMNS = ("kind", "attempt", "processes", "hosts", "action", "time_to_detect_s", "time_to_resume_s",
                    "last_step", "resumed_from_step", "steps_lost", "bad_processes", "excluded_hosts",
                    "processes_after", "mesh_after", "errors", "detail", "reason")


# --- Reading the workdir.

def numbers(series) -> tuple[list[int], list[float]]:
  """(steps, values) of a series' numeric points (nulls: not measured, e.g. MFU on CPU)."""
  points = [(s, float(v)) for s, v in series if isinstance(v, (int, float)) and not isinstance(v, bool)]
  return [s for s, _ in points], [v for _, v in points]


def skipped_steps(series) -> list[int]:
  """Logged steps by which at least one update was skipped since the previous logged step.
  skipped_steps is a per-process running count, so it starts again at 0 after a restart."""
  marked, previous = [], 0
  for step, count in zip(*numbers(series)):
    new = count - previous if count >= previous else count
    if new > 0:
      marked.append(step)
    previous = count
  return marked


# --- Figures (matplotlib, Agg: no display needed).

def _pyplot():
  import matplotlib  # Only the figures need it.
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def _save(fig, path: str) -> None:
  from matplotlib.ticker import MaxNLocator
  for ax in fig.axes:
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))   # steps are whole numbers
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  _pyplot().close(fig)


def plot_loss(metrics, path: str) -> None:
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(9, 4))
  steps, losses = numbers(metrics.get("loss", []))
  ax.plot(steps, losses, lw=1.2, label="loss")
  eval_steps, eval_losses = numbers(metrics.get("eval_loss", []))
  if eval_steps:     # train.eval_every: a point per evaluation, joined
    ax.plot(eval_steps, eval_losses, "o-", lw=1, ms=4, color="tab:orange", label="held-out loss")
  skipped = skipped_steps(metrics.get("skipped_steps", []))
  for i, step in enumerate(skipped):
    ax.axvline(step, color="tab:red", alpha=0.4, lw=1, label="update skipped (non-finite)" if i == 0 else None)
  ax.set_xlabel("step")
  ax.set_ylabel("loss")
  ax.grid(alpha=0.3)
  ax.legend(loc="upper right")
  _save(fig, path)


def plot_throughput(metrics, path: str) -> None:
  plt = _pyplot()
  fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
  top.plot(*numbers(metrics.get("tokens_per_sec", [])), marker=".", lw=1)
  top.set_ylabel("tokens/s")
  top.grid(alpha=0.3)
  mfu_steps, mfu_values = numbers(metrics.get("mfu", []))
  if mfu_steps:
    bottom.plot(mfu_steps, [100 * v for v in mfu_values], marker=".", lw=1, color="tab:green")
    bottom.set_ylabel("MFU (%)")
  else:
    # Without a peak there is no MFU; TFLOP/s per device still tells speed per chip.
    tflops_steps, tflops = numbers(metrics.get("tflops_per_device", []))
    bottom.plot(tflops_steps, tflops, marker=".", lw=1, color="tab:gray")
    bottom.set_ylabel("TFLOP/s per device")
    bottom.set_title("MFU n/a: unknown peak for this device", fontsize=10)
  bottom.set_xlabel("step")
  bottom.grid(alpha=0.3)
  _save(fig, path)


def plot_checkpoints(metrics, path: str) -> None:
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(9, 4))
  ax.plot(*numbers(metrics.get("ckpt_total_s", [])), "s--", color="tab:blue", label="start to commit (background)")
  ax.plot(*numbers(metrics.get("ckpt_blocking_s", [])), "o-", color="tab:red", label="step blocked (device -> host)")
  ax.set_xlabel("saved step")
  ax.set_ylabel("seconds")
  ax.set_ylim(bottom=0)
  ax.grid(alpha=0.3)
  ax.legend()
  _save(fig, path)


def plot_activations(activations, path: str) -> None:
  plt = _pyplot()
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
  for ax, stat in zip(axes, ("std", "absmax")):
    values = []
    for point, records in activations.items():
      steps, point_values = numbers([(r["step"], r.get(stat)) for r in records])
      ax.plot(steps, point_values, lw=1, label=point)
      values += point_values
    if values and min(values) > 0:
      ax.set_yscale("log")    # a blow-up is growth over orders of magnitude
    ax.set_title(stat)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3, which="both")
  axes[1].legend(fontsize=7, ncol=max(1, len(activations) // 12), loc="upper left", bbox_to_anchor=(1.01, 1))
  _save(fig, path)


# --- HTML pieces (every text from the workdir goes through html.escape).

def _e(value) -> str:
  return html.escape(str(value))


def _note(text: str) -> str:
  return f'<p class="note">{_e(text)}</p>'


def _img(name: str, alt: str) -> str:
  return f'<img src="{_e(name)}" alt="{_e(alt)}">'


def _cell(value) -> str:
  if value is None:
    return "&ndash;"
  if isinstance(value, float):
    return _e(f"{value:.4g}")
  if isinstance(value, list):
    return _e(", ".join(str(v) for v in value))
  if isinstance(value, dict):
    return f"<pre>{_e(json.dumps(value, indent=1, sort_keys=True))}</pre>"
  return _e(value)


def _table(columns, rows, row_classes=None) -> str:
  head = "".join(f"<th>{_e(c)}</th>" for c in columns)
  body = []
  for i, row in enumerate(rows):
    css = f' class="{row_classes[i]}"' if row_classes and row_classes[i] else ""
    body.append(f"<tr{css}>" + "".join(f"<td>{_cell(v)}</td>" for v in row) + "</tr>")
  return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _median(values):
  return statistics.median(values) if values else None


def _last(series):
  steps, values = numbers(series)
  return (steps[-1], values[-1]) if steps else (None, None)


# --- Sections: each returns its HTML body (figures written into report_dir).

def header(workdir: str, metrics) -> str:
  steps = sorted({s for series in metrics.values() for s, _ in series})
  logged = len(numbers(metrics.get("loss", []))[0])
  final_step, final_loss = _last(metrics.get("loss", []))
  eval_step, eval_loss = _last(metrics.get("eval_loss", []))
  _, eval_perplexity = _last(metrics.get("eval_perplexity", []))
  tokens = _median(numbers(metrics.get("tokens_per_sec", []))[1])
  mfu = _median(numbers(metrics.get("mfu", []))[1])
  rows = [("workdir", _e(os.path.abspath(workdir))),
          ("steps covered", f"{steps[0]}&ndash;{steps[-1]} ({logged} logged)" if steps else "none"),
          ("final loss", _e(f"{final_loss:.4f} (step {final_step})") if final_loss is not None else "n/a"),
          ("final held-out loss", _e(f"{eval_loss:.4f}, perplexity {eval_perplexity:.4g} (step {eval_step})")
           if eval_loss is not None and eval_perplexity is not None else "n/a: train with train.eval_every > 0"),
          ("median tokens/s", _e(f"{tokens:,.0f}") if tokens is not None else "n/a"),
          ("median MFU", _e(f"{100 * mfu:.1f} % (between logged steps)") if mfu is not None
           else "n/a: unknown peak for this device")]
  hits, misses = dict(metrics.get("compile_cache_hits", [])), dict(metrics.get("compile_cache_misses", []))
  starts = [f"{value:.1f} s at step {step} (compile cache {hits.get(step, '?')} hits, {misses.get(step, '?')} misses)"
            for step, value in zip(*numbers(metrics.get("startup_s", [])))]
  if starts:   # one per start: a restart's time to its first step
    rows.append(("startup (to first step)", "<br>".join(_e(s) for s in starts)))
  return "<table class=\"summary\">" + "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows) + "</table>"


def loss_section(metrics, report_dir: str) -> str:
  if not numbers(metrics.get("loss", []))[0]:
    return _note("No loss in metrics.jsonl: megajax-train logs it every train.log_every steps.")
  plot_loss(metrics, os.path.join(report_dir, "loss.png"))
  skipped = skipped_steps(metrics.get("skipped_steps", []))
  text = (f"Updates skipped (non-finite loss or gradients) by logged steps: {', '.join(map(str, skipped))}."
          if skipped else "No update was skipped.")
  evaluated = numbers(metrics.get("eval_loss", []))[0]
  if evaluated:
    text += f" Held-out loss at {len(evaluated)} step(s), the last at step {evaluated[-1]}."
  return _img("loss.png", "loss and held-out loss vs step") + f"<p>{_e(text)}</p>"


def throughput_section(metrics, report_dir: str) -> str:
  if not numbers(metrics.get("tokens_per_sec", []))[0]:
    return _note("No tokens_per_sec in metrics.jsonl: megajax-train measures it between logged steps "
                 "(from the second logged step on).")
  plot_throughput(metrics, os.path.join(report_dir, "throughput.png"))
  rows = []
  for name, scale, unit in (("tokens_per_sec", 1, ""), ("tflops_per_device", 1, ""), ("mfu", 100, " %")):
    values = numbers(metrics.get(name, []))[1]
    if values:
      rows.append((name, *(f"{scale * v:.4g}{unit}" for v in (min(values), _median(values), max(values)))))
  note = "" if numbers(metrics.get("mfu", []))[0] else _note("MFU n/a: unknown peak for this device.")
  return _img("throughput.png", "tokens/s and MFU vs step") + note + _table(("metric", "min", "median", "max"), rows)


def checkpoints_section(metrics, report_dir: str) -> str:
  blocking = dict(zip(*numbers(metrics.get("ckpt_blocking_s", []))))
  total = dict(zip(*numbers(metrics.get("ckpt_total_s", []))))
  if not blocking and not total:
    return _note("No checkpoint saves in metrics.jsonl: megajax-train records them when config.checkpoint "
                 "saves (every checkpoint.every steps and at the end).")
  plot_checkpoints(metrics, os.path.join(report_dir, "checkpoints.png"))
  saves = sorted(set(blocking) | set(total))
  rows = [(step, blocking.get(step), total.get(step)) for step in saves]
  summary = f"{len(saves)} save(s)."
  if blocking:
    summary += (f" The step waited {_median(list(blocking.values())):.3f} s (median) for the device -> host "
                "copy; the rest of each save ran in the background.")
  return (_img("checkpoints.png", "checkpoint seconds per saved step") + f"<p>{_e(summary)}</p>"
          + _table(("step", "step blocked (s)", "start to commit (s)"), rows))


# The ledger's causes, coloured: productive green, run-time costs blue / purple, faults red.
_CAUSE_COLOURS = {"productive": "#2ca02c", "redone": "#d62728", "start": "#9ecae1", "setup": "#6baed6",
                  "restore": "#4292c6", "compile": "#2171b5", "data_wait": "#fdae6b", "checkpoint": "#9467bd",
                  "eval": "#c5b0d5", "rollback": "#ff9896", "shutdown": "#bcbddc", "detection": "#e377c2",
                  "recovery": "#ff7f0e", "idle": "#c7c7c7", "unaccounted": "#7f7f7f"}


# A run's causes in the order they come (the laps of one cause are summed into one segment).
_RUN_ORDER = tuple(part for cause in CAUSES for part in (("productive", "redone") if cause == "steps" else (cause,)))


def plot_goodput(book, path: str) -> None:
  """Top: the job's wall time as one bar stacked by cause. Bottom: the timeline, each attempt's
  span stacked by its own causes, then (hatched) the gap after it: detection, recovery or idle."""
  plt = _pyplot()
  fig, (whole, timeline) = plt.subplots(2, 1, figsize=(11, 2.8 + 0.45 * len(book.attempts)),
                                        gridspec_kw={"height_ratios": [1, max(1, len(book.attempts))]})
  left = 0.0
  for cause in LEDGER_CAUSES:
    seconds = book.seconds[cause]
    if seconds > 0:
      whole.barh(0, seconds, left=left, color=_CAUSE_COLOURS[cause], label=f"{cause} {100 * seconds / book.wall_s:.1f}%")
      left += seconds
  whole.set_yticks([])
  whole.legend(loc="upper left", bbox_to_anchor=(1.01, 1.3), ncol=1, fontsize=7, frameon=False)
  whole.set_title(f"effective training time ratio {100 * book.ratio:.1f}% ({book.kept_steps} steps kept, "
                  f"{book.redone_steps} redone)")
  for row, attempt in enumerate(book.attempts):
    left = attempt.process_start - book.start
    for cause in _RUN_ORDER:
      seconds = attempt.seconds.get(cause, 0.0)
      if seconds > 0:
        timeline.barh(row, seconds, left=left, color=_CAUSE_COLOURS[cause])
        left += seconds
    for cause in ("unaccounted", "detection", "recovery", "idle"):     # the gap after it, hatched
      seconds = attempt.after.get(cause, 0.0)
      if seconds > 0:
        timeline.barh(row, seconds, left=left, color=_CAUSE_COLOURS[cause], hatch="//", alpha=0.6)
        left += seconds
    timeline.text(left, row, f" {attempt.status}", va="center", fontsize=8)
  timeline.set_yticks(range(len(book.attempts)), [f"attempt {a.attempt}" for a in book.attempts])
  timeline.invert_yaxis()
  timeline.set_xlim(0, book.wall_s * 1.15)
  timeline.set_xlabel("seconds since the job's first launch")
  _save(fig, path)


def goodput_section(workdir: str, report_dir: str) -> str:
  book = job_ledger(workdir)
  if book is None:
    return _note("No goodput records: megajax-train writes WORKDIR/goodput/ (a run before them has none).")
  plot_goodput(book, os.path.join(report_dir, "goodput.png"))
  summary = (f"Effective training time ratio (MegaScale 6.3: iterations x iteration time / total time): "
             f"{book.kept_steps} x {book.iteration_s:.3f} s / {book.wall_s:.1f} s = {100 * book.ratio:.1f}%, over "
             f"{len(book.attempts)} run(s). megajax-goodput WORKDIR prints this table.")
  causes = [(cause, f"{book.seconds[cause]:.2f}", f"{100 * book.seconds[cause] / book.wall_s:.1f}%")
            for cause in LEDGER_CAUSES if book.seconds[cause] > 0]
  attempts = [(a.attempt, f"{a.process_start - book.start:.1f}", f"{a.end - book.start:.1f}",
               f"{a.start_step} -> {a.last_step}", a.steps_run, a.redone_steps, f"{a.seconds['compile']:.2f}",
               f"{a.cache.get('hits', 0)} / {a.cache.get('misses', 0)}", a.status,
               "" if a.resumed_s is None else f"{a.resumed_s:.1f}") for a in book.attempts]
  return (_img("goodput.png", "the job's wall time by cause, and its attempts") + f"<p>{_e(summary)}</p>"
          + _table(("cause", "seconds", "share"), causes)
          + _table(("attempt", "start (s)", "end (s)", "steps", "run", "redone", "compile (s)", "cache hits / misses",
                    "how it ended", "detection to the next first step (s)"), attempts))


def incidents_section(workdir: str) -> str:
  path = os.path.join(workdir, INCIDENTS)
  if not os.path.exists(path):
    return _note("No incidents.jsonl: megajax-supervise writes one line per failure it detects and recovers "
                 "from (none, or the run was not supervised).")
  incidents = read_jsonl(path)
  if not incidents:
    return "<p>No incident.</p>"
  present = {k for incident in incidents for k in incident}
  columns = [c for c in INCIDENT_COLUMNS if c in present] + sorted(present - set(INCIDENT_COLUMNS))
  lost = sum(i.get("steps_lost") or 0 for i in incidents)
  summary = f"{len(incidents)} incident(s), {lost} step(s) lost in all."
  return f"<p>{_e(summary)}</p>" + _table(columns, [[i.get(c) for c in columns] for i in incidents])


def _ranks_table(entries: list[dict]) -> str:
  """megajax-trace's stragglers or victims, one row each (an analysis from before the cp axis: cp 0)."""
  return _table(("rank", "dp", "pp", "cp", "tp", "evidence"),
                [(e.get("rank"), e.get("dp"), e.get("pp"), e.get("cp", 0), e.get("tp"), e.get("evidence"))
                 for e in entries])


def read_verdict(path: str) -> dict | str:
  """megajax-trace's stragglers.json, or a note saying why there is none to show."""
  if not os.path.exists(path):
    return "No stragglers.json: megajax-trace WORKDIR writes it."
  try:
    with open(path) as f:
      return json.load(f)
  except json.JSONDecodeError as error:   # megajax-trace cut short
    return f"stragglers.json does not parse ({error}): run megajax-trace WORKDIR again."


def stragglers_section(workdir: str, report_dir: str) -> str:
  analysis = analysis_dir(workdir)
  if not os.path.isdir(analysis):
    return _note("No traces/analysis/: train with --config.observe.trace_every=N, then run megajax-trace WORKDIR.")
  parts, stragglers = [], set()
  verdict = read_verdict(os.path.join(analysis, STRAGGLERS))
  if isinstance(verdict, str):
    parts.append(_note(verdict))
  else:
    stragglers = {e.get("rank") for e in verdict.get("stragglers", [])}
    parts.append(f"<p>Traced step: {_e(verdict.get('step', '?'))}.</p>")
    if verdict.get("stragglers"):
      parts.append("<h3>Stragglers</h3>" + _ranks_table(verdict["stragglers"]))
    else:
      parts.append("<p><b>No straggler found.</b></p>")
    if verdict.get("victims"):
      parts.append("<h3>Victims (waiting on a straggler)</h3>" + _ranks_table(verdict["victims"]))
    rest = {k: v for k, v in verdict.items() if k not in ("stragglers", "victims", "step")}
    if rest:
      parts.append(f"<pre>{_e(json.dumps(rest, indent=1, sort_keys=True))}</pre>")
  if os.path.exists(os.path.join(analysis, HEATMAP_PNG)):
    shutil.copyfile(os.path.join(analysis, HEATMAP_PNG), os.path.join(report_dir, "heatmap.png"))
    parts.append(_img("heatmap.png", "per-rank phase times heat map"))
  else:
    parts.append(_note("No heatmap.png: megajax-trace WORKDIR draws it."))
  csv_path = os.path.join(analysis, HEATMAP_CSV)
  if os.path.exists(csv_path):
    with open(csv_path, newline="") as f:
      rows = list(csv.reader(f))
    if rows:
      rank_column = rows[0].index("rank") if "rank" in rows[0] else None
      classes = ["straggler" if rank_column is not None and rank_column < len(row) and row[rank_column] in stragglers
                 else "" for row in rows[1:]]
      parts.append("<h3>Per-rank phase times (ms)</h3>" + _table(rows[0], rows[1:], classes))
  else:
    parts.append(_note("No heatmap.csv: megajax-trace WORKDIR writes it."))
  return "".join(parts)


def activations_section(workdir: str, report_dir: str) -> str:
  path = os.path.join(workdir, ACTIVATIONS)
  activations = read_activations(path) if os.path.exists(path) else {}
  if not activations:
    return _note("No activations.jsonl: train with --config.observe.capture=POINTS (e.g. \"*:residual\").")
  plot_activations(activations, os.path.join(report_dir, "activations.png"))
  last = [(point, records[-1]["step"], records[-1].get("mean"), records[-1].get("std"), records[-1].get("absmax"))
          for point, records in activations.items()]
  return (_img("activations.png", "activation std and absmax vs step")
          + "<h3>Last capture of each point</h3>" + _table(("point", "step", "mean", "std", "absmax"), last))


def tensorboard_section(workdir: str) -> str:
  logdir = os.path.join(os.path.abspath(workdir), "tensorboard")
  if not os.path.isdir(logdir):
    return _note("No tensorboard/: megajax-train --workdir writes its scalars there.")
  return (f"<p>Every scalar of metrics.jsonl, step by step:</p><pre>tensorboard --logdir {_e(logdir)}</pre>")


STYLE = """
body { font-family: sans-serif; max-width: 1100px; margin: 1em auto; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 2px 6px; text-align: left; vertical-align: top; }
th { background: #f2f2f2; }
tr.straggler td { background: #fdd; }
pre { margin: 0; font-size: 0.85em; }
img { max-width: 100%; }
.note { color: #777; font-style: italic; }
"""


# --- The page.

def missing_input(workdir: str) -> str | None:
  """Why no report can be written for `workdir` (with the fix), or None."""
  if not os.path.isdir(workdir):
    return f"{workdir}: no such workdir; run megajax-train --workdir={workdir} first"
  if not os.path.isfile(os.path.join(workdir, METRICS)):
    return (f"{os.path.join(workdir, METRICS)}: not found; run megajax-train --workdir={workdir} "
            "first (process 0 writes it)")
  return None


def write_report(workdir: str) -> str:
  """Writes WORKDIR/report/index.html and its figures; returns the index.html path."""
  problem = missing_input(workdir)
  if problem:
    raise FileNotFoundError(problem)
  report_dir = os.path.join(workdir, "report")
  os.makedirs(report_dir, exist_ok=True)
  metrics = read_metrics(os.path.join(workdir, METRICS))
  bodies = {"loss": loss_section(metrics, report_dir), "throughput": throughput_section(metrics, report_dir),
            "checkpoints": checkpoints_section(metrics, report_dir),
            "goodput": goodput_section(workdir, report_dir), "incidents": incidents_section(workdir),
            "stragglers": stragglers_section(workdir, report_dir),
            "activations": activations_section(workdir, report_dir), "tensorboard": tensorboard_section(workdir)}
  contents = " &middot; ".join(f'<a href="#{key}">{_e(title)}</a>' for key, title in SECTIONS)
  sections = "".join(f'<h2 id="{key}">{_e(title)}</h2>{bodies[key]}' for key, title in SECTIONS)
  title = f"megajax run: {os.path.basename(os.path.abspath(workdir))}"
  page = (f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{_e(title)}</title><style>{STYLE}</style>'
          f"</head><body><h1>{_e(title)}</h1>{header(workdir, metrics)}<p>{contents}</p>{sections}</body></html>\n")
  path = os.path.join(report_dir, "index.html")
  with open(path, "w") as f:
    f.write(page)
  return path
