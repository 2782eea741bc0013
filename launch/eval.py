r"""megajax-eval: the held-out loss of a saved run.

  megajax-eval --workdir=/tmp/run [--data=held_out.bin] [--batches=8]

Reads the run's config (WORKDIR/config.json) and its latest checkpoint that passes its
checksums (WORKDIR/checkpoints), builds the run's 3D step on this machine's devices (the
run's mesh; one device when there are fewer than that: the restore reshards) and prints one
line:

  step=6 eval_loss=3.1416 eval_perplexity=23.14 tokens=4096 batches=8

--data is the held-out token file (data.eval_path; default: the run's own eval data,
data.eval_path or data.eval_fraction, or fresh records for synthetic data), --batches how many
batches of train.batch_size rows (train.eval_batches). Any bad input (workdir, config, data,
checkpoint) is one line on stderr and exit code 2. One process.
"""

import math
import os

from absl import app
from absl import flags
from absl import logging
import jax
import ml_collections

from megajax.checkpoint import CheckpointError, TrainingCheckpointer
from megajax.config import ConfigError, apply_overrides, read_run_config, validate
from megajax.launch.cli import QuietLibraries, fail, flags_parser
from megajax.launch.cluster import request_host_devices
from megajax.launch.runtime import configure_runtime
from megajax.data import token_file_paths
from megajax.sections import section
from megajax.tokenizer import check_run_identity
from megajax.trainer import build_parallel_step
from megajax.trainer.evaluation import evaluate, held_out_batches

PROGRAM = "megajax-eval"
_WORKDIR = flags.DEFINE_string("workdir", None, "The run's workdir (config.json, checkpoints/).")
_DATA = flags.DEFINE_string("data", None, "Held-out token file (.bin or .npy); default: the run's eval data.")
_BATCHES = flags.DEFINE_integer("batches", None, "Held-out batches to evaluate; default: train.eval_batches.")
flags.mark_flags_as_required(["workdir"])


def _overrides(config: ml_collections.ConfigDict) -> None:
  """--data and --batches onto the config (validated after)."""
  if _DATA.value is not None:
    apply_overrides(config, {"data.eval_path": _DATA.value, "data.eval_fraction": 0.0})
  if _BATCHES.value is not None:
    apply_overrides(config, {"train.eval_batches": _BATCHES.value})
  if config.data.source == "tokens" and not (config.data.get("eval_path") or config.data.get("eval_fraction")):
    raise ConfigError("data.eval_path", config.data.get("eval_path", ""), "the run has no held-out data "
                      "(neither data.eval_path nor data.eval_fraction)", "pass --data=FILE, a held-out token file")


def main(argv):
  logging.get_absl_handler().addFilter(QuietLibraries())
  if len(argv) > 1:
    fail(PROGRAM, "usage error", f"unexpected arguments: {' '.join(argv[1:])}")
  workdir = _WORKDIR.value
  if not os.path.isdir(workdir):
    fail(PROGRAM, "missing input", f"{workdir}: no such workdir; run megajax-train --workdir={workdir} first")
  checkpoints = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(checkpoints) or not any(name.isdigit() for name in os.listdir(checkpoints)):
    fail(PROGRAM, "missing input", f"{checkpoints}: no checkpoint; train with checkpoints first "
                                   "(megajax-train saves every checkpoint.every_steps and at the end)")
  try:
    config = read_run_config(workdir)
    _overrides(config)
    validate(config)
  except FileNotFoundError as error:
    fail(PROGRAM, "missing input", error)
  except (ConfigError, TypeError, ValueError) as error:   # TypeError, ValueError: a field of the wrong type
    fail(PROGRAM, "config error", error)

  # The run's mesh when this machine has its devices (a CPU-only one is given them, before jax
  # starts a backend), else one device: the restore converts the layout either way. A MegaFBD
  # run's state is a pp = 1 state: its backward group's dp x tp evaluates it with the 3D step.
  config.parallel.fbd.enabled = False
  size = math.prod(section(config, "parallel").mesh_shape)
  request_host_devices(size)
  configure_runtime(config, workdir)
  if len(jax.devices()) < size:
    logging.warning("%d devices, the run's mesh (dp, pp, tp) = %s needs %d: evaluating on one device",
                    len(jax.devices()), section(config, "parallel").mesh_shape, size)
    config.parallel.dp = config.parallel.pp = config.parallel.tp = config.parallel.virtual_stages = 1
  try:
    validate(config)
    parallel_step = build_parallel_step(config, jax.devices()[:math.prod(section(config, "parallel").mesh_shape)])
    for path in token_file_paths(config):    # ids read as the run trained on them (its recorded tokenizer)
      check_run_identity(workdir, path, "data.eval_path" if path == config.data.get("eval_path") else "data.path")
    batches = held_out_batches(config, parallel_step)   # a bad data file fails before any restore
    with TrainingCheckpointer(checkpoints, config, read_only=True) as checkpointer:   # its trainer may be running
      restored = checkpointer.restore_latest(parallel_step)
    if restored is None:
      fail(PROGRAM, "missing input", f"{checkpoints}: no checkpoint to restore")
    results = evaluate(parallel_step.eval_step(), restored.state.params, batches(), parallel_step.put_batch)
  except ConfigError as error:
    fail(PROGRAM, "config error", error)
  except ValueError as error:        # evaluate(): the held-out data gave no batch
    fail(PROGRAM, "data error", error)
  except CheckpointError as error:
    fail(PROGRAM, "checkpoint error", error)
  print(f"step={restored.step} eval_loss={results['eval_loss']:.6g} eval_perplexity={results['eval_perplexity']:.6g} "
        f"tokens={results['eval_tokens']} batches={results['eval_batches']}")


def run():
  app.run(main, flags_parser=flags_parser(PROGRAM))


if __name__ == "__main__":
  run()
