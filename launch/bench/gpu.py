"""`python -m megajax.launch.bench gpu --out=DIR [--parts=tests,attention,train,run]`: the GPU
check in one call, written to DIR/gpu_check.json and DIR/gpu_check.md.

  tests      tests/gpu under pytest (every Pallas kernel compiled for real against XLA at
             `highest` precision; the 3D step on one GPU with each attention_impl)
  attention  the attention benchmark's table (bench attention: pallas, triton, cudnn, xla;
             s = 2k / 8k / 32k at w = 1k)
  train      the MFU suite (bench train) for each --train_sizes entry, e.g. 1.3b:2048,3b:8192
  profile    the last --train_sizes entry's `+ Pallas` row traced (jax.profiler): GPU time per
             step by kernel kind and the costliest ops; the trace kept as DIR/step_trace.json.gz
  run        megajax-train itself on the 1x1x1 mesh with each attention_impl, --run_steps
             steps of configs/gpt_125m.py at batch 8: the final losses side by side

Each part is written as it ends (a part that fails is recorded with its error and the next
one runs), so a run cut short by its time limit still leaves the parts it finished. The
install on a GPU machine without network (the wheels it lacks) is in WORKSPACE.md.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import traceback

import jax

from megajax.launch.bench import attention as attention_bench
from megajax.launch.bench import profile as profile_bench
from megajax.launch.bench import train as train_bench

PARTS = ("tests", "attention", "train", "profile", "run")
RUN_IMPLS = ("xla", "pallas", "cudnn")
# The checkout the check runs from (tests/gpu, configs/): the working directory, else the
# source tree of an editable install.
REPO = next((path for path in (os.getcwd(), os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
             if os.path.isdir(os.path.join(path, "tests", "gpu"))), os.getcwd())


def run_tests(timeout_s: int) -> dict:
  """tests/gpu under pytest in a child process: counts, and each failure's first lines."""
  tests = os.path.join(REPO, "tests", "gpu")
  if not os.path.isdir(tests):
    raise FileNotFoundError(f"{tests} not found: run the GPU check from a checkout (pip install -e .)")
  command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", "--tb=line", tests]
  environ = {**os.environ, "MEGAJAX_TESTS_ON": "gpu"}     # tests/conftest.py: leave JAX on the GPU
  result = subprocess.run(command, cwd=REPO, env=environ, capture_output=True, text=True, timeout=timeout_s)
  summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
  counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|error)", summary)}
  problems = [line for line in result.stdout.splitlines() if line.startswith(("FAILED", "ERROR", "SKIPPED", "/"))]
  return {"returncode": result.returncode, "summary": summary, "counts": counts, "lines": problems[:60]}


def run_training(steps: int, timeout_s: int) -> dict:
  """megajax-train (the command) per attention_impl on one device; the last logged loss each."""
  results = {}
  for impl in RUN_IMPLS:
    workdir = f"/tmp/megajax-gpu-check-{impl}-{os.getpid()}"
    command = [sys.executable, "-m", "megajax.launch.train", f"--config={os.path.join(REPO, 'configs', 'gpt_125m.py')}",
               f"--workdir={workdir}", "--config.train.batch_size=8", f"--config.train.steps={steps}",
               "--config.train.log_every=10", "--config.optimizer.warmup_steps=5",
               "--config.model.compute_dtype=bfloat16", f"--config.model.attention_impl={impl}"]
    start = time.time()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    record = {"returncode": result.returncode, "seconds": round(time.time() - start, 1)}
    metrics = os.path.join(workdir, "metrics.jsonl")
    if result.returncode == 0 and os.path.exists(metrics):
      logged = [json.loads(line) for line in open(metrics) if '"loss"' in line]
      record["losses"] = {r["step"]: r["loss"] for r in logged if "loss" in r}
      record["last"] = logged[-1]
    else:
      record["stderr"] = result.stderr[-2000:]
    results[impl] = record
  return results


def _train_sizes(spec: str) -> list[tuple[str, int]]:
  sizes = []
  for entry in filter(None, spec.split(",")):
    size, _, seq = entry.partition(":")
    if size not in train_bench.SIZES or not seq.isdigit():
      raise ValueError(f"--train_sizes={spec!r}: each entry is SIZE:SEQ with SIZE in {list(train_bench.SIZES)}")
    sizes.append((size, int(seq)))
  return sizes


