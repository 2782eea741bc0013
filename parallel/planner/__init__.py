"""The 3D-parallelism planner: a cost model of one training step, its calibration, the search.

  cost_model.py   step time / MFU of a plan (dp, pp, tp, v, microbatch) on a device type, and its
                  parameters leaf by leaf; `Calibration`, the fitted step-time constants, a plain value
  operations.py   one layer's operations timed one by one (GEMMs by shape, attention, memory-bound
                  kernels) for the step time
  hardware.py     the devices and links: datasheets and published micro-benchmarks, each cited
  memory.py       per-device memory of a plan, its constants fitted to XLA's buffer assignment
  plans.py        every plan that divides evenly, the ones that fit, best predicted MFU first
  explain.py      plans a user can read: legend, memory and time by part, why #1 wins, --explain
  fits.py         the trainer's check before anything compiles: does a config fit its devices
  published.py    published A100 runs with their sources: the calibration set (MegaScale's Table 3)
                  and the validation set (MegaScale's Table 2, Korthikanti et al., Narayanan et al.)
  calibration.py  the least-squares fit of Calibration to the calibration set, leave-one-out,
                  the validation table, and the memory model checked against XLA's memory
                  analysis of the real compiled step

The command line is `megajax-plan` (megajax.launch.plan); `python -m megajax.launch.bench
planner` prints the fit, the tables and the memory check.
"""

from megajax.parallel.planner.cost_model import (CALIBRATION, HARDWARE, MEGASCALE, MEGATRON, Calibration, Hardware,
                                                 Optimizations, Plan)
from megajax.parallel.planner.plans import Candidate, assess, enumerate_plans, search

__all__ = ["CALIBRATION", "Calibration", "Candidate", "HARDWARE", "Hardware", "MEGASCALE", "MEGATRON",
           "Optimizations", "Plan", "assess", "enumerate_plans", "search"]
