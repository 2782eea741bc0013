r"""Draw a pipeline schedule: an ASCII timeline in the log and, with --out, a PNG.

  python -m megajax.launch.schedule --pp 4 --vpp 2 --microbatches 8 --out s.png
  python -m megajax.launch.schedule --pp 4 --microbatches 8 --schedule=gpipe
  python -m megajax.launch.schedule --pp 4 --vpp 2 --microbatches 8 --paired --out e.png
"""

import sys

from absl import app
from absl import flags

from megajax.config import SCHEDULE_CHOICES, TRAVERSAL_CHOICES
from megajax.parallel.pipeline import schedule as schedules

_PP = flags.DEFINE_integer("pp", 4, "Pipeline stages p.")
_VPP = flags.DEFINE_integer("vpp", 1, "Virtual stages (model chunks) per stage v.")
_MICROBATCHES = flags.DEFINE_integer("microbatches", 8, "Microbatches m per step.")
_SCHEDULE = flags.DEFINE_enum("schedule", None, SCHEDULE_CHOICES,
                              "Default: interleaved_1f1b when --vpp > 1, else 1f1b.")
_TRAVERSAL = flags.DEFINE_enum("traversal", "depth_first", TRAVERSAL_CHOICES, "MegaDPP traversal policy.")
_OUT = flags.DEFINE_string("out", None, "PNG file to write.")
_PAIRED = flags.DEFINE_bool("paired", False, "Draw the executor's ticks (forward slot | backward slot).")


def main(argv):
  del argv
  name = _SCHEDULE.value or ("interleaved_1f1b" if _VPP.value > 1 else "1f1b")
  try:
    timeline = schedules.simulate(name, _PP.value, _VPP.value, _MICROBATCHES.value, _TRAVERSAL.value)
  except ValueError as error:
    print(f"megajax-schedule: {error}", file=sys.stderr)
    sys.exit(2)
  print(schedules.ascii_timeline(timeline))
  print(schedules.ascii_paired_timeline(timeline))
  print(f"bubble: {timeline.bubble_ticks} idle ticks per stage = {timeline.bubble_fraction:.4f} of ideal; "
        f"microbatch-chunks in flight per stage: {schedules.in_flight(timeline)}")
  if _OUT.value:
    schedules.render_png(timeline, _OUT.value, paired=_PAIRED.value)
    print(f"picture written to {_OUT.value}")


def run():
  app.run(main)


if __name__ == "__main__":
  run()
