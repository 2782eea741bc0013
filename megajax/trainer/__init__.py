"""The worker: the training loop and its collaborators.

  loop.py       train(config, workdir): named sections, each one call; the loop itself
  callbacks.py  the loop's one protocol (Callback, called at fixed points of every step) and
                the small collaborators: tracing, activation capture, start-up log,
                preemption, metrics log, checkpointing
  nonfinite.py  the non-finite loss policy: skip, then roll back
  drills.py     every fault the config can inject (debug.*)
  heartbeat.py  this process's heartbeat file, and the supervisor's reader of them
"""

from megajax.trainer.loop import TrainResult, build_model, build_parallel_step, train

__all__ = ["TrainResult", "build_model", "build_parallel_step", "train"]
