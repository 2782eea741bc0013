"""megajax-export-hf and megajax-import-hf as a user runs them: a run's workdir (as
megajax-train leaves it: config.json, params/) exported to a sharded Hugging Face directory,
an occupied --out refused in one line; the directory imported and trained from, on the
default config's file with a one-device mesh: the converted parameters are the exported ones
bit for bit and the first step's loss is theirs on that batch; a model field the HF config
contradicts is one line, exit code 2."""

import os

import jax
import numpy as np
import pytest

import megajax
from megajax import data
from megajax.checkpoint import load_params, save_params
from megajax.config import default_config, read_run_config
from tests.support import config_flags
from tests.support.processes import run_module
from tests.support.records import metrics

MODEL = {"norm": "rmsnorm", "mlp": "swiglu", "block": "serial", "use_bias": False, "num_layers": 2, "hidden_dim": 32,
         "num_heads": 4, "num_kv_heads": 2, "seq_len": 32, "vocab_size": 64, "compute_dtype": "float32"}
ONE_DEVICE = {"parallel.dp": 1, "parallel.pp": 1, "parallel.tp": 1, "parallel.virtual_stages": 1,
              "parallel.schedule": "1f1b", "train.microbatches": 1, "train.batch_size": 4, "train.steps": 1,
              "train.log_every": 1, "optimizer.warmup_steps": 0, "model.compute_dtype": "float32"}


def test_export_a_run_then_import_it_and_train_from_its_weights(tmp_path):
  config = default_config()
  config.model.update(MODEL)
  model = megajax.build_model(config)
  shapes = jax.eval_shape(lambda: megajax.init_params(model, jax.random.key(0)))
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda s: (0.1 * rng.standard_normal(s.shape)).astype(np.float32), shapes)
  run, hf, tuned = tmp_path / "run", tmp_path / "hf", tmp_path / "tuned"
  run.mkdir()
  (run / "config.json").write_text(config.to_json(indent=2))
  save_params(str(run / "params"), params)

  export = ["-m", "megajax.launch.export_hf", f"--workdir={run}", f"--out={hf}", "--max_shard_size=40KB"]
  result = run_module(export)
  assert result.returncode == 0, result.stderr[-2000:]
  lines = result.stdout.splitlines()
  assert lines[0] == f"wrote {hf}: LlamaForCausalLM from {run}/params, tokenizer bytes"
  assert lines[1] == "format native: LlamaForCausalLM holds it exactly"
  files = sorted(os.listdir(hf))
  assert [line.split()[0] for line in lines[2:]] == files
  assert {"config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
          "tokenizer_config.json", "model-00001-of-00004.safetensors"} <= set(files)
  result = run_module(export)
  assert result.returncode == 2 and result.stderr.splitlines() == [
      f"megajax-export-hf: output error: {hf}: exists and is not an empty directory; pass a new --out"]

  command = ["-m", "megajax.launch.import_hf", f"--hf={hf}", "--config=configs/default.py", f"--workdir={tuned}"]
  result = run_module([*command, *config_flags({**ONE_DEVICE, "model.num_layers": 3})])
  assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr[-2000:]
  assert result.stderr.startswith(f"megajax-import-hf: cannot import: model.num_layers=3 (given) conflicts with "
                                  f"{hf}/config.json, which makes model.num_layers=2")
  result = run_module([*command, *config_flags(ONE_DEVICE)])
  assert result.returncode == 0, result.stderr[-3000:]
  imported = load_params(str(tuned / "hf_import" / "params"))
  assert jax.tree.structure(imported) == jax.tree.structure(params)
  assert all(np.array_equal(np.asarray(a), b) for a, b in zip(jax.tree.leaves(imported), jax.tree.leaves(params)))
  assert (tuned / "tokenizer" / "hf.tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
  trained = read_run_config(str(tuned))
  assert (trained.model.norm, trained.model.num_kv_heads, trained.model.window) == ("rmsnorm", 2, 0)
  assert trained.train.init_params == str(tuned / "hf_import" / "params")
  batch = next(data.make_iterator(trained, 0, 1))
  _, stats = megajax.make_loss_fn(megajax.build_model(trained))(params, batch)
  first = next(r for r in metrics(tuned) if "loss" in r)
  assert first["step"] == 1 and first["loss"] == pytest.approx(float(stats["loss"]), rel=1e-5)


def test_the_default_model_exports_with_its_own_code_and_native_is_refused_naming_the_field(tmp_path):
  """The default job's model (parallel block, local and global layers): megajax-export-hf says
  it writes megajax's own code and why; --format=native is one line naming the field, exit 2."""
  config = default_config()
  config.model.update({"num_layers": 2, "hidden_dim": 32, "num_heads": 4, "seq_len": 32, "window": 8,
                       "window_pattern": "LG", "vocab_size": 64})
  model = megajax.build_model(config)
  shapes = jax.eval_shape(lambda: megajax.init_params(model, jax.random.key(0)))
  run, hf = tmp_path / "run", tmp_path / "hf"
  run.mkdir()
  (run / "config.json").write_text(config.to_json(indent=2))
  save_params(str(run / "params"), jax.tree.map(lambda s: np.full(s.shape, 0.01, np.float32), shapes))
  result = run_module(["-m", "megajax.launch.export_hf", f"--workdir={run}", f"--out={hf}"])
  assert result.returncode == 0, result.stderr[-2000:]
  lines = result.stdout.splitlines()
  assert lines[0] == f"wrote {hf}: MegajaxForCausalLM from {run}/params, tokenizer bytes"
  assert lines[1].startswith("format remote: no native architecture holds it: model.window=8") and lines[1].endswith(
      "load it with AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)")
  assert {"modeling_megajax.py", "configuration_megajax.py"} <= set(os.listdir(hf))
  result = run_module(["-m", "megajax.launch.export_hf", f"--workdir={run}", f"--out={tmp_path}/native",
                       "--format=native"])
  assert result.returncode == 2 and result.stderr.splitlines() == [
      "megajax-export-hf: cannot export: model.window=8 (window_pattern='LG'): GPT-NeoX has every layer global "
      "(model.window=0)"]
  assert not os.path.exists(tmp_path / "native")
