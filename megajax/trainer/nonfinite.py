"""The non-finite loss policy around the step, and the heartbeat's step counter.

The step skips an update whose loss, gradient norm or learning rate is not finite (the state
passes through unchanged: megajax.parallel.ParallelStep). Here each step's skip flag is read
one step late (while the next step runs, so the loop never stalls on it): after
`train.nonfinite_rollback_after` skips in a row the state itself is suspect, and the run
rolls back to the latest checkpoint (or the initial state) while the data reads on past the
failed batches. A save first reads its own step's flag; none is written inside a run of
skips, so a checkpoint is always a good state to roll back to, and a resume from it repeats
the uninterrupted run exactly.

Nothing loops and nothing ends "done" that is not: a rollback with no update applied since the
previous one goes further back (the checkpoint before, then the initial state), and one with
nowhere further to go stops the run (NonFiniteError); so does a run that ends inside a run of
skipped updates (every update skipped, a learning rate of inf, a data fault to the end). Its
state would be an older one under the last step's name, so no checkpoint is saved and no
parameters are exported: the launcher exits 2 with one line (the same data and config fail
the same way, so there is nothing to retry).
"""

from __future__ import annotations

import time

from absl import logging
import jax

from megajax.checkpoint import TrainingCheckpointer
from megajax.trainer.callbacks import Callback, Loop


class NonFiniteError(Exception):
  """The run cannot end with finite updates: every one skipped to the end, or after rolling
  back as far as there is to go (one line, for the launcher)."""


class NonFiniteGuard(Callback):

  def __init__(self, train, checkpointer: TrainingCheckpointer | None):
    self.train, self.checkpointer = train, checkpointer      # the train section
    self.skipped, self.in_a_row, self.rollbacks = 0, 0, 0   # in_a_row: since the last applied update or rollback
    self.skipping_since = None              # first step of the current run of skipped updates (None: the last applied)
    self.rolled_back_to = None              # the step rolled back to (0: the initial state), until an update applies
    self.tried = []                         # the states rolled back to since the last applied update (for the error)
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
    """Refuses to end inside a run of skipped updates (a preempted run is not ending: it resumes)."""
    self.flush(loop)
    if self.skipping_since is None or loop.preempted:
      return
    which = ("every update of this run" if self.skipping_since == loop.start_step + 1 else
             f"every update from step {self.skipping_since} to the end")
    rolled = f", after rolling back to {', '.join(self.tried)}" if self.tried else ""
    raise NonFiniteError(f"{which} was skipped (steps {self.skipping_since}-{loop.step}: non-finite loss, gradients "
                         f"or parameters{rolled}): the run is not done, nothing saved or exported for those steps; "
                         "check the data and the optimizer's hyperparameters")

  def _read(self, pending, loop: Loop) -> None:
    step, metrics = pending
    metrics = jax.device_get(metrics)       # waits for that step only
    loop.clock.finished(step)
    now = time.time()
    step_time = now - self.last_time if self.last_time else None
    self.last_time = now
    if int(metrics["skipped"]):
      self.skipped += 1
      self.in_a_row += 1
      self.skipping_since = self.skipping_since or step
      logging.warning("step %d: non-finite loss (%s) or gradients: update skipped (%d in a row, %d in all)",
                      step, float(metrics["loss"]), self.in_a_row, self.skipped)
    else:
      self.in_a_row, self.skipping_since, self.rolled_back_to, self.tried = 0, None, None, []
    loop.beat(step=step, loss=float(metrics["loss"]), step_time_s=step_time, skipped_steps=self.skipped)
    if self.in_a_row >= self.train.nonfinite_rollback_after:
      self._rollback(step, loop)

  def _rollback(self, step: int, loop: Loop) -> None:
    """To the latest checkpoint; if no update applied since the last rollback (that state fails
    too), to the checkpoint before the one rolled back to, then the initial state, then stop."""
    if self.rolled_back_to == 0:
      raise NonFiniteError(f"step {step}: every update was skipped after rolling back to {', '.join(self.tried)} "
                           f"(steps {self.skipping_since}-{step}: non-finite loss, gradients or parameters), and "
                           "there is no earlier state: check the data and the optimizer's hyperparameters")
    self.rollbacks += 1
    self.in_a_row, self.pending = 0, None   # the step in flight ran on the state being replaced
    restored = None
    loop.clock.lap("steps")
    loop.state = None                       # its buffers go before the restore's arrive (device memory)
    if self.checkpointer:
      self.checkpointer.wait()
      restored = self.checkpointer.restore_latest(loop.parallel_step, before=self.rolled_back_to)
    if restored is not None:
      loop.state, to_step = restored.state, restored.step
      self.tried.append(f"checkpoint {self.checkpointer.path(to_step)}")
    else:
      loop.state, to_step = loop.parallel_step.init_state(jax.random.key(self.train.seed)), 0
      self.tried.append("the initial state")
    self.rolled_back_to = to_step
    jax.block_until_ready(loop.state)
    loop.clock.lap("rollback")
    loop.clock.discarded(loop.step, to_step)       # the step in flight ran on the replaced state too
    logging.warning("step %d: %d non-finite steps in a row: rolled back to the state of step %d (rollback %d); "
                    "the data reads on", step, self.train.nonfinite_rollback_after, to_step, self.rollbacks)
    loop.beat(rollbacks=self.rollbacks, last_rollback={"step": step, "to_step": to_step, "time": time.time()})
