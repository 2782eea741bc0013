"""`python -m megajax.launch.bench gpu --out=DIR [--parts=...] [--budget_s=470]`: the GPU check
in one call that fits a lease (15 minutes of device time in all, one command at most 10),
written to DIR/gpu_check.json and DIR/gpu_check.md as each part ends.

  tests       tests/gpu under pytest, 8 workers sharing the GPU (every Pallas kernel compiled
              for real against XLA at `highest` precision; the 3D step with each attention_impl)
  train       the MFU suite (bench train) for each --train_sizes entry, e.g. 1.3b:2048,3b:8192;
              its rows compiled side by side in threads, then timed one by one
  attention   our Pallas kernels against cuDNN (fwd and fwd+bwd, s = 2k and 8k at w = 1k);
              the whole grid (xla, the Hopper rows, 32k) is `bench attention`
  run         megajax-train itself on one GPU with each attention_impl at once (three
              processes sharing it), --run_steps steps of configs/gpt_125m.py at batch 8: the
              losses side by side
  checkpoint  bench checkpoint: the async save's blocking time against a synchronous save,
              checksums on / off, the restore, on the GPUs' own device -> host path
  profile     (not by default) the last --train_sizes entry's `+ Pallas` row traced: GPU time
              by kernel kind; the trace kept as DIR/step_trace.json.gz

With --budget_s > 0 each part runs in its own process under a time limit: its planned
seconds (PLAN_S) plus what the parts before it left unused, never past the budget. A part cut
at its limit or failing is recorded (with its log's tail) and the next one runs; its log is
DIR/<part>.log. --budget_s=0 runs the parts in this process, without limits.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback

import jax

from megajax.launch.bench import attention as attention_bench
from megajax.launch.bench import checkpoint as checkpoint_bench
from megajax.launch.bench import profile as profile_bench
from megajax.launch.bench import train as train_bench
from megajax.launch.runtime import gpu_available

PARTS = ("tests", "train", "attention", "run", "checkpoint", "profile")
# Seconds each part is planned to take on a lent H100 / H200, from the first lease (an H200,
# 2026-11-28; WORKSPACE.md): tests/gpu took 168 s on 8 workers; a 1.3B MFU row compiled in
# about 100 s and an attention row in about 50 s, one after the other (now side by side, on
# the machine's 16 cores); megajax-train of the 125M config compiles in well under a minute.
# They sum to BUDGET_S: with the ~20 s install and a machine start of about 2 minutes, one
# lease of 15 minutes holds the check and a rerun of a part.
PLAN_S = {"tests": 175, "train": 150, "attention": 55, "run": 60, "checkpoint": 30, "profile": 60}
BUDGET_S = 470
RUN_IMPLS = ("xla", "pallas", "cudnn")
# The run part's three processes share one GPU: each may take this much of its memory.
RUN_MEMORY_FRACTION = 0.28
# The checkout the check runs from (tests/gpu, configs/): the working directory, else the
# source tree of an editable install.
REPO = next((path for path in (os.getcwd(), os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
             if os.path.isdir(os.path.join(path, "tests", "gpu"))), os.getcwd())


def run_tests(timeout_s: int) -> dict:
  """tests/gpu under pytest in a child process: counts, and each failure's first lines."""
  tests = os.path.join(REPO, "tests", "gpu")
  if not os.path.isdir(tests):
    raise FileNotFoundError(f"{tests} not found: run the GPU check from a checkout (pip install -e .)")
  workers = ["-n", "8"] if gpu_available() else []   # compile-bound: 8 share the GPU
  command = [sys.executable, "-m", "pytest", "-q", *workers, "-p", "no:cacheprovider", "-rfEs", "--tb=line", tests]
  environ = {**os.environ, "MEGAJAX_TESTS_ON": "gpu",     # tests/conftest.py: leave JAX on the GPU
             "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}     # the workers allocate as they go
  result = subprocess.run(command, cwd=REPO, env=environ, capture_output=True, text=True, timeout=timeout_s)
  summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
  counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|error)", summary)}
  problems = [line for line in result.stdout.splitlines() if line.startswith(("FAILED", "ERROR", "SKIPPED", "/"))]
  return {"returncode": result.returncode, "summary": summary, "counts": counts, "lines": problems[:60]}


