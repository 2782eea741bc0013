"""The run report (megajax.observe.report): the page from a workdir's files, notes for missing
inputs; megajax-report's one-line errors."""

import json
import os
import re

import pytest

from megajax.launch import report as report_command
from megajax.observe import report
from megajax.observe.metrics import MetricsWriter, read_metrics
from megajax.observe.records import METRICS, append_jsonl

INCIDENTS = [
    {"kind": "crash", "attempt": 1, "processes": [1], "hosts": ["h1"], "errors": [], "detail": "exit code -9",
     "time_to_detect_s": 0.8, "last_step": 7, "action": "restart", "bad_processes": [],
     "time_to_resume_s": 12.5, "resumed_from_step": 5, "steps_lost": 2},
    {"kind": "hang", "attempt": 2, "processes": [0], "hosts": ["h0"], "errors": [], "detail": "no progress",
     "time_to_detect_s": 120.2, "last_step": 9, "action": "give_up", "reason": "restart budget spent"},
]


def write_metrics(workdir):
  """A run of 8 steps that saves at 4 and 8, dies after step 7 and resumes from step 5. The
  resumed part is appended as is, steps 6 and 7 a second time, as a file written before runs
  dropped the records after their checkpoint has them (the reader keeps the last record)."""
  writer = MetricsWriter(workdir, total_steps=8, progress=False)
  writer.write(1, {"startup_s": 30.0, "compile_cache_hits": 0, "compile_cache_misses": 5})
  for step in range(1, 8):
    first = step == 1
    writer.write(step, {"loss": 5.0 - 0.1 * step, "grad_norm": 1.0, "learning_rate": 1e-3,
                        "tokens_per_sec": None if first else 1000.0 + step, "tflops_per_device": None if first else 0.5,
                        "mfu": None, "skipped_steps": 1 if step >= 3 else 0})
    if step == 4:
      writer.write(4, {"ckpt_blocking_s": 0.05})
      writer.write(4, {"ckpt_total_s": 1.2})
  writer.close()
  resumed = [{"step": 6, "startup_s": 4.0, "compile_cache_hits": 5, "compile_cache_misses": 0}]
  resumed += [{"step": step, "loss": 4.0 - 0.1 * step, "tokens_per_sec": None if step == 6 else 2000.0,
               "mfu": None, "skipped_steps": 0} for step in (6, 7, 8)]
  resumed += [{"step": 8, "ckpt_blocking_s": 0.07}, {"step": 8, "ckpt_total_s": 1.4}]
  append_jsonl(os.path.join(workdir, METRICS), resumed)


def write_goodput(workdir):
  """Two runs: the first killed after step 6 (resumed from 4), the second to step 8; the
  supervisor detected the failure 1 s after the first's last record and restarted it 3 s later."""
  os.makedirs(os.path.join(workdir, "goodput"))
  runs = [(1000.0, {"start": 1.0, "compile": 2.0, "steps": 6.0}, 0, 6, "running", 0),
          (1013.0, {"start": 1.0, "compile": 1.0, "steps": 4.0}, 4, 8, "finished", 1)]
  for start, seconds, first, last, status, attempt in runs:
    record = {"process_start": start, "time": start + sum(seconds.values()), "attempt": attempt, "pid": attempt,
              "start_step": first, "last_step": last, "rollbacks": [],
              "cache": {"hits": attempt, "misses": 1 - attempt}, "status": status, "seconds": seconds}
    with open(os.path.join(workdir, "goodput", f"run-{int(start)}-{attempt}.json"), "w") as f:
      json.dump(record, f)
  with open(os.path.join(workdir, "goodput", "supervisor.jsonl"), "w") as f:
    f.write(json.dumps({"event": "failure", "attempt": 0, "kind": "exit", "last_sign_of_life": 1009.0,
                        "detected_at": 1010.0}) + "\n")


