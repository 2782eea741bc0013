"""The command lines besides megajax-train, each run as a user would: megajax-schedule,
megajax-prepare-data, megajax-plan, megajax-diagnose's one-line error; XLA accepting every
preset flag (a new process reads XLA_FLAGS); and a fresh process importing the package."""

import os
import subprocess
import sys

import numpy as np
import pytest

from megajax import data
from megajax.launch import runtime
from tests.support.processes import run_module

VERSION = runtime.jaxlib_version()


def test_the_picture_command(tmp_path):
  out = tmp_path / "s.png"
  result = run_module(["-m", "megajax.launch.schedule", "--pp", "4", "--vpp", "2", "--microbatches", "8",
                       f"--out={out}"], timeout=120)
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
       f"--output={output}"], capture_output=True, text=True, timeout=60)
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
       "--noeos", f"--output={output}"], capture_output=True, text=True, timeout=60)
  assert result.returncode == 0, result.stderr
  assert data.decode_tokens(np.fromfile(output, dtype=np.uint16)) == "hello wörld\n"
  assert len(np.fromfile(output, dtype=np.uint16)) == len("hello wörld\n".encode("utf-8"))
  result = subprocess.run(
      [sys.executable, "-m", "megajax.launch.prepare_data", f"--input={tmp_path}/none*.txt",
       f"--output={output}"], capture_output=True, text=True, timeout=60)
  assert result.returncode == 2 and result.stderr.splitlines() == [
      f"megajax-prepare-data: input error: '{tmp_path}/none*.txt' matches no file"], result.stderr
  result = subprocess.run([sys.executable, "-m", "megajax.launch.prepare_data", f"--verify={output}"],
                          capture_output=True, text=True, timeout=60)
  assert result.returncode == 0 and result.stdout.startswith(f"{output}: ok: "), result.stderr


def test_plan_cli_prints_the_best_plan_with_its_bottleneck():
  result = run_module(["-m", "megajax.launch.plan", "--config=configs/gpt_175b.py", "--gpus=12288",
                       "--hardware=a100-80g", "--batch=6144", "--top=3"], timeout=120)
  print(result.stdout)
  assert result.returncode == 0, result.stderr
  lines = result.stdout.splitlines()
  header = next(i for i, line in enumerate(lines) if "bottleneck" in line)
  assert lines[header + 1].split()[0] == "1" and "compute" in lines[header + 1]
  assert lines[-1].startswith("best: dp=")


@pytest.mark.parametrize("flags, flag", [(["--gpus=12288", "--hardware=a200"], "--hardware=a200"),
                                         (["--gpus=12290"], "--gpus=12290"),
                                         (["--gpus=8", "--batch=64"], "--gpus=8")])
def test_plan_cli_bad_input_is_one_line_naming_the_flag(flags, flag):
  result = run_module(["-m", "megajax.launch.plan", "--config=configs/gpt_175b.py", *flags], timeout=120)
  assert result.returncode == 2
  error = result.stderr.strip().splitlines()
  assert len(error) == 1 and flag in error[0] and "; " in error[0], result.stderr


def test_config_error_is_one_line_and_exit_2():
  result = run_module(["-m", "megajax.launch.diagnose", "--config=configs/default.py", "--config.parallel.tp=3"],
                      timeout=120)
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
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 0 and "3.0" in result.stdout, result.stderr[-2000:]


def test_importing_megajax_leaves_no_global_trace():
  """A fresh process that imports the package and every library in it: no jax event listener
  registered, no XLA backend started (the trainer counts compiles only while it trains)."""
  code = ("from jax._src import monitoring, xla_bridge\n"
          "import megajax, megajax.trainer, megajax.observe, megajax.checkpoint, megajax.launch.cli\n"
          "import megajax.parallel.planner.calibration, megajax.launch.supervisor, megajax.launch.bench.pipeline\n"
          "print(len(monitoring.get_event_listeners()), xla_bridge.backends_are_initialized())\n")
  result = run_module(["-c", code], timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.split() == ["0", "False"]
