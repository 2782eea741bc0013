r"""megajax-local: a real multi-process JAX job on one machine (CPU devices, gloo collectives).

  megajax-local --processes 2 --devices-per-process 4 -- \
      --config=configs/default.py --workdir=/tmp/run --config.parallel.dp=2 --config.parallel.tp=4

Starts `megajax-train <flags>` (or `--module`) once per process with --coordinator_address
(a free port on 127.0.0.1), --num_processes and --process_id, each process seeing
`--devices-per-process` CPU devices (megajax.launch.supervisor.jobs.LocalJob): the same code
path as a multi-host GPU job, for development and tests. Output lines are prefixed with the
process index. When one process fails, the others are stopped (they would wait for it in
their next collective); the exit code is the first failing process's. SIGINT / SIGTERM are
passed on to every process.
"""

import signal
import sys

from absl import app
from absl import flags

from megajax.launch.supervisor.jobs import LocalJob

_PROCESSES = flags.DEFINE_integer("processes", 2, "Processes in the job.")
_DEVICES = flags.DEFINE_integer("devices_per_process", 4, "CPU devices each process sees.")
_MODULE = flags.DEFINE_string("module", "megajax.launch.train", "The Python module every process runs.")


def main(argv):
  job = LocalJob(_MODULE.value, argv[1:], _PROCESSES.value, _DEVICES.value)
  handler = lambda signum, frame: job.signal(signum)  # noqa: E731  (pass it on; the workers save and stop)
  signal.signal(signal.SIGINT, handler)
  signal.signal(signal.SIGTERM, handler)
  sys.exit(job.wait())


def run():
  # Everything after `--` belongs to the workers; absl parses only what comes before.
  argv = sys.argv
  if "--" in argv:
    split = argv.index("--")
    ours, theirs = argv[:split], argv[split + 1:]
  else:
    ours, theirs = argv, []
  ours = [arg.replace("--devices-per-process", "--devices_per_process") for arg in ours]
  app.run(main, argv=ours, flags_parser=lambda a: [*flags.FLAGS(a)[:1], *theirs])


if __name__ == "__main__":
  run()
