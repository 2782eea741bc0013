"""Does a config fit its devices? The cost model's memory estimate, checked before anything
is initialized or compiled.

`check_fits(config, devices)` estimates the bytes one device of the job needs for the training
step (memory.memory for the config's model and plan: `plan_of`) and compares them with
what the device has (`device_memory`):

  GPU   the device's `bytes_limit` from memory_stats(): what XLA's allocator may use (by
        default 75% of the HBM, XLA_PYTHON_CLIENT_MEM_FRACTION);
  CPU   the machine's memory divided among this process's devices in the mesh (other
        processes on the same machine are not counted).

A config whose estimate is more than the device's memory is refused with a one-line
ConfigError giving both figures, the largest part and the ways out, unless
train.force_memory, which logs a warning and lets XLA decide; one that fits by less than the
estimate's margin (memory.estimate_margin: 21%, what the held-out errors need)
runs with a warning (XLA:GPU rematerializes when memory runs short, which the model does not count). On a CPU host going over means swapping
or the kernel's out-of-memory killer, not an error; on a GPU a failed allocation after the
compile. The memory model is within 10% of XLA's buffer assignment where it was checked
(calibration.MEMORY_CASES, CPU). Every config in configs/ fits its intended hardware with
XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 (tests/unit/test_fits.py). It is arithmetic on the
config: nothing is materialized, a model that could never fit (model.hidden_dim=1000000:
hundreds of TB) is refused in an instant.
"""

from __future__ import annotations

from absl import logging
import jax
import psutil

from megajax.config_checks import ConfigError
from megajax.layers import ATTENTION_FUSED, BLOCK_FAMILIES
from megajax.model import ModelConfig
from megajax.parallel.planner import cost_model, memory
from megajax.parallel.planner.cost_model import GB, Plan
from megajax.parallel.planner.memory import Memory
from megajax.sections import section

def plan_of(config, platform: str = "gpu") -> Plan:
  """The cost model's Plan for a megajax config (a ConfigDict or a RunConfig: its own block and
  attention, no switches changed) as it runs on `platform` (an unset parallel.pipeline_recompute
  is the platform's)."""
  c, p, t = config.model, section(config, "parallel"), config.train
  opts = cost_model.Optimizations(ptb=BLOCK_FAMILIES[c.block].parallel, swa=True,
                                      fused_ops=ATTENTION_FUSED[c.attention_impl],
                                  lamb=config.optimizer.name == "lamb")
  return Plan(p.dp, p.pp, p.tp, p.virtual_stages, t.batch_size // (p.dp * t.microbatches), t.batch_size, opts,
              "megajax", p.grad_sync, p.pipeline_recompute_on(platform), p.schedule, p.traversal, cp=p.cp)


def estimate(config, platform: str) -> Memory:
  """Bytes per device of the config's step. On CPU with remat none whatever model.remat says:
  XLA:CPU's scheduler runs the recomputation early, measured equal to none (calibration.py)."""
  return memory.memory(ModelConfig.from_config(config.model), plan_of(config, platform),
                       remat="none" if platform == "cpu" else None, platform="cpu" if platform == "cpu" else "gpu")


def device_memory(devices) -> tuple[float | None, str]:
  """(bytes one of `devices` (this process's) may use, where the figure comes from); None
  when the platform does not say (a backend without memory_stats)."""
  if devices[0].platform == "cpu":
    total = psutil.virtual_memory().total
    return total / len(devices), f"CPU: {total / GB:.1f} GB of machine memory shared by {len(devices)} device(s)"
  limits = [(d.memory_stats() or {}).get("bytes_limit") for d in devices]
  if not all(limits):
    return None, f"{devices[0].device_kind}: no bytes_limit in memory_stats()"
  return float(min(limits)), f"{devices[0].device_kind}: memory_stats() bytes_limit"


def check_fits(config, devices) -> Memory:
  """The estimate for this process's share of `devices` (the job's, dp * pp * tp of them);
  raises ConfigError when it is more than their memory (a warning with train.force_memory)."""
  devices = [d for d in devices if d.process_index == jax.process_index()]
  needed = estimate(config, devices[0].platform)
  have, where = device_memory(devices)
  if have is None:
    logging.info("memory per device: %s estimated; not checked (%s)", _gb(needed.total), where)
  else:
    refuse_or_warn(needed, have, where, force=config.train.force_memory)
  return needed


def refuse_or_warn(needed: Memory, have: float, where: str, force: bool = False) -> None:
  """The decision, apart from the devices: ConfigError above `have`, a warning when `force`;
  a warning when the estimate fits by less than memory.ESTIMATE_MARGIN (the held-out errors at
  these sizes lean negative)."""
  margin = memory.ESTIMATE_MARGIN
  if needed.total * (1 + margin) <= have:
    return
  if needed.total <= have:
    logging.warning("memory per device: %s estimated of the %s a device has (%s): it fits by less than the "
                    "estimate's error (%.0f%%: held-out cases reach -15%% at planner sizes), so it may not; "
                    "if it runs out of memory: more train.microbatches, "
                    "model.remat=full or a larger parallel.dp", _gb(needed.total), _gb(have), where, 100 * margin)
    return
  parts = {"optimizer state": needed.state, "parameters in use": needed.params_temp,
           "activations": needed.activations + needed.pipeline, "logits": needed.logits}
  largest = max(parts, key=parts.get)
  shown = f"{_gb(needed.total)} estimated, {_gb(parts[largest])} of it {largest}"
  over = f"{needed.total / have:.2f} x the {_gb(have)} a device has ({where})"
  if force:
    logging.warning("memory per device: %s, %s: running anyway (train.force_memory); the step may not fit",
                    shown, over)
    return
  fix = (("a smaller model, or more devices: parallel.tp and parallel.pp split the parameters, parallel.dp "
          "the optimizer state") if largest in ("optimizer state", "parameters in use") else
         "more train.microbatches (smaller microbatches), model.remat=full, or a larger parallel.dp")
  gpu = "" if where.startswith("CPU") else "; on a GPU, XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 gives XLA more of it"
  raise ConfigError("memory per device", shown, over,
                    f"use {fix}{gpu}; or --config.train.force_memory=true to run anyway")


def _gb(nbytes: float) -> str:
  return f"{nbytes / GB:,.1f} GB"
