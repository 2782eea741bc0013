"""The non-finite loss policy around the step, and the heartbeat's step counter.

The step skips an update whose loss, gradients or new parameters are not finite (the state
passes through unchanged: megajax.parallel.ParallelStep). Here each step's skip flag is read
one step late (while the next step runs, so the loop never stalls on it): after
`train.nonfinite_rollback_after` skips in a row the state itself is suspect, and the run
rolls back to the latest checkpoint (or the initial state) while the data reads on past the
failed batches. A save first reads its own step's flag; none is written inside a run of
skips, so a checkpoint is always a good state to roll back to, and a resume from it repeats
the uninterrupted run exactly.
"""

from __future__ import annotations

import time

from absl import logging
import jax

from megajax.checkpoint import TrainingCheckpointer
from megajax.trainer.callbacks import Callback, Loop


class NonFiniteGuard(Callback):

  def __init__(self, config, checkpointer: TrainingCheckpointer | None):
    self.config, self.checkpointer = config, checkpointer
    self.skipped, self.in_a_row, self.rollbacks = 0, 0, 0
    self.pending = None                     # (step, metrics) not yet read
    self.last_time = None

  def after_step(self, loop: Loop) -> None:
    """Reads the previous step's flag (this one's runs meanwhile); a rollback, if due, replaces
    the state this step is computing from."""
    previous, self.pending = self.pending, (loop.step, {"loss": loop.metrics["loss"],
                                                        "skipped": loop.metrics["skipped"]})
    if previous:
      self._read(previous, loop)

  def flush(self, loop: Loop) -> None:
    """Reads the flag still pending (a save waits for its step anyway, as does the end)."""
    previous, self.pending = self.pending, None
    if previous:
      self._read(previous, loop)

  def on_end(self, loop: Loop) -> None:
    self.flush(loop)

  def _read(self, pending, loop: Loop) -> None:
    step, metrics = pending
    metrics = jax.device_get(metrics)       # waits for that step only
    now = time.time()
    step_time = now - self.last_time if self.last_time else None
    self.last_time = now
    if int(metrics["skipped"]):
      self.skipped += 1
      self.in_a_row += 1
      logging.warning("step %d: non-finite loss (%s) or gradients: update skipped (%d in a row, %d in all)",
                      step, float(metrics["loss"]), self.in_a_row, self.skipped)
    else:
      self.in_a_row = 0
    loop.beat(step=step, loss=float(metrics["loss"]), step_time_s=step_time, skipped_steps=self.skipped)
    if self.in_a_row >= self.config.train.nonfinite_rollback_after:
      self._rollback(step, loop)

  def _rollback(self, step: int, loop: Loop) -> None:
    self.rollbacks += 1
    self.in_a_row, self.pending = 0, None   # the step in flight ran on the state being replaced
    restored = None
    if self.checkpointer:
      self.checkpointer.wait()
      restored = self.checkpointer.restore_latest(loop.parallel_step)
    if restored is not None:
      loop.state, to_step = restored.state, restored.step
    else:
      loop.state, to_step = loop.parallel_step.init_state(jax.random.key(self.config.train.seed)), 0
    logging.warning("step %d: %d non-finite steps in a row: rolled back to the state of step %d (rollback %d); "
                    "the data reads on", step, self.config.train.nonfinite_rollback_after, to_step, self.rollbacks)
    loop.beat(rollbacks=self.rollbacks, last_rollback={"step": step, "to_step": to_step, "time": time.time()})
