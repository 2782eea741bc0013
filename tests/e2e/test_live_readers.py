"""Readers against a running trainer: megajax-eval, -sample and -export-hf, run over and over
while a job saves every 2 steps (and removes old checkpoints: checkpoint.keep=2), leave it
exactly as it would have been: its losses, checkpoints and final parameters bit for bit those
of the same job run undisturbed beside it."""

import json
import os
import subprocess
import sys

from tests.support import REPO
from tests.support.processes import HANG_S, child_env, run_module, wait_until
from tests.support.records import metrics

# A small one-device job (one layer, global: GPT-NeoX exports it) whose steps take a while
# (debug.slow_rank: extra matmuls that change no value), so that the readers meet it mid-run:
# saves in flight, old checkpoints removed.
LIVE_JOB = ["-m", "megajax.launch.train", "--config=configs/default.py", "--config.parallel.dp=1",
            "--config.parallel.pp=1", "--config.parallel.tp=1", "--config.model.hidden_dim=32",
            "--config.model.seq_len=32", "--config.model.num_layers=1", "--config.model.window=0",
            "--config.model.window_pattern=G",
            "--config.model.num_kv_heads=8", "--config.train.steps=40", "--config.optimizer.warmup_steps=2",
            "--config.train.log_every=1", "--config.checkpoint.every_steps=2", "--config.checkpoint.keep=2",
            "--config.debug.slow_rank=0,0,0", "--config.debug.slow_rank_work=800"]
ROUNDS = 3     # of the three readers, at most (fewer when the job ends first)


def _readers(workdir, round_):
  return {"eval": ["-m", "megajax.launch.eval", f"--workdir={workdir}", "--batches=1"],
          "sample": ["-m", "megajax.launch.sample", f"--workdir={workdir}", "--prompt=hi", "--max_new_tokens=4",
                     "--temperature=0"],
          "export": ["-m", "megajax.launch.export_hf", f"--workdir={workdir}", f"--out={workdir}.hf{round_}"]}


def _checksums(workdir) -> dict:
  """Every kept checkpoint's array checksums (its meta) and params/' (Orbax's step metadata)."""
  checkpoints = os.path.join(workdir, "checkpoints")
  found = {}
  for name in sorted(os.listdir(checkpoints)):
    with open(os.path.join(checkpoints, name, "meta", "metadata")) as f:
      found[name] = json.load(f)["checksums"]
  with open(os.path.join(workdir, "params", "_CHECKPOINT_METADATA")) as f:
    found["params"] = json.load(f)["custom_metadata"]["megajax_checksums"]
  return found


def test_readers_leave_a_running_job_bitwise_as_it_would_have_been(tmp_path):
  hammered, undisturbed = tmp_path / "hammered", tmp_path / "undisturbed"
  logs = {name: open(tmp_path / f"{name}.log", "w+") for name in ("hammered", "undisturbed")}
  start = lambda name: subprocess.Popen([sys.executable, *LIVE_JOB, f"--workdir={tmp_path / name}"], cwd=REPO,
                                        env=child_env(), stdout=subprocess.DEVNULL, stderr=logs[name], text=True)
  jobs = {"hammered": start("hammered")}
  try:
    wait_until(lambda: (hammered / "checkpoints" / "2").is_dir(), "its first checkpoint", jobs["hammered"])
    # The undisturbed twin starts once the first has compiled (it reads the programs from the
    # persistent compilation cache instead of compiling them a second time beside it).
    jobs["undisturbed"] = start("undisturbed")
    met_it_running = 0
    for round_ in range(ROUNDS):
      if jobs["hammered"].poll() is not None:
        break
      for name, args in _readers(hammered, round_).items():
        running = jobs["hammered"].poll() is None
        result = run_module(args)
        assert result.returncode == 0, f"{name} (round {round_}): {result.stderr[-2000:]}"
        met_it_running += running and jobs["hammered"].poll() is None
    for name, job in jobs.items():
      job.wait(timeout=HANG_S)
      logs[name].seek(0)
      assert job.returncode == 0, f"{name}: {logs[name].read()[-3000:]}"
  finally:
    for job in jobs.values():
      job.kill()
      job.wait()
  print(f"{met_it_running} reader runs began and ended while the job ran")
  losses = lambda workdir: [(r["step"], r["loss"]) for r in metrics(workdir) if "loss" in r]
  assert losses(hammered) == losses(undisturbed) and len(losses(hammered)) == 40
  assert _checksums(hammered) == _checksums(undisturbed)
  assert sorted(os.listdir(hammered / "checkpoints")) == ["38", "40"]     # nothing quarantined, nothing left over
