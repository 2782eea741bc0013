r"""megajax-train: train a model from a config file.

  megajax-train --config=configs/default.py --workdir=/tmp/run \
      --config.model.num_layers=4 --config.train.steps=500

Every knob is a config field (`--config.a.b=v`); the only other flags are the workdir and
the process topology for jax.distributed (auto-detected on SLURM / Open MPI / Kubernetes).
Mistakes in the config or flags end the run with one line on stderr and exit code 2,
before anything is compiled. So does a run whose updates are skipped to the end (non-finite
loss or gradients: `non-finite error`), or that stays non-finite after rolling back as far
as it can: the same data and config would fail the same way, so the supervisor does not retry.
"""

import faulthandler
import inspect
import signal
import sys

from absl import app
from absl import flags
from absl import logging

from megajax import trainer
from megajax.checkpoint import CheckpointError
from megajax.config import ConfigError
from megajax.launch import cli
from megajax.launch.cli import (QuietLibraries, define_config_flag, define_topology_flags, fail, flags_parser,
                                join_job, validated_config)
from megajax.launch.cluster import TopologyError
from megajax.launch.runtime import configure_runtime
from megajax.trainer.workdir import WorkdirError, check_workdir

_CONFIG = define_config_flag()
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory: metrics.jsonl, TensorBoard, params.")
_COORDINATOR, _NUM_PROCESSES, _PROCESS_ID = define_topology_flags()
flags.mark_flags_as_required(["config", "workdir"])
flags.adopt_module_key_flags(cli)     # --config (and the topology flags) in this command's --help


def _fail(kind: str, message) -> None:
  fail("megajax-train", kind, message)


class _NoTracebacks(logging.logging.Filter):
  """A logged exception keeps its message and loses its traceback (kept with --verbosity=1):
  Orbax logs a save that failed in its background threads from three of them, a traceback
  each, and megajax-train then reports the failure once, as one line. (megajax itself logs
  no tracebacks.)"""

  def filter(self, record):
    if record.exc_info and logging.get_verbosity() < logging.DEBUG:
      record.exc_info = record.exc_text = None
    return True


def _quiet_abandoned_io() -> None:
  """Drops the echoes of Orbax I/O abandoned after a failure. A restore or save that fails
  returns at its first error and closes its asyncio event loop: tensorstore's reads and writes
  still in flight then complete into the closed loop ("Event loop is closed", a traceback each
  through sys.unraisablehook: 73 for one unreadable checkpoint), their futures and tasks are
  collected with errors nobody retrieved or still pending (asyncio logs each), and coroutines
  left unfinished are destroyed as Python exits. The failure itself is reported once;
  anything else still shows."""
  def hook(unraisable):
    error = unraisable.exc_value
    closed_loop = isinstance(error, RuntimeError) and str(error) == "Event loop is closed"
    left_at_exit = sys.is_finalizing() and inspect.iscoroutine(unraisable.object)
    if not (closed_loop or left_at_exit):
      sys.__unraisablehook__(unraisable)
  sys.unraisablehook = hook
  # asyncio's words for them: "<Future | Task | _GatheringFuture> exception was never retrieved",
  # "Task was destroyed but it is pending!" (a message, then the object on the next line).
  logging.logging.getLogger("asyncio").addFilter(
      lambda record: not str(record.msg).split("\n", 1)[0].endswith(("exception was never retrieved",
                                                                    "was destroyed but it is pending!")))


def main(argv):
  logging.get_absl_handler().addFilter(QuietLibraries())
  logging.get_absl_handler().addFilter(_NoTracebacks())
  _quiet_abandoned_io()
  # `kill -USR1 <pid>` prints every thread's Python stack to stderr and training goes on: what a
  # hung worker is doing (the supervisor sends it before stopping a hung job).
  faulthandler.register(signal.SIGUSR1, all_threads=True)
  # Validated before jax.distributed (which can wait minutes for peers) or any compile.
  config = validated_config("megajax-train", argv, _CONFIG)
  # The workdir before anything is made in it (the compilation cache's setting below would
  # only warn): a file, or a directory this process cannot write, is one line here.
  try:
    check_workdir(_WORKDIR.value)
  except WorkdirError as error:
    _fail("workdir error", error)
  # Before jax starts a backend: XLA / NCCL presets (GPU), the persistent compilation cache.
  configure_runtime(config, _WORKDIR.value)

  try:
    join_job(config, _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    # Data-dependent checks (token file, vocabulary, process count) run before the first compile.
    result = trainer.train(config, _WORKDIR.value)
  except TopologyError as error:
    _fail("topology error", error)
  except ConfigError as error:
    _fail("config error", error)
  except CheckpointError as error:
    _fail("checkpoint error", error)
  except WorkdirError as error:
    _fail("workdir error", error)
  except trainer.NonFiniteError as error:
    _fail("non-finite error", error)
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


parse_flags = flags_parser("megajax-train")


def run():
  app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
  run()
