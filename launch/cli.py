"""What megajax's command-line tools share: one-line failures, absl flag parsing that names
the bad flag or config field, and joining the job (devices, jax.distributed)."""

from __future__ import annotations

import contextlib
import gc
import os
import re
import sys

from absl import flags
from absl import logging
from ml_collections import config_flags

import megajax.checkpoint
import megajax.config
import megajax.launch
import megajax.layers
import megajax.parallel
from megajax.config import ConfigError, default_config, validate
from megajax.config_checks import read_config_file
from megajax.launch.cluster import expected_process_count, initialize_distributed, request_host_devices
from megajax.launch.runtime import cpu_without_a_gpu
from megajax.sections import section

# megajax's own source folders (megajax/, layers/, launch/, ... install as one namespace).
_OUR_DIRS = tuple(os.path.dirname(os.path.abspath(module.__file__)) + os.sep
                  for module in (megajax.config, megajax.layers, megajax.parallel, megajax.checkpoint, megajax.launch))


def define_config_flag():
  """--config: the experiment's config file, fields overridable as --config.a.b=v (locked:
  an unknown field is an error). For a command's module level."""
  return config_flags.DEFINE_config_file("config", None, "Experiment config file (get_config()).", lock_config=True)


def define_topology_flags():
  """--coordinator_address, --num_processes, --process_id: joining a multi-process job by hand
  (all three, or none to auto-detect SLURM / Open MPI / Kubernetes). For a command's module level."""
  return (flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-process)."),
          flags.DEFINE_integer("num_processes", None, "Processes in the job (multi-process)."),
          flags.DEFINE_integer("process_id", None, "This process's index (multi-process)."))


class QuietLibraries(logging.logging.Filter):
  """Keeps megajax's own INFO lines and every library's warnings; drops libraries' INFO chatter."""

  def filter(self, record):
    return record.levelno >= logging.logging.WARNING or record.pathname.startswith(_OUR_DIRS)


def fail(program: str, kind: str, message) -> None:
  """`<program>: <kind>: <message>` on stderr, exit code 2 (nothing compiled, nothing to retry)."""
  print(f"{program}: {kind}: {message}", file=sys.stderr)
  sys.exit(2)


@contextlib.contextmanager
def one_line_errors(program: str, kinds: dict):
  """Inside: an exception of a class in `kinds` ({class: kind}, first match wins, as an except
  chain would) ends the program with `fail(program, kind, error)`; others pass through."""
  try:
    yield
  except tuple(kinds) as error:
    fail(program, next(kind for cls, kind in kinds.items() if isinstance(error, cls)), error)


def validated_config(program: str, argv: list[str], config_flag):
  """The --config flag's config, checked before anything starts; a stray argument or a bad
  field ends the program with one line."""
  if len(argv) > 1:
    fail(program, "usage error", f"unexpected arguments: {' '.join(argv[1:])}")
  config = config_flag.value
  try:
    validate(config)
  except ConfigError as error:
    fail(program, "config error", error)
  return config


def freeze_imported_objects() -> None:
  """Moves every object made so far out of the garbage collector's walks (gc.freeze): a
  command's imports (jax, flax, orbax, grain) made ~160,000 that it tracks, and they live as
  long as the process. Each later collection then walks only what the command made since."""
  gc.freeze()


def flags_parser(program: str):
  """absl's parser, but a flag mistake is one line naming it, not a usage dump or a traceback.
  The --config file is read first (megajax.config_checks.read_config_file): ml_collections
  would report its faults as tracebacks, or a missing get_config as an unknown field.
  Parsing is the first thing a command does after its imports: their objects are frozen
  then (freeze_imported_objects), and a machine without a GPU is told so before jax starts a
  backend (runtime.cpu_without_a_gpu)."""
  def parse(argv):
    freeze_imported_objects()
    cpu_without_a_gpu()
    path = config_file_arg(argv[1:]) if "config" in flags.FLAGS else None
    if path is not None:
      try:
        read_config_file(*path.split(":", 1))      # `file.py:argument`, as config_flags splits it
      except ConfigError as error:
        fail(program, "config error", error)
    try:
      return flags.FLAGS(argv)
    except flags.Error as error:
      fail(program, "flag error", " ".join(str(error).split()))
    except (AttributeError, KeyError) as error:  # config_flags on an unknown --config.a.b
      field = next((arg.split("=")[0] for arg in argv[1:] if arg.startswith("--config.")
                    and _not_a_field(arg.split("=")[0][len("--config."):])), "--config.?")
      suggestion = re.search(r'Did you mean "[^"]+"', str(error))
      hint = f" ({suggestion.group(0)}?)" if suggestion else ""
      fail(program, "config error", f"{field[2:]}: no such config field{hint}; see megajax/config.py for the fields")
  return parse


def config_file_arg(args: list[str]) -> str | None:
  """The value of --config (`--config=FILE` or `--config FILE`; the last one, as absl takes it)
  in a command line, or None."""
  value = None
  for arg, following in zip(args, [*args[1:], None]):
    if arg.startswith("--config="):
      value = arg[len("--config="):]
    elif arg == "--config" and following is not None:
      value = following
  return value


def _not_a_field(dotted: str) -> bool:
  node = default_config()
  for name in dotted.split("."):
    if not hasattr(node, "keys") or name not in node:
      return True
    node = node[name]
  return False


def join_job(config, coordinator_address: str | None, num_processes: int | None, process_id: int | None) -> str:
  """This process's devices and its place in the job: on a CPU-only machine, as many host
  devices as its share of the mesh (before jax starts a backend); then jax.distributed when
  this is a multi-process job. Raises TopologyError when the topology is incomplete."""
  request_host_devices(section(config, "parallel").device_count // expected_process_count(num_processes))
  return initialize_distributed(coordinator_address, num_processes, process_id)