def run_training(steps: int, timeout_s: int) -> dict:
  """megajax-train (the command) per attention_impl on one device, the three at once (each
  compiles on its own CPU cores and takes RUN_MEMORY_FRACTION of the GPU); the logged losses
  of each."""
  started, runs = time.time(), {}
  environ = {**os.environ, "XLA_PYTHON_CLIENT_MEM_FRACTION": str(RUN_MEMORY_FRACTION)}
  for impl in RUN_IMPLS:
    workdir = f"/tmp/megajax-gpu-check-{impl}-{os.getpid()}"
    command = [sys.executable, "-m", "megajax.launch.train", f"--config={os.path.join(REPO, 'configs', 'gpt_125m.py')}",
               f"--workdir={workdir}", "--config.train.batch_size=8", f"--config.train.steps={steps}",
               "--config.train.log_every=10", "--config.optimizer.warmup_steps=5",
               "--config.model.compute_dtype=bfloat16", f"--config.model.attention_impl={impl}"]
    runs[impl] = (workdir, subprocess.Popen(command, cwd=REPO, env=environ, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.PIPE, text=True))
  results = {}
  for impl, (workdir, process) in runs.items():
    try:
      _, stderr = process.communicate(timeout=max(1.0, timeout_s - (time.time() - started)))
    except subprocess.TimeoutExpired:
      process.kill()
      _, stderr = process.communicate()
    record = {"returncode": process.returncode, "seconds": round(time.time() - started, 1)}
    metrics = os.path.join(workdir, "metrics.jsonl")
    if process.returncode == 0 and os.path.exists(metrics):
      logged = [json.loads(line) for line in open(metrics) if '"loss"' in line]
      record["losses"] = {r["step"]: r["loss"] for r in logged if "loss" in r}
      record["last"] = logged[-1]
    else:
      record["stderr"] = stderr[-2000:]
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


def markdown(check: dict) -> str:
  lines = [f"# GPU check: {check['device'] or check['platform']}", "", f"jax {check['jax']}, parts {', '.join(check['parts'])}", ""]
  for name, part in check["results"].items():
    planned = check.get("planned_s", {}).get(name)
    lines.append(f"## {name} ({part.get('seconds', '?')} s" + (f", planned {planned} s)" if planned else ")"))
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
    elif name == "checkpoint":
      lines += ["", "```"] + part["lines"] + ["```", ""]
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


# Parts whose GPU work runs in processes they start (pytest's workers, megajax-train): this
# process must not start a jax backend for them, which would take the GPU's memory first
# (XLA preallocates its fraction when a backend starts).
SPAWNING_PARTS = ("tests", "run")


def run_part(part: str, out: str, repeats: int, sizes: list[tuple[str, int]], run_steps: int) -> dict:
  """One part, in this process: its result (a dict that goes to the check)."""
  platform = "gpu" if gpu_available() else "cpu"
  if part == "tests":
    result = run_tests(timeout_s=PLAN_S["tests"] * 3)
    print(result["summary"], *result["lines"], sep="\n")
  elif part == "attention":
    result = attention_bench.attention(repeats, quick=True)
  elif part == "train":
    result = {"suites": [{"size": size, "seq": seq, "window": seq // 4,
                          "rows": train_bench.train(size, seq, 0, repeats, compile_together=True)}
                         for size, seq in sizes]}
  elif part == "profile":
    size, seq = sizes[-1]
    config = train_bench.fitted(train_bench.row_config(size, seq, seq // 4, train_bench.ROWS.index("+ Pallas"),
                                                       platform == "gpu"))
    result = {"size": size, "seq": seq, "row": "+ Pallas",
              **profile_bench.profile_step(config, 3, os.path.join(out, "step_trace.json.gz"))}
    print("\n".join(profile_bench.table(result)))
  elif part == "checkpoint":
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
      checkpoint_bench.checkpoint(hidden_dim=1024 if platform == "gpu" else 128, repeats=2)
    result = {"lines": printed.getvalue().strip().splitlines()}
    print(printed.getvalue())
  else:
    result = {"impls": run_training(run_steps, timeout_s=PLAN_S["run"] * 3)}
    for impl, r in result["impls"].items():
      print(impl, r["returncode"], r["seconds"], "s", r.get("losses") or r.get("stderr", "")[-1000:])
  return result


