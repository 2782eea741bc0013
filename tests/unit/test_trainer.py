"""The training loop's parts in process: the callback protocol, the non-finite step, the fault
drills, metrics records across a resume, and a short run through every collaborator."""

import gc
import itertools
import json
import math
import os
import signal

import jax
from jax.sharding import Mesh, PartitionSpec as P
import numpy as np
import pytest

from megajax import data
from megajax.config import ConfigError, validate
from megajax.observe import MetricsWriter, job_ledger, read_metrics
from megajax.observe.records import METRICS, drop_after, read_jsonl
from megajax.parallel import ParallelStep
from megajax.parallel.mesh import AXIS_TYPES, CP, DP, MESH_AXES
from megajax.trainer import build_parallel_step, callbacks, drills, train
from megajax.reference_step import make_loss_fn
from megajax.trainer.evaluation import Evaluation, held_out_batches
from megajax.trainer.loop import _run_loop


class _Recorder(callbacks.Callback):
  """Records every call; replaces the batch before the step and the metrics after it."""

  def __init__(self, name, calls):
    self.name, self.calls = name, calls

  def before_step(self, loop):
    self.calls.append((self.name, "before", loop.step))
    loop.batch = {"seen_by": self.name}

  def after_step(self, loop):
    self.calls.append((self.name, "after", loop.step, loop.metrics))
    loop.metrics = {"from": self.name}

  def on_end(self, loop):
    self.calls.append((self.name, "end", loop.step))


def _loop(config, start_step=0, batches=None):
  return callbacks.Loop(config.train, parallel_step=None, start_step=start_step, state=0,
                        batches=batches or iter(range(100)), writer=None, heartbeat=None)


def test_callbacks_are_called_in_order_at_fixed_points_of_every_step(tiny_config):
  """Before each step in list order (a callback's batch is the step's), after each step in
  list order (each sees the metrics the one before left), on_end once; the state threads."""
  tiny_config.train.steps = 5
  calls, steps_run = [], []

  def step_fn(state, batch):
    steps_run.append((state, batch))
    return state + 1, {"from": "step"}

  loop = _loop(tiny_config, start_step=2)
  _run_loop(loop, step_fn, [_Recorder("a", calls), _Recorder("b", calls)])
  assert [c[:3] for c in calls] == [(n, point, s) for s in (3, 4, 5) for point in ("before", "after")
                                    for n in ("a", "b")] + [("a", "end", 5), ("b", "end", 5)]
  assert [c[3] for c in calls if c[1] == "after"] == [{"from": "step"}, {"from": "a"}] * 3
  assert steps_run == [(0, {"seen_by": "b"}), (1, {"seen_by": "b"}), (2, {"seen_by": "b"})]
  assert loop.state == 3


def test_a_preemption_stops_the_loop_after_that_step(tiny_config):
  class Preempt(callbacks.Callback):
    def after_step(self, loop):
      loop.preempted = loop.step == 2

  calls = []
  loop = _loop(tiny_config)
  _run_loop(loop, lambda state, batch: (state, {}), [Preempt(), _Recorder("r", calls)])
  assert [c[:3] for c in calls] == [("r", "before", 1), ("r", "after", 1), ("r", "before", 2), ("r", "after", 2),
                                    ("r", "end", 2)]


def test_fault_drills_poison_their_batches(tiny_config):
  tiny_config.debug.nonfinite_steps = "2,3"
  drill = drills.PoisonedBatches(tiny_config.debug)
  loop = _loop(tiny_config)
  for step in (1, 2):
    loop.step, loop.batch = step, {"loss_mask": np.ones(3, np.float32)}
    drill.before_step(loop)
    assert np.isnan(loop.batch["loss_mask"]).all() == (step == 2)
  assert drills.straggler_work(tiny_config.debug, tiny_config.model) is None
  tiny_config.debug.slow_rank = "0,0,0"
  assert callable(drills.straggler_work(tiny_config.debug, tiny_config.model))
  assert drills.diagnose_slowed(tiny_config.debug, 0) is False
  tiny_config.debug.diagnose_slow_process = 0
  assert drills.diagnose_slowed(tiny_config.debug, 0) is True


@pytest.mark.parametrize("slow_rank, slow", [("1,0,1,0", (1, 0, 1, 0)), ("0,0,1", (0, 0, 0, 1))],
                         ids=["dp,pp,cp,tp", "dp,pp,tp"])