def markdown(report: dict) -> str:
  lines = [f"# GPU check: {report['device']}", "", f"jax {report['jax']}, parts {', '.join(report['parts'])}", ""]
  for name, part in report["results"].items():
    lines.append(f"## {name} ({part.get('seconds', '?')} s)")
    if "error" in part:
      lines += ["", "```", part["error"], "```", ""]
      continue
    if name == "tests":
      lines += ["", part["summary"], ""] + [f"- {line}" for line in part["lines"]] + [""]
    elif name == "attention":
      lines += ["", "```"] + attention_bench.table(part) + ["```", ""]
    elif name == "train":
      for run in part["suites"]:
        lines += ["", f"{run['size']} s={run['seq']} w={run['window']}", "",
                  "| row | batch | remat | step ms | tokens/s | TFLOP/s | MFU |", "|---|---|---|---|---|---|---|"]
        for r in run["rows"]:
          if "error" in r:
            lines.append(f"| {r['row']} | {r['batch']} | | skipped: {r['error'][:100]} | | | |")
            continue
          mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
          lines.append(f"| {r['row']} | {r['batch']} | {r['remat']} | {r['step_s'] * 1e3:.1f} | {r['tokens_per_sec']:.0f} | {r['tflops']:.1f} | {mfu} |")
      lines.append("")
    elif name == "profile":
      lines += ["", f"{part['size']} s={part['seq']} {part['row']}", "", "```"] + profile_bench.table(part) + [
          "```", ""]
    elif name == "run":
      lines += ["", "| impl | rc | seconds | losses by step |", "|---|---|---|---|"]
      for impl, r in part["impls"].items():
        losses = ", ".join(f"{step}: {loss:.4f}" for step, loss in r.get("losses", {}).items())
        lines.append(f"| {impl} | {r['returncode']} | {r['seconds']} | {losses or r.get('stderr', '')[-200:]} |")
      lines.append("")
  return "\n".join(lines)


def gpu_check(out: str, parts: str, repeats: int, train_sizes: str, run_steps: int) -> None:
  wanted = [p for p in parts.split(",") if p]
  unknown = [p for p in wanted if p not in PARTS]
  if unknown or not wanted:
    raise SystemExit(f"--parts={parts!r}: choose from {','.join(PARTS)}")
  sizes = _train_sizes(train_sizes)
  os.makedirs(out, exist_ok=True)
  device = jax.devices()[0]
  if device.platform != "gpu":
    print(f"note: no GPU here ({device.platform}): the check runs, but its figures are not GPU figures")
  report = {"device": device.device_kind, "platform": device.platform, "jax": jax.__version__,
            "parts": wanted, "results": {}}
  for part in wanted:
    start = time.time()
    print(f"\n== gpu check: {part}", flush=True)
    try:
      if part == "tests":
        result = run_tests(timeout_s=420)
        print(result["summary"], *result["lines"], sep="\n")
      elif part == "attention":
        result = attention_bench.attention(repeats)
      elif part == "train":
        suites = []
        for size, seq in sizes:
          suites.append({"size": size, "seq": seq, "window": seq // 4,
                         "rows": train_bench.train(size, seq, 0, repeats)})
        result = {"suites": suites}
      elif part == "profile":
        size, seq = sizes[-1]
        config = train_bench.fitted(train_bench.row_config(size, seq, seq // 4, train_bench.ROWS.index("+ Pallas"),
                                                           device.platform == "gpu"))
        result = {"size": size, "seq": seq, "row": "+ Pallas",
                  **profile_bench.profile_step(config, 3, os.path.join(out, "step_trace.json.gz"))}
        print("\n".join(profile_bench.table(result)))
      else:
        result = {"impls": run_training(run_steps, timeout_s=240)}
        for impl, r in result["impls"].items():
          print(impl, r["returncode"], r["seconds"], "s", r.get("losses") or r.get("stderr", "")[-1000:])
    except Exception as e:   # recorded, and the next part still runs
      result = {"error": "".join(traceback.format_exception(e))[-4000:]}
      print(result["error"], file=sys.stderr)
    result["seconds"] = round(time.time() - start, 1)
    report["results"][part] = result
    with open(os.path.join(out, "gpu_check.json"), "w") as f:
      json.dump(report, f, indent=1, default=str)
    with open(os.path.join(out, "gpu_check.md"), "w") as f:
      f.write(markdown(report))
  print(f"\nwrote {out}/gpu_check.json and gpu_check.md")
