"""Weights & Biases as a tracker (observe.wandb_project; pip install 'megajax[wandb]').

MetricsWriter hands it every record it writes: the same numbers TensorBoard gets (loss, eval,
throughput, MFU, goodput/*, checkpoint times), logged against `train/step` (W&B's own step only
grows; a resumed run logs the steps after its checkpoint again, as metrics.jsonl does). One W&B
run per workdir: its id is kept in WORKDIR/wandb_run_id, so a restart or a resume continues the
same run (resume="allow"). Process 0 only. wandb is imported here, and this module only when
the tracker is configured.
"""

from __future__ import annotations

import os

import jax


RUN_ID_FILE = "wandb_run_id"
STEP = "train/step"


class WandbTracker:

  @classmethod
  def for_run(cls, observe, record: dict, workdir: str | None) -> "WandbTracker | None":
    """The run's tracker on process 0 when observe.wandb_project names one; else None (and
    wandb is not imported)."""
    if not observe.wandb_project or jax.process_index() != 0:
      return None
    return cls(observe, record, workdir)

  def __init__(self, observe, record: dict, workdir: str | None):
    """`observe`: the run's observe section (the project and entity); `record`: the config
    it logs (RunConfig.record)."""
    import wandb        # pylint: disable=import-outside-toplevel  (an optional dependency)
    run_id, id_path = None, os.path.join(workdir, RUN_ID_FILE) if workdir else None
    if id_path and os.path.exists(id_path):
      with open(id_path) as f:
        run_id = f.read().strip() or None
    o = observe
    self.run = wandb.init(project=o.wandb_project, entity=o.wandb_entity or None, id=run_id, resume="allow",
                          dir=workdir, name=os.path.basename(os.path.abspath(workdir)) if workdir else None,
                          config=record)
    self.run.define_metric(STEP)
    self.run.define_metric("*", step_metric=STEP)
    self.run_id = self.run.id
    if id_path and run_id is None:      # the workdir's first: its id for the runs that resume it
      with open(id_path, "w") as f:
        f.write(self.run_id + "\n")

  def log(self, step: int, scalars: dict) -> None:
    numbers = {k: v for k, v in scalars.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if numbers:
      self.run.log({STEP: step, **numbers})

  def close(self) -> None:
    self.run.finish()