def test_the_straggler_drill_slows_its_rank_alone(tiny_config, slow_rank, slow):
  """debug.slow_rank on a (dp, pp, cp, tp) = (2, 1, 2, 2) mesh: the extra work runs on that
  device alone (its result non-zero), from slow_rank_from_step on; "dp,pp,tp" is cp 0."""
  tiny_config.debug.slow_rank, tiny_config.debug.slow_rank_work, tiny_config.debug.slow_rank_from_step = slow_rank, 2, 5
  extra_work = drills.straggler_work(tiny_config.debug, tiny_config.model)
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 1, 2, 2), MESH_AXES, axis_types=AXIS_TYPES)
  run = jax.jit(jax.shard_map(lambda batch, step: extra_work(batch, step).reshape(1, 1, 1, 1), mesh=mesh,
                              in_specs=({"inputs": P(DP, CP)}, P()), out_specs=P(*MESH_AXES)))
  batch = {"inputs": np.arange(1, 9, dtype=np.int32).reshape(2, 4)}
  worked = np.asarray(run(batch, np.int32(5))) != 0
  assert list(zip(*np.nonzero(worked))) == [slow]
  assert not np.asarray(run(batch, np.int32(4))).any()       # before slow_rank_from_step: nobody


@pytest.mark.parametrize("mode,sent", [("kill", signal.SIGKILL), ("hang", signal.SIGSTOP)])
def test_the_fail_drill_signals_after_its_step_on_the_first_attempt_only(tiny_config, monkeypatch, mode, sent):
  """debug.fail_at_step: the heartbeat written, then the signal of debug.fail_mode to this
  process after that step; a supervisor's restart (MEGAJAX_ATTEMPT=1) and other processes run
  clean."""
  tiny_config.debug.fail_at_step, tiny_config.debug.fail_mode = 2, mode
  signals = []
  monkeypatch.setattr(drills.os, "kill", lambda pid, sig: signals.append((pid, sig)))
  loop = _loop(tiny_config)
  loop.heartbeat = type("Beats", (), {"write": lambda self: signals.append("beat")})()
  fired = ["beat", (os.getpid(), sent)]
  for attempt, process, want in (("0", -1, fired), ("0", 0, fired), ("0", 1, []), ("1", -1, [])):
    monkeypatch.setenv("MEGAJAX_ATTEMPT", attempt)
    tiny_config.debug.fail_process = process
    drill, signals[:] = drills.FailAtStep(tiny_config.debug), []
    for step in (1, 2, 3):
      loop.step = step
      drill.after_step(loop)
    assert signals == want, (attempt, process)


@pytest.mark.parametrize("by_branch", [True, False], ids=["branch (CPU)", "select (GPU)"])
def test_nonfinite_step_leaves_the_state_unchanged(tiny_config, monkeypatch, by_branch):
  """A batch whose loss is NaN: the 3D step skips the update (state bitwise unchanged) and
  says so; a finite batch then trains normally. Both ways a step skips: XLA:CPU's branch and
  the GPUs' select."""
  monkeypatch.setattr(ParallelStep, "skips_by_branch", property(lambda self: by_branch))
  tiny_config.parallel.dp = 2
  parallel_step = build_parallel_step(tiny_config, jax.devices()[:2])
  batch = parallel_step.put_batch(next(data.make_iterator(tiny_config, 0, 1)))
  step = parallel_step.train_step()
  state = parallel_step.init_state(jax.random.key(0))
  before = jax.device_get(state)
  poisoned = {**batch, "loss_mask": batch["loss_mask"] * float("nan")}
  state, metrics = step(state, poisoned)
  assert int(metrics["skipped"]) == 1 and not np.isfinite(float(metrics["loss"]))
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(state))):
    np.testing.assert_array_equal(a, b)
  state, metrics = step(state, batch)
  assert int(metrics["skipped"]) == 0 and int(state.step) == 1


def test_a_resumed_run_drops_the_records_after_its_checkpoint(tmp_path):
  """A run resumed from step 5 rewrites metrics.jsonl without steps 6..8 of the run before
  (and without a half line a kill left), then logs those steps again: each step once."""
  writer = MetricsWriter(str(tmp_path), total_steps=8, progress=False)
  for step in range(1, 9):
    writer.write(step, {"loss": float(10 - step)})
  writer.write(6, {"ckpt_blocking_s": 0.1})
  writer.close()
  with open(tmp_path / METRICS, "a") as f:
    f.write('{"step": 9, "lo')                       # killed mid-write
  resumed = MetricsWriter(str(tmp_path), total_steps=8, progress=False, start_step=5)
  for step in range(6, 9):
    resumed.write(step, {"loss": float(step)})
  resumed.close()
  records = read_jsonl(str(tmp_path / METRICS))
  assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6, 7, 8]
  assert [r["loss"] for r in records[5:]] == [6.0, 7.0, 8.0]
  assert dict(read_metrics(str(tmp_path / METRICS))["loss"])[8] == 8.0
  assert drop_after(str(tmp_path / "missing.jsonl"), 3) == 0


