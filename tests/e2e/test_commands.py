"""The command lines besides megajax-train, each run as a user would: megajax-schedule,
megajax-prepare-data, megajax-plan, megajax-eval, megajax-goodput, megajax-diagnose's one-line error; XLA accepting every
preset flag (a new process reads XLA_FLAGS); and a fresh process importing the package."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pyarrow
import pyarrow.parquet
import pytest

from megajax import data
from megajax.launch import runtime
from megajax.trainer.evaluation import evaluate, held_out_batches
from tests.support import SMALL_MESH, config_flags
from tests.support.checkpoints import PARAMS_DAMAGES, restore_latest
from tests.support.processes import HANG_S, run_module
from tests.support.records import metrics

VERSION = runtime.jaxlib_version()


def test_the_picture_command(tmp_path):
  out = tmp_path / "s.png"
  result = run_module(["-m", "megajax.launch.schedule", "--pp", "4", "--vpp", "2", "--microbatches", "8",
                       f"--out={out}"])
  assert result.returncode == 0, result.stderr[-2000:]
  assert "stage 0:  F0a  F1a  F2a  F3a  F0b" in result.stdout
  assert "bubble: 6 idle ticks per stage = 0.1875 of ideal" in result.stdout
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_prepare_data_cli_end_to_end(tmp_path):
  (tmp_path / "a.txt").write_text("hello wörld\n", encoding="utf-8")
  (tmp_path / "b.txt").write_text("second file", encoding="utf-8")
  output = str(tmp_path / "out" / "corpus.bin")
  result = subprocess.run(
      [sys.executable, "-m", "megajax.launch.prepare_data", f"--input={tmp_path}/*.txt",
       f"--output={output}"], capture_output=True, text=True, timeout=HANG_S)
  assert result.returncode == 0, result.stderr
  expected = np.concatenate([data.encode_text("hello wörld\n"), [data.EOS],
                             data.encode_text("second file"), [data.EOS]])
  assert f"wrote {len(expected)} tokens" in result.stdout
  assert (f"--config.data.source=tokens --config.data.path={output} "
          f"--config.model.vocab_size=257") in result.stdout
  source = data.TokenFileSource(output, seq_len=len(expected) - 1)
  np.testing.assert_array_equal(source[0], expected)
  # --noeos drops the separators; --verify checks a file; a glob matching nothing is one line, exit 2.
  result = subprocess.run(
      [sys.executable, "-m", "megajax.launch.prepare_data", f"--input={tmp_path}/a.txt",
       "--noeos", f"--output={output}"], capture_output=True, text=True, timeout=HANG_S)
  assert result.returncode == 0, result.stderr
  assert data.decode_tokens(np.fromfile(output, dtype=np.uint16)) == "hello wörld\n"
  assert len(np.fromfile(output, dtype=np.uint16)) == len("hello wörld\n".encode("utf-8"))
  result = subprocess.run(
      [sys.executable, "-m", "megajax.launch.prepare_data", f"--input={tmp_path}/none*.txt",
       f"--output={output}"], capture_output=True, text=True, timeout=HANG_S)
  assert result.returncode == 2 and result.stderr.splitlines() == [
      f"megajax-prepare-data: input error: '{tmp_path}/none*.txt' matches no file"], result.stderr
  result = subprocess.run([sys.executable, "-m", "megajax.launch.prepare_data", f"--verify={output}"],
                          capture_output=True, text=True, timeout=HANG_S)
  assert result.returncode == 0 and result.stdout.startswith(f"{output}: ok: "), result.stderr


def _prepare(*args):
  return subprocess.run([sys.executable, "-m", "megajax.launch.prepare_data", *args], capture_output=True, text=True,
                        timeout=HANG_S)


def test_prepare_data_trains_a_bpe_over_jsonl_and_parquet_the_same_for_any_worker_count(tmp_path):
  docs = [f"row {i}: " + "the quick brown fox jumps over the lazy dog " * (i % 5 + 1) for i in range(40)]
  (tmp_path / "a.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in docs[:20]))
  pyarrow.parquet.write_table(pyarrow.table({"body": docs[20:]}), tmp_path / "b.parquet")
  outputs = []
  for workers in (1, 2):
    output = str(tmp_path / f"w{workers}" / "corpus.bin")
    result = _prepare(f"--input={tmp_path}/a.jsonl", f"--input={tmp_path}/b.parquet", "--text-field=body",
                      "--train-tokenizer=bpe", "--vocab-size=300", f"--workers={workers}", f"--output={output}")
    assert result.returncode == 0, result.stderr
    meta = json.loads(open(output[:-4] + ".json").read())
    assert meta["num_documents"] == 40 and meta["tokenizer"]["file"] == "corpus.tokenizer.json"
    assert f"40 documents, {meta['num_tokens']} tokens in " in result.stdout and "tokens/s" in result.stdout
    assert (f"train with: --config.data.source=tokens --config.data.path={output} "
            f"--config.model.vocab_size={meta['vocab_size']}") in result.stdout
    assert _prepare(f"--verify={output}").returncode == 0
    outputs.append([open(output[:-4] + suffix, "rb").read() for suffix in (".bin", ".idx", ".json")])
  assert outputs[0] == outputs[1]


def test_own_corpus_journey_bpe_then_packed_training_with_held_out_eval(tmp_path):
  """A user's corpus end to end: prepare with a trained BPE, train on it (packed documents,
  5 of its documents held out, evaluated in the loop), then megajax-eval on the saved run and
  megajax-sample from it. The run logs its data, carries the tokenizer in its workdir, and
  writes eval records."""
  words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
  rng = np.random.default_rng(0)
  for i in range(4):
    docs = [" ".join(rng.choice(words, size=int(rng.integers(20, 120)))) for _ in range(30)]
    (tmp_path / f"part{i}.txt").write_text("\n\n".join(docs))
  output = str(tmp_path / "corpus.bin")
  result = _prepare(f"--input={tmp_path}/part*.txt", "--documents=blank_line", "--train-tokenizer=bpe",
                    "--vocab-size=300", f"--output={output}")
  assert result.returncode == 0, result.stderr
  vocab = json.loads(open(output[:-4] + ".json").read())["vocab_size"]
  workdir = tmp_path / "run"
  overrides = {**SMALL_MESH, "model.vocab_size": vocab, "model.seq_len": 64, "train.batch_size": 8, "train.microbatches": 2, "train.steps": 4,
               "data.source": "tokens", "data.path": output, "data.eval_fraction": 0.1, "train.eval_every": 2,
               "train.eval_batches": 2, "checkpoint.every_steps": 0, "optimizer.warmup_steps": 1}
  result = run_module(["-m", "megajax.launch.train", "--config=configs/default.py", f"--workdir={workdir}",
                       *config_flags(overrides)])
  assert result.returncode == 0, result.stderr[-3000:]
  assert re.search(rf"data: tokens from {re.escape(output)}; tokenizer huggingface, vocab {vocab}; [\d,]+ training "
                   r"tokens in \d+ documents \(data.eval_fraction=0.1 held out\); document masking on", result.stderr)
  assert open(workdir / "tokenizer" / "corpus.tokenizer.json").read() == open(output[:-4] + ".tokenizer.json").read()
  evals = [r for r in metrics(workdir) if "eval_loss" in r]
  assert [r["step"] for r in evals] == [2, 4] and all(np.isfinite(r["eval_loss"]) for r in evals)
  result = run_module(["-m", "megajax.launch.eval", f"--workdir={workdir}"])
  assert result.returncode == 0, result.stderr[-3000:]
  printed = float(re.search(r"eval_loss=([\d.]+)", result.stdout).group(1))   # 6 significant digits
  assert abs(printed - evals[-1]["eval_loss"]) <= 1e-5 * evals[-1]["eval_loss"], (result.stdout, evals[-1])
  # Then a sample in the run's own vocabulary: the prompt, and the new text after it.
  result = run_module(["-m", "megajax.launch.sample", f"--workdir={workdir}", "--prompt=alpha beta",
                       "--max_new_tokens=12", "--temperature=0", "--chunk=4"])
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.startswith("alpha beta") and len(result.stdout.strip()) > len("alpha beta"), result.stdout
  assert f"sampling from {workdir}/params" in result.stderr


@pytest.mark.parametrize("flags, line", [
    (["--tokenizer=bytes", "--train-tokenizer=bpe", "--vocab-size=300"],
     "usage error: pass --tokenizer or --train-tokenizer, not both"),
    (["--train-tokenizer=bpe", "--vocab-size=100"], "tokenizer error: --vocab-size=100: a byte-level BPE needs 258"),
    (["--tokenizer=missing/tokenizer.json"], "tokenizer error: no tokenizer file missing/tokenizer.json"),
    (["--documents=lines"], "usage error: --documents=lines: one of file, blank_line"),
])
def test_prepare_data_bad_flags_are_one_line(tmp_path, flags, line):
  (tmp_path / "a.txt").write_text("text")
  result = _prepare(f"--input={tmp_path}/a.txt", f"--output={tmp_path}/o.bin", *flags)
  assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
  assert result.stderr.startswith(f"megajax-prepare-data: {line}"), result.stderr
  assert sorted(os.listdir(tmp_path)) == ["a.txt"]


def test_plan_cli_prints_the_best_plan_with_its_bottleneck():
  result = run_module(["-m", "megajax.launch.plan", "--config=configs/gpt_175b.py", "--gpus=12288",
                       "--hardware=a100-80g", "--batch=6144", "--top=3"])
  print(result.stdout)
  assert result.returncode == 0, result.stderr
  lines = result.stdout.splitlines()
  header = next(i for i, line in enumerate(lines) if line.startswith(" #") and "bottleneck" in line)
  assert lines[header + 1].split()[0] == "1" and "compute" in lines[header + 1]
  assert lines[header + 2].strip().startswith("memory state ") and "; time compute " in lines[header + 2]
  assert any(line.strip().startswith("#1 over this: ") for line in lines)        # why #1 beats #2 and #3
  assert any(line.startswith("legend: ") for line in lines)
  assert any(line.startswith("executor megajax: ") and "--executor=paper" in line for line in lines)
  assert any(line.startswith("note: remat full") and "--remat=dots" in line for line in lines)   # the config's, not the papers'
  assert lines[-1].startswith("best: dp=")


def test_plan_cli_explains_one_plan():
  """--explain=dp,pp,tp,v,b: the paper's own 175B plan at 256 GPUs, accounted part by part
  (--runtime, --executor's earlier name, still works)."""
  result = run_module(["-m", "megajax.launch.plan", "--config=configs/gpt_175b.py", "--gpus=256", "--batch=768",
                       "--megatron", "--runtime=paper", "--explain=4,8,8,6,1"])
  print(result.stdout)
  assert result.returncode == 0, result.stderr
  out = result.stdout
  assert "plan dp=4 pp=8 tp=8 v=6 b=1 m=192 on 256 a100-80g" in out and ": fits" in out
  for part in ("state", "activations", "gemm", "tp-comm", "bubble", "dp-comm", "TFLOP/s per GPU"):
    assert part in out, part


@pytest.mark.parametrize("flags, flag", [(["--gpus=12288", "--hardware=a200"], "--hardware=a200"),
                                         (["--gpus=12290"], "--gpus=12290"),
                                         (["--gpus=8", "--batch=64"], "--gpus=8"),
                                         (["--gpus=256", "--batch=768", "--explain=8,4,8"], "--explain=8,4,8"),
                                         (["--gpus=256", "--batch=768", "--explain=8,4,8,5,1"], "--explain=8,4,8,5,1"),
                                         (["--gpus=8", "--compile"], "--hardware=a100-80g"),
                                         (["--gpus=3", "--hardware=h100-80g", "--compile"], "--gpus=3"),
                                         (["--gpus=8", "--hardware=h100-80g", "--compile", "--config.parallel.cp=2",
                                           "--config.model.window=512"], "dp x pp x cp x tp = 128"),
                                         (["--gpus=8", "--fbd_forward=a100:8"], "--fbd_forward=a100:8"),
                                         (["--gpus=8", "--fbd_forward=a100-80g:x"], "--fbd_forward=a100-80g:x")])
def test_plan_cli_bad_input_is_one_line_naming_the_flag(flags, flag):
  result = run_module(["-m", "megajax.launch.plan", "--config=configs/gpt_175b.py", *flags])
  assert result.returncode == 2
  error = result.stderr.strip().splitlines()
  assert len(error) == 1 and flag in error[0] and "; " in error[0], result.stderr


def test_plan_cli_plans_megafbd_on_a_mixed_cluster():
  """--fbd_forward: the forward on A100s beside the H100s' backward, against the H100s alone
  (the docs' worked example, docs/parallelism.md): with remat full FBD wins, with dots (more
  residuals over the NICs) it loses; either way said in one verdict line, with the overrides."""
  verdicts = {}
  for remat in ("full", "dots"):
    result = run_module(["-m", "megajax.launch.plan", "--config=configs/gpt_1p3b.py", "--hardware=h100-80g", "--gpus=8",
                         "--batch=128", "--fbd_forward=a100-80g:32", f"--remat={remat}", "--top=2"])
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert any(line.split()[:2] == ["1", "forward"] and "backward 8 h100-80g" in line for line in lines), result.stdout
    verdicts[remat] = next(line for line in lines if line.startswith("MegaFBD "))
    assert any(line.startswith("overrides: --config.parallel.fbd.enabled=True") for line in lines)
    assert any(line.startswith("note: this plan spans 5 hosts") for line in lines)
  assert verdicts["full"].startswith("MegaFBD beats the 8 h100-80g alone"), verdicts
  assert verdicts["dots"].startswith("MegaFBD does not beat the 8 h100-80g alone"), verdicts


def test_plan_cli_compiles_the_configs_plan_for_h100s_without_a_gpu():
  """--compile: the config's own plan (dp=2 here) compiled by XLA's GPU compiler on this CPU
  machine: XLA's bytes per device, the planner's beside them, the fit and the overlap."""
  result = run_module(["-m", "megajax.launch.plan", "--config=configs/default.py", "--gpus=2", "--hardware=h100-80g",
                       "--compile", "--config.parallel.dp=2", "--config.parallel.pp=1", "--config.parallel.tp=1"])
  assert result.returncode == 0, result.stderr[-2000:]
  out = result.stdout
  assert "dp=2 pp=1 tp=1" in out and "on 2 h100-80g, compiled without a GPU" in out
  assert "XLA " in out and "of XLA's" in out and "fits     yes" in out
  assert "reduce-scatter dp 1/1" in out, out


def test_eval_cli_evaluates_the_latest_checkpoint(two_checkpoints):
  """megajax-eval on a saved run: one line with the step of its latest checkpoint and the
  held-out loss the eval step gives in process on the same parameters and batches."""
  workdir, config, parallel_step = two_checkpoints
  result = run_module(["-m", "megajax.launch.eval", f"--workdir={workdir}", "--batches=2"])
  assert result.returncode == 0, result.stderr[-2000:]
  fields = dict(item.split("=") for item in result.stdout.strip().splitlines()[-1].split())
  assert fields["step"] == "6" and fields["batches"] == "2"
  assert int(fields["tokens"]) == 2 * config.train.batch_size * config.model.seq_len
  config.train.eval_batches = 2
  params = restore_latest(workdir, config, parallel_step).state.params
  want = evaluate(parallel_step.eval_step(), params, held_out_batches(config, parallel_step)(), parallel_step.put_batch)
  assert float(fields["eval_loss"]) == pytest.approx(want["eval_loss"], rel=1e-5)
  assert float(fields["eval_perplexity"]) == pytest.approx(np.exp(want["eval_loss"]), rel=1e-5)


@pytest.mark.parametrize("args,error", [
    (["--batches=0"], "megajax-eval: config error: train.eval_batches=0: must be a positive integer"),
    (["--data=held_out.bin"], "megajax-eval: config error: data.eval_path='held_out.bin': set while "
                              "data.source='synthetic'"),
    (["stray"], "megajax-eval: usage error: unexpected arguments: stray"),
], ids=["batches", "data", "usage"])
def test_eval_cli_bad_input_is_one_line_and_exit_2(two_checkpoints, args, error):
  workdir, _, _ = two_checkpoints
  result = run_module(["-m", "megajax.launch.eval", f"--workdir={workdir}", *args])
  assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr[-2000:]
  assert result.stderr.startswith(error), result.stderr


def test_eval_cli_without_a_checkpoint_says_what_is_missing(tmp_path):
  result = run_module(["-m", "megajax.launch.eval", f"--workdir={tmp_path}"])
  assert result.returncode == 2 and result.stderr.strip().splitlines() == [
      f"megajax-eval: missing input: {tmp_path}/checkpoints: no checkpoint; train with checkpoints first "
      "(megajax-train saves every checkpoint.every_steps and at the end)"], result.stderr


def test_config_error_is_one_line_and_exit_2():
  result = run_module(["-m", "megajax.launch.diagnose", "--config=configs/default.py", "--config.parallel.tp=3"])
  assert result.returncode == 2
  assert result.stderr.strip().startswith("megajax-diagnose: config error: ")
  assert len(result.stderr.strip().splitlines()) == 1


def test_every_preset_flag_exists_in_this_jaxlib_and_xla_accepts_them():
  kept, dropped = runtime.xla_flags_for(True, VERSION, "")
  assert dropped == [] and len(kept) == len(runtime.GPU_PRESET)
  # XLA parses XLA_FLAGS (GPU flags too) when the CPU client starts; an unknown one aborts.
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(XLA_FLAGS=" ".join(kept), JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-c", "import jax; print(jax.numpy.ones(3).sum())"], env=env,
                          capture_output=True, text=True, timeout=HANG_S)
  assert result.returncode == 0 and "3.0" in result.stdout, result.stderr[-2000:]


def test_importing_megajax_leaves_no_global_trace():
  """A fresh process that imports the package and every library in it: no jax event listener
  registered, no XLA backend started (the trainer counts compiles only while it trains), the
  garbage collector on and nothing left frozen (the import's objects stay collectable)."""
  code = ("import gc, sys\n"
          "from jax._src import monitoring, xla_bridge\n"
          "import megajax, megajax.trainer, megajax.observe, megajax.checkpoint, megajax.launch.cli\n"
          "import megajax.parallel.planner.calibration, megajax.launch.supervisor, megajax.launch.bench.pipeline\n"
          "print(len(monitoring.get_event_listeners()), xla_bridge.backends_are_initialized(), gc.isenabled(), "
          "gc.get_freeze_count(), 'wandb' in sys.modules)\n")
  result = run_module(["-c", code])
  assert result.returncode == 0, result.stderr[-2000:]
  # (wandb: imported by the trainer only when observe.wandb_project names a project)
  assert result.stdout.split() == ["0", "False", "True", "0", "False"]


def test_goodput_cli_prints_the_ledger_or_one_line(tmp_path):
  """megajax-goodput WORKDIR: the table with MegaScale's formula, --json, and one line with exit
  code 2 for a workdir that is not there or holds no run's record (a half-written one is skipped)."""
  (tmp_path / "goodput").mkdir()
  record = {"process_start": 5.0, "time": 9.0, "attempt": 0, "pid": 1, "start_step": 0, "last_step": 3,
            "rollbacks": [], "cache": {"hits": 0, "misses": 2}, "status": "finished",
            "seconds": {"start": 1.0, "steps": 3.0}}
  (tmp_path / "goodput" / "run-5000-1.json").write_text(json.dumps(record))
  (tmp_path / "goodput" / "run-6000-2.json").write_text('{"process_start": 9')      # killed mid-write
  table = run_module(["-m", "megajax.launch.goodput", str(tmp_path)])
  assert table.returncode == 0 and "= 3 x 1.0000 s / 4.00 s = 75.0%" in table.stdout, table.stderr[-2000:]
  as_json = json.loads(run_module(["-m", "megajax.launch.goodput", str(tmp_path), "--json"]).stdout)
  assert as_json["ratio"] == pytest.approx(0.75) and as_json["kept_steps"] == 3
  for workdir, problem in ((tmp_path / "nothing", "no such directory"), (tmp_path / "goodput", "no run's record")):
    missing = run_module(["-m", "megajax.launch.goodput", str(workdir)])
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1, missing.stderr
    assert problem in missing.stderr


def test_sample_cli_on_damaged_params_falls_back_or_is_one_line(two_checkpoints):
  """megajax-sample on a finished run whose params/ was damaged: the latest checkpoint that
  passes its checksums is read instead, with the warning on stderr (exit 0); with no
  checkpoint to fall back to, one line and exit 2, never a traceback."""
  workdir, _, _ = two_checkpoints
  PARAMS_DAMAGES["truncated_arrays"](workdir / "params")
  os.utime(workdir / "params")
  args = ["-m", "megajax.launch.sample", f"--workdir={workdir}", "--prompt=!", "--max_new_tokens=2"]   # "!": id 33, in the tiny vocabulary
  result = run_module(args)
  assert result.returncode == 0, result.stderr[-2000:]
  assert f"{workdir / 'params'}: unreadable parameters" in result.stderr and "Traceback" not in result.stderr
  assert "reading the latest checkpoint that passes its checksums instead" in result.stderr
  os.rename(workdir / "checkpoints", workdir / "elsewhere")
  result = run_module(args)
  assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr[-2000:]
  assert result.stderr.startswith(f"megajax-sample: checkpoint error: {workdir / 'params'}: unreadable parameters")