def write_trace_analysis(workdir):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  analysis = os.path.join(workdir, "traces", "analysis")
  os.makedirs(analysis)
  fig, ax = plt.subplots(figsize=(2, 2))
  ax.imshow([[1, 2], [3, 4]])
  fig.savefig(os.path.join(analysis, "heatmap.png"))
  plt.close(fig)
  with open(os.path.join(analysis, "heatmap.csv"), "w") as f:
    f.write("rank,dp,pp,tp,forward_ms,backward_ms,communication_ms,optimizer_ms\n"
            "DP0-PP0-TP0,0,0,0,10.0,20.0,5.0,1.0\n"
            "DP1-PP0-TP0,1,0,0,31.0,20.5,4.0,1.0\n")
  with open(os.path.join(analysis, "stragglers.json"), "w") as f:
    json.dump({"step": 6, "stragglers": [{"rank": "DP1-PP0-TP0", "dp": 1, "pp": 0, "tp": 0,
                                          "evidence": {"forward_ms": 31.0, "median_forward_ms": 10.0}}],
               "victims": [{"rank": "DP0-PP0-TP0", "dp": 0, "pp": 0, "tp": 0, "evidence": {"waiting_ms": 21.0}}]}, f)


def test_report_of_a_full_workdir(tmp_path):
  workdir = str(tmp_path / "run")
  write_metrics(workdir)
  with open(os.path.join(workdir, "incidents.jsonl"), "w") as f:
    f.writelines(json.dumps(i) + "\n" for i in INCIDENTS)
  write_trace_analysis(workdir)
  write_goodput(workdir)
  with open(os.path.join(workdir, "activations.jsonl"), "w") as f:
    for step in (2, 4, 6):
      for point in ("0:attn_probs", "1:residual"):
        f.write(json.dumps({"step": step, "point": point, "mean": 0.0, "std": 0.1 * step, "absmax": step}) + "\n")

  path = report.write_report(workdir)

  assert path == os.path.join(workdir, "report", "index.html")
  page = open(path).read()
  assert "DP1-PP0-TP0" in page and "No straggler found" not in page
  assert "crash" in page and "hang" in page and "restart budget spent" in page
  assert f"{4.0 - 0.1 * 8:.4f}" in page                # the final loss, from the resumed run
  assert "MFU n/a" in page
  assert "startup" in page and "4.0 s at step 6" in page
  images = re.findall(r'<img src="([^"]+)"', page)
  assert set(images) == {"loss.png", "throughput.png", "checkpoints.png", "goodput.png", "heatmap.png",
                         "activations.png"}
  goodput = page.split('id="goodput"')[1].split("<h2")[0]
  assert "8 x 1.000 s / 19.0 s = 42.1%" in goodput and "failed: exit" in goodput and "recovery" in goodput
  for name in images:
    assert os.path.isfile(os.path.join(workdir, "report", name)), name
  titles = [title for _, title in report.SECTIONS]
  assert [page.index(f">{t}</h2>") for t in titles] == sorted(page.index(f">{t}</h2>") for t in titles)
  assert "<script" not in page and "http" not in page


def test_resumed_duplicates_keep_the_last_record(tmp_path):
  write_metrics(str(tmp_path))
  metrics = read_metrics(str(tmp_path / "metrics.jsonl"))
  assert dict(metrics["loss"])[6] == pytest.approx(4.0 - 0.6)      # the resumed run's step 6, not the first's
  assert dict(metrics["loss"])[5] == pytest.approx(4.5)            # only the first run logged step 5
  assert report.skipped_steps(metrics["skipped_steps"]) == [3]     # a restart's counter starting at 0 is no skip
  assert dict(metrics["ckpt_total_s"]) == {4: 1.2, 8: 1.4}


def test_only_metrics_says_what_would_produce_the_rest(tmp_path):
  workdir = str(tmp_path)
  with open(tmp_path / "metrics.jsonl", "w") as f:
    for step in (1, 2, 3):
      f.write(json.dumps({"step": step, "loss": 3.0 / step, "tokens_per_sec": None if step == 1 else 500.0,
                          "mfu": None if step == 1 else 0.25}) + "\n")
    f.write('{"step": 4, "loss": 0.')   # a killed writer's half line

  page = open(report.write_report(workdir)).read()

  assert "1.0000 (step 3)" in page and "25.0 %" in page
  assert "megajax-supervise" in page                        # incidents
  assert "megajax-trace" in page                            # heat map and stragglers
  assert "observe.capture" in page                          # activations
  assert "tensorboard/" in page and "megajax-train" in page
  assert "checkpoint" in page.split('id="checkpoints"')[1].split("<h2")[0]
  assert "megajax-train writes WORKDIR/goodput/" in page
  images = re.findall(r'<img src="([^"]+)"', page)
  assert set(images) == {"loss.png", "throughput.png"}
  for name in images:
    assert os.path.isfile(os.path.join(workdir, "report", name))