def test_a_short_run_through_every_collaborator(tmp_path, tiny_config, monkeypatch):
  """One process, a workdir: the heartbeat ends done, the metrics log steps 1, log_every and
  the last, the checkpointer saves on its cadence and commits, activations are captured, the
  held-out loss is evaluated on its cadence and at the end; a relaunch finds nothing to do."""
  tiny_config.train.steps, tiny_config.train.log_every, tiny_config.checkpoint.every_steps = 6, 4, 3
  tiny_config.train.eval_every, tiny_config.train.eval_batches = 4, 2
  tiny_config.observe.capture = "0:residual"
  result = train(tiny_config, str(tmp_path), devices=jax.devices()[:1])
  assert [h["step"] for h in result.history] == [1, 4, 6] and not result.preempted
  beat = json.loads((tmp_path / "heartbeats" / "process_0.json").read_text())
  assert beat["done"] and beat["phase"] == "done" and beat["step"] == 6 and beat["startup_s"] > 0
  metrics = read_metrics(str(tmp_path / METRICS))
  assert [s for s, _ in metrics["ckpt_blocking_s"]] == [3, 6] and [s for s, _ in metrics["ckpt_total_s"]] == [3, 6]
  assert [s for s, _ in metrics["startup_s"]] == [1]
  assert [s for s, _ in metrics["eval_loss"]] == [4, 6]
  assert dict(metrics["eval_tokens"])[6] == 2 * tiny_config.train.batch_size * tiny_config.model.seq_len
  assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == [3, 6]
  assert [r["step"] for r in read_jsonl(str(tmp_path / "activations.jsonl"))] == [1, 2, 3, 4, 5, 6]
  # The goodput ledger: one run, every step kept, each cause it met charged, the ratio live.
  book = job_ledger(str(tmp_path))
  assert [(a.status, a.steps_run, a.start_step, a.last_step) for a in book.attempts] == [("finished", 6, 0, 6)]
  assert book.kept_steps == 6 and book.redone_steps == 0
  assert all(book.seconds[c] > 0 for c in ("productive", "start", "compile", "checkpoint", "eval", "shutdown"))
  assert sum(book.seconds.values()) == pytest.approx(book.wall_s, rel=1e-6)
  assert [s for s, _ in metrics["goodput/ratio"]] == [1, 4, 6] and all(0 < r < 1 for _, r in metrics["goodput/ratio"])
  # Again with the same workdir: the checkpoint is at train.steps, nothing to run and nothing
  # compiled (the step is never built), the parameters exported again.
  monkeypatch.setattr(ParallelStep, "train_step", lambda *_, **__: pytest.fail("built a step with nothing to run"))
  again = train(tiny_config, str(tmp_path), devices=jax.devices()[:1])
  assert again.start_step == 6 and again.history == [] and not again.preempted
  assert (tmp_path / "params").is_dir()
  book = job_ledger(str(tmp_path))      # a second run, nothing to do: its time is badput
  assert [(a.status, a.steps_run) for a in book.attempts] == [("finished", 6), ("finished", 0)]
  assert book.kept_steps == 6 and sum(book.seconds.values()) == pytest.approx(book.wall_s, rel=1e-6)


@pytest.mark.parametrize("steps,evaluated", [(5, [2, 4, 5]), (4, [2, 4])], ids=["and_after_the_last", "once_at_the_end"])
def test_evaluation_every_eval_every_steps_and_after_the_last(tmp_path, tiny_config, steps, evaluated):
  """train.eval_every=2: the held-out loss at steps 2, 4, ... and after the last step (once
  when it falls on the cadence), records of their own in metrics.jsonl: the mean cross-entropy
  over every held-out token of the same batches each time, and its exp."""
  tiny_config.train.steps, tiny_config.train.eval_every = steps, 2
  tiny_config.parallel.dp = 2
  parallel_step = build_parallel_step(tiny_config, jax.devices()[:2])
  held_out = list(itertools.islice(data.make_iterator(tiny_config, 0, 1), 2))
  held_out[1]["loss_mask"][:, ::2] = 0                # fewer tokens in the second batch
  evaluation = Evaluation(tiny_config.train.eval_every, parallel_step, lambda: iter(held_out))
  evaluation.compile()
  state = parallel_step.init_state(jax.random.key(0))
  writer = MetricsWriter(str(tmp_path), steps, progress=False)
  loop = callbacks.Loop(tiny_config.train, parallel_step, 0, state, batches=iter(range(100)), writer=writer)
  _run_loop(loop, lambda state, batch: (state, {}), [evaluation])
  writer.close()
  records = [r for r in read_jsonl(str(tmp_path / METRICS)) if "eval_loss" in r]
  assert [r["step"] for r in records] == evaluated
  params = parallel_step.model_params(jax.device_get(state.params))
  sums = [make_loss_fn(parallel_step.model)(params, batch)[1] for batch in held_out]
  tokens = sum(float(s["tokens"]) for s in sums)
  loss = sum(float(s["loss"]) * float(s["tokens"]) for s in sums) / tokens
  for record in records:
    assert record["eval_tokens"] == tokens == 1.5 * tiny_config.train.batch_size * tiny_config.model.seq_len
    assert record["eval_batches"] == 2
    assert record["eval_loss"] == pytest.approx(loss, rel=1e-5)
    assert record["eval_perplexity"] == pytest.approx(math.exp(loss), rel=1e-5)


