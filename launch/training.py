"""What megajax-train and megajax-import-hf share: the process's logging set-up, and a
training run from a validated config with each failure one line on stderr, exit code 2.

    prepare_process()                 # first thing in main(): quiet libraries, SIGUSR1 stacks
    run_training(PROGRAM, config, workdir, (coordinator_address, num_processes, process_id))
"""

import faulthandler
import inspect
import signal
import sys
from typing import Callable

from absl import logging
import jax

from megajax import trainer
from megajax.checkpoint import CheckpointError
from megajax.config import ConfigError
from megajax.launch.cli import QuietLibraries, fail, join_job, one_line_errors
from megajax.launch.cluster import TopologyError
from megajax.launch.runtime import configure_runtime
from megajax.observe.goodput_ledger import job_ledger
from megajax.trainer.workdir import WorkdirError, check_workdir


class NoTracebacks(logging.logging.Filter):
  """A logged exception keeps its message and loses its traceback (kept with --verbosity=1):
  Orbax logs a save that failed in its background threads from three of them, a traceback
  each, and megajax-train then reports the failure once, as one line. (megajax itself logs
  no tracebacks.)"""

  def filter(self, record):
    if record.exc_info and logging.get_verbosity() < logging.DEBUG:
      record.exc_info = record.exc_text = None
    return True


def quiet_abandoned_io() -> None:
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


def prepare_process() -> None:
  """Logging without library chatter or tracebacks; `kill -USR1 <pid>` prints every thread's
  Python stack to stderr and training goes on: what a hung worker is doing (the supervisor
  sends it before stopping a hung job)."""
  logging.get_absl_handler().addFilter(QuietLibraries())
  logging.get_absl_handler().addFilter(NoTracebacks())
  quiet_abandoned_io()
  faulthandler.register(signal.SIGUSR1, all_threads=True)


def run_training(program: str, config, workdir: str, topology: tuple = (None, None, None),
                 before_train: Callable[[], None] | None = None) -> None:
  """Trains `config` (validated) in `workdir`: the workdir checked, the runtime set up (XLA /
  NCCL presets, the compilation cache: before jax starts a backend), the job joined
  (`topology`: --coordinator_address, --num_processes, --process_id), `before_train()` (what
  needs the devices, e.g. writing the parameters train.init_params names), then
  megajax.trainer.train. Exits 2 with one line on a bad workdir, topology, config, checkpoint
  or non-finite run; 143 when preempted."""
  # The workdir before anything is made in it (the compilation cache's setting below would
  # only warn): a file, or a directory this process cannot write, is one line here.
  try:
    check_workdir(workdir)
  except WorkdirError as error:
    fail(program, "workdir error", error)
  configure_runtime(config, workdir)
  with one_line_errors(program, {TopologyError: "topology error", ConfigError: "config error",
                                 CheckpointError: "checkpoint error", WorkdirError: "workdir error",
                                 trainer.NonFiniteError: "non-finite error"}):
    join_job(config, *topology)
    if before_train is not None:
      before_train()
    # Data-dependent checks (token file, vocabulary, process count) run before the first compile.
    result = trainer.train(config, workdir)
  if result.preempted:
    logging.warning("stopped early (preempted); relaunch with the same --workdir to resume")
    sys.exit(143)                       # 128 + SIGTERM: the job did not finish
  if not result.history:
    logging.info("nothing to do: the checkpoint in %s is already at train.steps=%d", workdir, config.train.steps)
    return
  last = result.history[-1]
  logging.info("done: step %d, loss %.4f; metrics in %s/metrics.jsonl", last["step"], last["loss"], workdir)
  book = job_ledger(workdir) if workdir and jax.process_index() == 0 else None
  if book is not None:
    logging.info("goodput: effective training time ratio %.1f%% (%d steps x %.3f s / %.1f s of wall time, %d "
                 "run(s)); where the rest went: megajax-goodput %s", 100 * book.ratio, book.kept_steps,
                 book.iteration_s, book.wall_s, len(book.attempts), workdir)
