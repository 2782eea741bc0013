r"""megajax-goodput: where a job's wall time went, across its restarts (the goodput ledger).

  megajax-goodput /tmp/run          # the table: each cause's seconds and share, the effective
                                    # training time ratio with MegaScale's formula, the attempts
  megajax-goodput /tmp/run --json   # the same as one JSON object

It reads WORKDIR/goodput/ (each run's record, the supervisor's events: megajax.observe.goodput,
goodput_ledger). A missing workdir or one with no run recorded is one line and exit code 2.
"""

import dataclasses
import json
import os

from absl import app
from absl import flags

from megajax.launch.cli import fail, flags_parser
from megajax.observe.goodput_ledger import format_table, job_ledger

PROGRAM = "megajax-goodput"
_JSON = flags.DEFINE_bool("json", False, "print the ledger as one JSON object")


def main(argv):
  if len(argv) != 2:
    fail(PROGRAM, "usage error", "expected one argument, the job's workdir: megajax-goodput WORKDIR")
  workdir = argv[1]
  if not os.path.isdir(workdir):
    fail(PROGRAM, "missing input", f"{workdir}: no such directory")
  book = job_ledger(workdir)
  if book is None:
    fail(PROGRAM, "missing input", f"{workdir}/goodput/ holds no run's record: train there first (megajax-train or "
                                   "megajax-supervise with --workdir)")
  if _JSON.value:
    print(json.dumps({**dataclasses.asdict(book), "ratio": book.ratio, "iteration_s": book.iteration_s}, indent=1))
  else:
    print(format_table(book))


def run():
  app.run(main, flags_parser=flags_parser(PROGRAM))


if __name__ == "__main__":
  run()