def run_part_limited(part: str, out: str, limit_s: float, flags: list[str]) -> dict:
  """One part in a child process (`--budget_s=0`, its own check in DIR/<part>/), killed at
  `limit_s`: its result, or what cut it short and the tail of its log (DIR/<part>.log)."""
  log_path = os.path.join(out, f"{part}.log")
  command = [sys.executable, "-m", "megajax.launch.bench", "gpu", f"--out={os.path.join(out, part)}",
             f"--parts={part}", "--budget_s=0", *flags]
  with open(log_path, "w") as log:
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
      process.wait(timeout=limit_s)
      cut = None
    except subprocess.TimeoutExpired:
      os.killpg(process.pid, signal.SIGKILL)    # the part and whatever it started (pytest's workers)
      process.wait()
      cut = f"cut at its limit of {limit_s:.0f} s"
  tail = open(log_path, errors="replace").read().splitlines()[-40:]
  print("\n".join(tail), flush=True)
  for artefact in ("step_trace.json.gz",):    # what a part keeps beside the check (profile's trace)
    if os.path.exists(os.path.join(out, part, artefact)):
      os.replace(os.path.join(out, part, artefact), os.path.join(out, artefact))
  check_path = os.path.join(out, part, "gpu_check.json")
  child = json.load(open(check_path)) if os.path.exists(check_path) else {"results": {}}
  result = child["results"].get(part)
  if result is not None and child.get("device"):
    result["device"] = child["device"]
  if result is None or cut:
    why = cut or f"exited {process.returncode} without a result"
    result = {**(result or {}), "error": why + "; the log's last lines:\n" + "\n".join(tail[-25:])}
  return result


def gpu_check(out: str, parts: str, repeats: int, train_sizes: str, run_steps: int, budget_s: float = BUDGET_S) -> None:
  wanted = [p for p in parts.split(",") if p]
  unknown = [p for p in wanted if p not in PARTS]
  if unknown or not wanted:
    raise SystemExit(f"--parts={parts!r}: choose from {','.join(PARTS)}")
  sizes = _train_sizes(train_sizes)
  if budget_s < 0:
    raise SystemExit(f"--budget_s={budget_s}: seconds for the whole check (0: no limits, in this process)")
  os.makedirs(out, exist_ok=True)
  platform = "gpu" if gpu_available() else "cpu"
  if platform != "gpu":
    print(f"note: no GPU here ({platform}): the check runs, but its figures are not GPU figures")
  # The device's name from jax only where this process uses jax itself: with a budget every part
  # runs in its own process (the name comes from their checks), and a spawning part leaves
  # the GPU to what it starts.
  uses_jax = not budget_s and any(part not in SPAWNING_PARTS for part in wanted)
  check = {"device": jax.devices()[0].device_kind if uses_jax else None, "platform": platform,
            "jax": jax.__version__, "parts": wanted, "budget_s": budget_s,
            "planned_s": {p: PLAN_S[p] for p in wanted}, "results": {}}
  if budget_s:
    print("plan: " + ", ".join(f"{p} {PLAN_S[p]} s" for p in wanted) + f"; budget {budget_s:.0f} s, each part "
          "its plan plus what the parts before it left", flush=True)
  flags = [f"--repeats={repeats}", f"--train_sizes={train_sizes}", f"--run_steps={run_steps}"]
  check_start, planned_so_far = time.time(), 0.0
  for part in wanted:
    start = time.time()
    print(f"\n== gpu check: {part}", flush=True)
    planned_so_far += PLAN_S[part]
    if budget_s:
      # Its plan plus the time the parts before it left unused, never past the whole budget.
      limit = min(planned_so_far, budget_s) - (start - check_start)
      if limit < 10:
        result = {"error": f"not run: {budget_s:.0f} s budget spent"}
      else:
        result = run_part_limited(part, out, limit, flags)
        result["limit_s"] = round(limit)
        check["device"] = check["device"] or result.pop("device", None)
    else:
      try:
        result = run_part(part, out, repeats, sizes, run_steps)
      except Exception as e:   # recorded, and the next part still runs
        result = {"error": "".join(traceback.format_exception(e))[-4000:]}
        print(result["error"], file=sys.stderr)
    result["seconds"] = round(time.time() - start, 1)
    check["results"][part] = result
    with open(os.path.join(out, "gpu_check.json"), "w") as f:
      json.dump(check, f, indent=1, default=str)
    with open(os.path.join(out, "gpu_check.md"), "w") as f:
      f.write(markdown(check))
  if budget_s:
    print("\n" + "\n".join(f"{p}: planned {PLAN_S[p]} s, took {r['seconds']} s"
                            + (" (not complete)" if "error" in r else "") for p, r in check["results"].items()))
    print(f"all parts: {time.time() - check_start:.0f} s of the {budget_s:.0f} s budget")
  print(f"\nwrote {out}/gpu_check.json and gpu_check.md")
