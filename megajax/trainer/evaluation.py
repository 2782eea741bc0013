"""Held-out evaluation: the 3D step's forward alone (ParallelStep.eval_step) over a finite set
of held-out batches, in the loop (train.eval_every, train.eval_batches) and for a saved run
(megajax-eval).

The held-out loss is the mean over every held-out token: the batches' summed cross-entropy
over their summed token count (not a mean of per-batch means, which would weigh a batch with
few unmasked tokens like a full one); the perplexity is its exp. Every evaluation reads the
same batches from the start (a fresh iterator over data.make_eval_dataset, made once), so the points of a run
compare with each other.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

from absl import logging
import jax
import numpy as np

from megajax import data
from megajax.parallel import ParallelStep, local_batch_slice
from megajax.trainer.callbacks import Callback, Loop


def evaluate(eval_fn, params, local_batches: Iterable[dict], put_batch: Callable) -> dict:
  """{"eval_loss", "eval_perplexity", "eval_tokens", "eval_batches"} of `params` over this
  process's rows of each held-out batch. `eval_fn` is ParallelStep.eval_step() (or it compiled);
  the batches are all dispatched before the first result is read."""
  sums = [eval_fn(params, put_batch(batch)) for batch in local_batches]
  if not sums:
    raise ValueError("no held-out batches to evaluate: the eval pass (data.make_eval_dataset) yielded none "
                     "(check data.eval_path / data.eval_fraction and train.eval_batches)")
  sums = jax.device_get(sums)
  nll = float(np.sum([s["eval_loss_sum"] for s in sums], dtype=np.float64))
  tokens = float(np.sum([s["eval_tokens"] for s in sums], dtype=np.float64))
  loss = nll / tokens if tokens else math.nan
  return {"eval_loss": loss, "eval_perplexity": math.exp(loss) if loss < 700 else math.inf,
          "eval_tokens": int(tokens), "eval_batches": len(sums)}


def held_out_batches(config, parallel_step: ParallelStep) -> Callable:
  """() -> a fresh pass over this process's rows of the train.eval_batches held-out batches.
  The dataset is made here, once: a bad eval file fails now, before the step compiles (not
  at the first evaluation, hours in), and no pass opens and checksums the files again."""
  dataset = data.make_eval_dataset(config, *local_batch_slice(parallel_step.mesh, config.train.batch_size))
  return lambda: iter(dataset)


class Evaluation(Callback):
  """train.eval_every: the held-out loss every eval_every steps and after the last one (not
  after a preemption: the run is asked to stop), into metrics.jsonl as records of their own
  ({"step", "eval_loss", "eval_perplexity", "eval_tokens", "eval_batches"}), TensorBoard and
  the progress line. Its program is compiled once, ahead of time, with the step's
  (`compile`, before the processes meet: megajax.trainer.loop._compile_and_meet)."""

  def __init__(self, every: int, parallel_step: ParallelStep, batches: Callable):
    self.every = every                  # train.eval_every
    self.parallel_step = parallel_step
    self.batches = batches              # () -> a fresh pass over this process's held-out batches
    self.compiled = None                # None: not compiled (no step left to run), nothing evaluated
    self.evaluated_step = None

  @classmethod
  def every_steps(cls, every: int, parallel_step: ParallelStep, eval_dataset) -> "Evaluation | None":
    """Every `every` steps (train.eval_every); None when it is 0 (nothing evaluated, nothing
    compiled). `eval_dataset`: the held-out pass, made once (data.open_pipeline's)."""
    if not every:
      return None
    return cls(every, parallel_step, lambda: iter(eval_dataset))

  def compile(self) -> None:
    self.compiled = self.parallel_step.compiled_eval_step()

  def after_step(self, loop: Loop) -> None:
    if loop.step % self.every == 0:
      self.run(loop)

  def on_end(self, loop: Loop) -> None:
    if not loop.preempted and loop.step and self.evaluated_step != loop.step:
      self.run(loop)

  def run(self, loop: Loop) -> dict | None:
    if self.compiled is None:
      return None
    loop.beat(phase=f"eval {loop.step}")
    loop.clock.lap_after("steps", loop.state)     # the step it evaluates is the step's time
    results = evaluate(self.compiled, loop.state.params, self.batches(), self.parallel_step.put_batch)
    loop.clock.lap("eval")
    self.evaluated_step = loop.step
    logging.info("step %d: held-out loss %.4f, perplexity %.4g (%d tokens in %d batches)", loop.step,
                 results["eval_loss"], results["eval_perplexity"], results["eval_tokens"], results["eval_batches"])
    loop.writer.write(loop.step, results)
    return results
