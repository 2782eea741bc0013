r"""megajax-train: train a model from a config file.

  megajax-train --config=configs/default.py --workdir=/tmp/run \
      --config.model.num_layers=4 --config.train.steps=500

Every knob is a config field (`--config.a.b=v`); the only other flags are the workdir and
the process topology for jax.distributed (auto-detected on SLURM / Open MPI / Kubernetes).
Mistakes in the config or flags end the run with one line on stderr and exit code 2,
before anything is compiled.
"""

import math
import os
import re
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from megajax import trainer
from megajax.checkpoint import CheckpointError
from megajax.config import ConfigError, default_config, validate
from megajax.launch.cluster import (TopologyError, expected_process_count, initialize_distributed,
                                   request_host_devices)
from megajax.launch.runtime import configure_runtime
from megajax.parallel import mesh_shape

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file (get_config()).",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory: metrics.jsonl, TensorBoard, params.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-process).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the job (multi-process).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index (multi-process).")
flags.mark_flags_as_required(["config", "workdir"])

# megajax's own source folders (megajax/, layers/, launch/, ... install as one namespace).
_OUR_DIRS = tuple(os.path.dirname(os.path.abspath(__import__(name, fromlist=["_"]).__file__)) + os.sep
                  for name in ("megajax", "megajax.layers", "megajax.parallel", "megajax.checkpoint",
                               "megajax.launch"))


class _QuietLibraries(logging.logging.Filter):
  """Keeps megajax's own INFO lines and every library's warnings; drops libraries' INFO chatter."""

  def filter(self, record):
    return record.levelno >= logging.logging.WARNING or record.pathname.startswith(_OUR_DIRS)


def _fail(kind: str, message) -> None:
  print(f"megajax-train: {kind}: {message}", file=sys.stderr)
  sys.exit(2)


def main(argv):
  logging.get_absl_handler().addFilter(_QuietLibraries())
  if len(argv) > 1:
    _fail("usage error", f"unexpected arguments: {' '.join(argv[1:])}")
  config = _CONFIG.value
  # Validate before jax.distributed (which can wait minutes for peers) or any compile.
  try:
    validate(config)
  except ConfigError as error:
    _fail("config error", error)
  # Before jax starts a backend: XLA / NCCL presets (GPU), the persistent compilation cache.
  configure_runtime(config, _WORKDIR.value)

  try:
    # A CPU-only machine gets as many host devices as this process's share of the mesh.
    request_host_devices(math.prod(mesh_shape(config)) // expected_process_count(_NUM_PROCESSES.value))
    initialize_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    # Data-dependent checks (token file, vocabulary, process count) run before the first compile.
    result = trainer.train(config, _WORKDIR.value)
  except TopologyError as error:
    _fail("topology error", error)
  except ConfigError as error:
    _fail("config error", error)
  except CheckpointError as error:
    _fail("checkpoint error", error)
  if result.preempted:
    logging.warning("stopped early (preempted); relaunch with the same --workdir to resume")
    sys.exit(143)                       # 128 + SIGTERM: the job did not finish
  if not result.history:
    logging.info("nothing to do: the checkpoint in %s is already at train.steps=%d", _WORKDIR.value,
                 config.train.steps)
    return
  last = result.history[-1]
  logging.info("done: step %d, loss %.4f; metrics in %s/metrics.jsonl", last["step"], last["loss"],
               _WORKDIR.value)


def parse_flags(argv):
  """absl's parser, but a flag mistake is one line naming it, not a usage dump or a traceback."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as error:
    _fail("flag error", " ".join(str(error).split()))
  except (AttributeError, KeyError) as error:  # config_flags on an unknown --config.a.b
    field = next((arg.split("=")[0] for arg in argv[1:] if arg.startswith("--config.")
                  and _not_a_field(arg.split("=")[0][len("--config."):])), "--config.?")
    suggestion = re.search(r'Did you mean "[^"]+"', str(error))
    hint = f" ({suggestion.group(0)}?)" if suggestion else ""
    _fail("config error", f"{field[2:]}: no such config field{hint}; see megajax/config.py for the fields")


def _not_a_field(dotted: str) -> bool:
  node = default_config()
  for name in dotted.split("."):
    if not hasattr(node, "keys") or name not in node:
      return True
    node = node[name]
  return False


def run():
  app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
  run()
