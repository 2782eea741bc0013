"""The worker: the training loop and its collaborators.

  loop.py       train(config, workdir): named sections, each one call; the loop itself
  callbacks.py  the loop's one protocol (Callback, called at fixed points of every step) and
                the small collaborators: tracing, activation capture, start-up log,
                preemption, metrics log, checkpointing
  nonfinite.py  the non-finite loss policy: skip, then roll back (further back, then stop)
  evaluation.py held-out evaluation: every train.eval_every steps and at the end; evaluate() (megajax-eval)
  drills.py     every fault the config can inject (debug.*)
  heartbeat.py  this process's heartbeat file, and the supervisor's reader of them
  workdir.py    the workdir's checks and its lock: one training job per workdir
"""

from megajax.trainer.loop import TrainResult, build_model, build_parallel_step, train
from megajax.trainer.workdir import WorkdirError
from megajax.trainer.nonfinite import NonFiniteError

__all__ = ["NonFiniteError", "TrainResult", "WorkdirError", "build_model", "build_parallel_step", "train"]
