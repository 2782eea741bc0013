r"""megajax-scope: MegaScope's explorer of a trained run, a page on this machine.

  megajax-scope --workdir=/tmp/run [--port=8470]

Reads the run as megajax-sample does (WORKDIR/config.json, params/ or the latest checkpoint,
the tokenizer), serves the page on http://127.0.0.1:PORT/ (this machine only; --host opens
another interface) and prints its URL. Type a prompt and watch the model decode it token by
token: top-k of each step, attention per layer and head, Q/K/V / attention / MLP / residual
heatmaps, the residual stream's PCA across layers; perturb a layer and compare the two
decodes; read the run's training-time captures (activations.jsonl). A run that cannot be
opened is said on stderr and on the page. Ctrl-C stops it. docs/scope.md has the tour.
"""

from absl import app
from absl import flags
from absl import logging

from megajax.launch.cli import QuietLibraries, fail, flags_parser
from megajax.launch.scope.server import HOST, serve

PROGRAM = "megajax-scope"
_WORKDIR = flags.DEFINE_string("workdir", None, "The run's workdir (config.json, params/ or checkpoints/).")
_PORT = flags.DEFINE_integer("port", 8470, "The port to serve on (0: any free one).")
_HOST = flags.DEFINE_string("host", HOST, "The interface to serve on: 127.0.0.1, this machine only (the default).")
flags.mark_flags_as_required(["workdir"])


def main(argv):
  logging.get_absl_handler().addFilter(QuietLibraries())
  if len(argv) > 1:
    fail(PROGRAM, "usage error", f"unexpected arguments: {' '.join(argv[1:])}")
  if not 0 <= _PORT.value < 65536:
    fail(PROGRAM, "flag error", f"--port={_PORT.value}: not a port; use 1 .. 65535, or 0 for any free one")
  try:
    serve(_WORKDIR.value, _PORT.value, _HOST.value, announce=lambda line: print(line, flush=True))
  except OSError as error:
    fail(PROGRAM, "flag error", f"--host={_HOST.value} --port={_PORT.value}: cannot listen there ({error.strerror}); "
                                "pick a free port, or --port=0")


def run():
  app.run(main, flags_parser=flags_parser(PROGRAM))


if __name__ == "__main__":
  run()
