r"""megajax-supervise: run a training job to the end through failures.

  megajax-supervise --config=configs/default.py --workdir=/shared/run \
      --config.supervisor.processes=2 --config.parallel.dp=2 --config.parallel.tp=4

Starts the workers (local processes, or `--config.supervisor.command='srun ... {train}'`),
watches their heartbeats in WORKDIR/heartbeats, and on a crash, a lost heartbeat or a hang
stops them all, prints the 3D hang view, runs megajax-diagnose, and restarts from the latest
checkpoint (on fewer hosts when one is bad and no spare is left), up to
supervisor.max_restarts times. Incidents go to WORKDIR/incidents.jsonl; worker logs (local)
to WORKDIR/logs. Exit code: 0 when training finished, otherwise the reason's.
"""

import sys

from absl import app
from absl import logging

from megajax.launch.cli import fail, flags_parser, validated_config
from megajax.launch.supervisor import Supervisor
# The same --config / --workdir flags as megajax-train's.
from megajax.launch.train import _CONFIG, _WORKDIR
from megajax.trainer.workdir import WorkdirError


def config_flag_args(argv: list[str]) -> list[str]:
  """The --config and --config.a.b flags of a command line, `--flag value` form included."""
  picked, take_next = [], False
  for arg in argv:
    if take_next:
      picked.append(arg)
      take_next = False
    elif arg == "--config" or arg.startswith("--config."):
      picked.append(arg)
      take_next = "=" not in arg
    elif arg.startswith("--config="):
      picked.append(arg)
  return picked


def main(argv):
  config = validated_config("megajax-supervise", argv, _CONFIG)
  # The workers get the same config flags, as given (the config file path and its overrides).
  # (supervisor.* stays with the supervisor: its command template is no worker's business).
  worker_args = [arg for arg in config_flag_args(sys.argv[1:]) if not arg.startswith("--config.supervisor.")]
  try:
    code = Supervisor(config, _WORKDIR.value, worker_args).run()
  except WorkdirError as error:     # a file, unwritable, or held by another supervisor or job
    fail("megajax-supervise", "workdir error", error)
  logging.info("supervisor: %s", "training finished" if code == 0 else f"stopping with exit code {code}")
  sys.exit(code)


def run():
  app.run(main, flags_parser=flags_parser("megajax-supervise"))


if __name__ == "__main__":
  run()