def test_held_out_batches_open_the_eval_data_once(tmp_path, tiny_config, monkeypatch):
  """The eval dataset is made when the evaluation is built (a bad eval file fails before the
  step compiles), and each pass iterates it again, the same batches, without reopening a file."""
  tiny_config.train.eval_batches = 2
  parallel_step = build_parallel_step(tiny_config, jax.devices()[:1])
  made = []
  make_sources = data.make_sources
  monkeypatch.setattr(data, "make_sources", lambda *args: made.append(args) or make_sources(*args))
  batches = held_out_batches(tiny_config, parallel_step)
  assert len(made) == 1
  first, again = list(batches()), list(batches())
  assert len(made) == 1 and len(first) == 2
  for x, y in zip(first, again):
    np.testing.assert_array_equal(x["inputs"], y["inputs"])


def test_no_evaluation_after_a_preemption_or_when_off(tiny_config):
  """A preempted run stops at once (no final evaluation); train.eval_every=0 builds nothing."""
  assert Evaluation.every_steps(0, parallel_step=None, eval_dataset=None) is None
  tiny_config.train.eval_every = 3
  evaluation = Evaluation(tiny_config.train.eval_every, parallel_step=None, batches=lambda: pytest.fail("evaluated"))
  evaluation.compiled = object()

  class Preempt(callbacks.Callback):
    def after_step(self, loop):
      loop.preempted = loop.step == 2

  _run_loop(_loop(tiny_config), lambda state, batch: (state, {}), [Preempt(), evaluation])


@pytest.mark.parametrize("field,value,problem", [("eval_every", -1, "must be an integer >= 0"),
                                                 ("eval_batches", 0, "must be a positive integer")])
def test_evaluation_fields_are_checked(tiny_config, field, value, problem):
  tiny_config.train[field] = value
  with pytest.raises(ConfigError, match=rf"^train\.{field}={value}: {problem}; set --config\.train\.{field} to "):
    validate(tiny_config)


def test_garbage_collections_come_at_the_same_steps_on_every_process(tiny_config, monkeypatch):
  """runtime.gc_every_steps=2: Python's automatic collections are off through the build and the
  loop, a full collection follows steps 2 and 4 (every process counts the same steps), and
  the collector is as it was after; 0: none of ours, the automatic ones as they were."""
  collected = []
  monkeypatch.setattr(callbacks.gc, "collect", lambda *args: collected.append(gc.isenabled()))
  tiny_config.train.steps = 5
  _run_loop(_loop(tiny_config), lambda state, batch: (state, {}), [callbacks.GarbageCollection(2)])
  _run_loop(_loop(tiny_config), lambda state, batch: (state, {}), [callbacks.GarbageCollection(0)])
  assert len(collected) == 2
  was_enabled = gc.isenabled()          # (tests/conftest.py turns them off in the test processes)
  try:
    for enabled_before in (True, False):
      (gc.enable if enabled_before else gc.disable)()
      for every, enabled_inside in ((2, False), (0, enabled_before)):
        with callbacks.manual_garbage_collection(every):
          assert gc.isenabled() is enabled_inside
        assert gc.isenabled() is enabled_before
    gc.enable()
    tiny_config.runtime.gc_every_steps, tiny_config.train.steps = 2, 4
    collected.clear()
    train(tiny_config, devices=jax.devices()[:1])
    assert collected == [False, False] and gc.isenabled()   # after steps 2 and 4, the automatic ones off
  finally:
    (gc.enable if was_enabled else gc.disable)()
  tiny_config.runtime.gc_every_steps = -1
  with pytest.raises(ConfigError, match="runtime.gc_every_steps"):
    validate(tiny_config)
