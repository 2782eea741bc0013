r"""megajax-report: one static HTML page that summarizes a training run.

  megajax-report /tmp/run      # writes /tmp/run/report/index.html and its PNG figures

The page (megajax.observe.report) reads metrics.jsonl (required), incidents.jsonl,
traces/analysis/ and activations.jsonl; a missing one leaves its section as a line naming
what would produce it. A missing workdir or metrics.jsonl is one line and exit code 2.
"""

from absl import app

from megajax.launch.cli import fail, flags_parser
from megajax.observe.report import missing_input, write_report

PROGRAM = "megajax-report"


def main(argv):
  if len(argv) != 2:
    fail(PROGRAM, "usage error", "expected one argument, the run's workdir: megajax-report WORKDIR")
  problem = missing_input(argv[1])
  if problem:
    fail(PROGRAM, "missing input", problem)
  print(f"report written to {write_report(argv[1])}")


def run():
  app.run(main, flags_parser=flags_parser(PROGRAM))


if __name__ == "__main__":
  run()