def test_clean_trace_analysis_says_no_straggler(tmp_path):
  write_metrics(str(tmp_path))
  analysis = tmp_path / "traces" / "analysis"
  analysis.mkdir(parents=True)
  (analysis / "stragglers.json").write_text(json.dumps({"step": 3, "stragglers": [], "victims": []}))
  page = open(report.write_report(str(tmp_path))).read()
  assert "No straggler found" in page and "No heatmap.png" in page


def test_straggler_tables_have_a_cp_column(tmp_path):
  """Stragglers and victims list each mesh axis, cp among them; an analysis from before the cp
  axis (no "cp" field) shows cp 0."""
  write_metrics(str(tmp_path))
  analysis = tmp_path / "traces" / "analysis"
  analysis.mkdir(parents=True)
  (analysis / "stragglers.json").write_text(json.dumps(
      {"step": 3, "stragglers": [{"rank": "DP1-PP0-CP1-TP0", "dp": 1, "pp": 0, "cp": 1, "tp": 0, "evidence": {}}],
       "victims": [{"rank": "DP0-PP0-TP1", "dp": 0, "pp": 0, "tp": 1, "evidence": {}}]}))
  page = open(report.write_report(str(tmp_path))).read()
  assert "<tr><th>rank</th><th>dp</th><th>pp</th><th>cp</th><th>tp</th><th>evidence</th></tr>" in page
  assert "<td>DP1-PP0-CP1-TP0</td><td>1</td><td>0</td><td>1</td><td>0</td>" in page
  assert "<td>DP0-PP0-TP1</td><td>0</td><td>0</td><td>0</td><td>1</td>" in page


@pytest.mark.parametrize("make", ["nothing", "empty_dir"])
def test_cli_names_the_missing_path(tmp_path, capsys, make):
  workdir = str(tmp_path / "run")
  if make == "empty_dir":
    os.makedirs(workdir)
  with pytest.raises(SystemExit) as exit_info:
    report_command.main(["megajax-report", workdir])
  assert exit_info.value.code == 2
  error = capsys.readouterr().err
  assert error.count("\n") == 1 and error.startswith("megajax-report: ")
  assert workdir in error and "megajax-train --workdir=" in error
  if make == "empty_dir":
    assert "metrics.jsonl" in error


def test_held_out_loss_in_the_metrics_the_progress_line_and_the_report(tmp_path, monkeypatch):
  """Evaluation records (train.eval_every) are their own lines of metrics.jsonl, the progress
  line keeps the last eval_loss between them, and the report draws them on the loss plot and
  names the last in its summary."""
  workdir = str(tmp_path)
  writer = MetricsWriter(workdir, total_steps=4, progress=False)
  for step in range(1, 5):
    writer.write(step, {"loss": 3.0 - 0.5 * step})
    if step % 2 == 0:
      writer.write(step, {"eval_loss": 3.2 - 0.5 * step, "eval_perplexity": 2.718 ** (3.2 - 0.5 * step),
                          "eval_tokens": 512, "eval_batches": 2})
    assert ("eval_loss=" in writer.progress_line()) == (step >= 2)
  assert writer.progress_line() == "loss=1  eval_loss=1.2"
  writer.close()
  metrics = read_metrics(os.path.join(workdir, METRICS))
  assert metrics["eval_loss"] == [(2, pytest.approx(2.2)), (4, pytest.approx(1.2))]

  drawn = {}
  save = report._save
  def spy(fig, path):
    if path.endswith("loss.png"):
      drawn.update({line.get_label(): list(line.get_xdata()) for line in fig.axes[0].get_lines()})
    save(fig, path)
  monkeypatch.setattr(report, "_save", spy)
  page = open(report.write_report(workdir)).read()
  assert drawn == {"loss": [1, 2, 3, 4], "held-out loss": [2, 4]}
  assert "1.2000, perplexity 3.32 (step 4)" in page and "Held-out loss at 2 step(s)" in page
