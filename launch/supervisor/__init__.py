"""Robust training's driver side (MegaScale section 4); the worker side is megajax.trainer.

  driver.py       Supervisor: start the workers, watch their heartbeats, detect crashes, lost
                  heartbeats and hangs, stop, diagnose, restart (elastic continue, spares)
  jobs.py         what it starts and stops: LocalJob (processes on this machine) and
                  CommandJob (supervisor.command: srun, kubectl, mpirun)
  hang_view.py    the 3D hang view: suspects and victims on the (dp, pp, cp, tp) grid
  diagnostics.py  the diagnostic tests: per-device matmul and transfers, collectives, outliers

The commands are megajax-supervise, megajax-local and megajax-diagnose (megajax.launch).
"""

from megajax.launch.supervisor.driver import Supervisor, elastic_layout, fill_template
from megajax.launch.supervisor.jobs import CommandJob, LocalJob, free_port

__all__ = ["CommandJob", "LocalJob", "Supervisor", "elastic_layout", "fill_template", "free_port"]
