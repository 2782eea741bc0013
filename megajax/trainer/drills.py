"""Fault drills: every fault the config can inject (`debug.*`), in one place.

Each drill is off by default and makes a training job fail the way a real fault would, so
the tests (and an operator rehearsing) can check that what should notice it does:

  debug.nonfinite_steps="7,8,9"   those steps' batches get a NaN loss mask, as a corrupt batch
                                  would: the non-finite guard skips, then rolls back
  debug.fail_at_step=n            SIGKILL after step n (on debug.fail_process, -1: every
                                  process), as a crash would: resume, the supervisor's restart;
                                  with debug.fail_mode=hang SIGSTOP instead, as a host that
                                  stops answering would: its heartbeat goes silent while the
                                  others wait in the next step's collectives (hang detection)
  debug.slow_rank="dp,pp,cp,tp"   that rank runs debug.slow_rank_work extra matmuls per step
                                  (from debug.slow_rank_from_step), as a slow GPU would:
                                  megajax-trace's straggler detection ("dp,pp,tp": cp 0)
  debug.diagnose_slow_process=i   megajax-diagnose measures process i at a quarter of its
                                  speed, as a bad host would: the supervisor's elastic continue
"""

from __future__ import annotations

import os
import signal
from typing import Callable

import jax
from jax import lax
import jax.numpy as jnp

from megajax.parallel import collectives
from megajax.parallel.mesh import MESH_AXES, to_varying
from megajax.trainer.callbacks import Callback, Loop
from megajax.trainer.heartbeat import supervisor_attempt


class PoisonedBatches(Callback):
  """debug.nonfinite_steps: those steps' batches get a NaN loss mask (first in the list: the
  batch is poisoned before any other callback sees the step)."""

  def __init__(self, debug):
    self.steps = {int(x) for x in debug.nonfinite_steps.split(",") if x.strip()}

  def before_step(self, loop: Loop) -> None:
    if loop.step in self.steps:
      loop.batch = {**loop.batch, "loss_mask": loop.batch["loss_mask"] * float("nan")}


# debug.fail_mode -> the signal the process sends itself.
FAIL_SIGNALS = {"kill": signal.SIGKILL, "hang": signal.SIGSTOP}


class FailAtStep(Callback):
  """debug.fail_at_step: SIGKILL (or, debug.fail_mode=hang, SIGSTOP) after that step, on
  debug.fail_process (-1: every process); last in the list, after that step's checkpoint.
  At a step, not at a moment: the drill lands where it should however fast the steps run.
  The heartbeat is written first, so that it names the steps done as a host's that had been
  beating all along would (the beat thread may not have written since the start-up, and a
  worker whose beats show no step yet is judged by the start-up deadline, not the heartbeat's).
  So is the goodput record, with this step finished: the ledger's redone steps are then the
  steps the restart runs again (a real kill loses at most the step the guard has not read).
  Once per job: a supervisor's restart (MEGAJAX_ATTEMPT > 0) runs clean, as after a real fault."""

  def __init__(self, debug):
    d = debug
    self.after = d.fail_at_step if supervisor_attempt() == 0 and d.fail_process in (-1, jax.process_index()) else 0
    self.signal = FAIL_SIGNALS[d.fail_mode]

  def after_step(self, loop: Loop) -> None:
    if self.after and loop.step == self.after and not loop.preempted:
      if loop.heartbeat:
        loop.heartbeat.write()
      jax.block_until_ready(loop.metrics)
      loop.clock.finished(loop.step)
      loop.clock.flush()
      os.kill(os.getpid(), self.signal)


def slow_rank_coords(slow_rank: str) -> tuple[int, int, int, int]:
  """debug.slow_rank's (dp, pp, cp, tp): "dp,pp,cp,tp" (MESH_AXES' order), or "dp,pp,tp" at cp 0."""
  coords = tuple(int(x) for x in slow_rank.split(","))
  return (*coords[:2], 0, coords[2]) if len(coords) == 3 else coords


def straggler_work(debug, model) -> Callable | None:
  """debug.slow_rank as the 3D step's `extra_work` (ParallelStep.build), or None when off.

  From step debug.slow_rank_from_step on, that rank alone runs slow_rank_work extra
  [hidden, hidden] matmuls over its tokens under the "forward" scope, as a slow GPU would
  take longer for the same forward. A scalar that depends on the work (XLA keeps it); 0
  elsewhere. One compiled program before and after the step it starts at."""
  if not debug.slow_rank:
    return None
  coords = slow_rank_coords(debug.slow_rank)
  hidden, vocab = model.hidden_dim, model.vocab_size
  rounds, from_step = debug.slow_rank_work, debug.slow_rank_from_step

  @jax.named_scope("forward")
  def extra_work(batch, step):
    here = step >= from_step
    for axis, index in zip(MESH_AXES, coords):
      here = here & (collectives.axis_index(axis) == index)
    weight = jnp.full((hidden, hidden), 1.0 / hidden, jnp.float32)
    tokens = to_varying(batch["inputs"], MESH_AXES)     # the branches' results vary like `here`

    def work(tokens):
      x = jnp.broadcast_to(tokens[..., None].astype(jnp.float32) / vocab, (*tokens.shape, hidden))
      x = lax.fori_loop(0, rounds, lambda _, x: jnp.tanh(x @ weight), x)
      return jnp.mean(x)

    return lax.cond(here, work, lambda tokens: jnp.mean(tokens * 0.0), tokens)
  return extra_work


def diagnose_slowed(debug, process: int) -> bool:
  """debug.diagnose_slow_process: does megajax-diagnose run this process's device measurements
  slowed (each timed run then sleeps until it took diagnostics.DRILL_SLOWDOWN x as long)?
  Collectives are never slowed."""
  return debug.diagnose_slow_process == process
