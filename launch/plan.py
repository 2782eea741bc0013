r"""megajax-plan: the best 3D plans for a model on a cluster, by the cost model.

  megajax-plan --config=configs/gpt.py:175b --gpus=12288 --hardware=a100-80g --batch=6144
  megajax-plan --config=configs/gpt.py:175b --gpus=256 --batch=768 --megatron --executor=paper

Enumerates (dp, pp, tp, virtual stages, microbatch size) that divide evenly, drops the plans
that do not fit in the device's memory and prints the best few by predicted MFU: memory per
device, step time, MFU, pipeline bubble and the bottleneck (the largest part of the step,
and when that is compute, the largest loss beside it).

  --megatron     all MegaScale switches off (serial block, full attention, AdamW, no
                 overlaps, unfused operators): the paper's Megatron-LM rows.
  --executor     megajax (this repository's step: ZeRO gathers in bf16 but for the embedding and
                 LayerNorms, one fp32 reduce-scatter per step (parallel.grad_sync=step), the
                 pipeline backward reads the residuals each chunk's forward kept; a plan whose
                 residuals do not fit but whose rerun does is shown with "; pipeline_recompute":
                 each backward reruns its chunk's forward, parallel.pipeline_recompute=True) or
                 paper (Megatron-LM with MegaScale's switches, the system the paper measured).
                 (--runtime, its earlier name, still works.)
  --explain      dp,pp,tp,v,b[,cp]: one plan's full accounting instead of the search (memory by part,
                 one layer's operation times, the step by part, model FLOPs per GPU).
  --fbd_forward  HARDWARE:COUNT: MegaFBD on a mixed cluster (megajax.parallel.planner.fbd): the forward on
                 COUNT GPUs of HARDWARE, the backward and optimizer on the --gpus --hardware ones; its best
                 plans (each group's dp x tp, the microbatch) against the best 3D plan on --hardware alone:
                 megajax-plan --config=configs/gpt.py:1p3b --hardware=h100-80g --gpus=8 --batch=128
                 --fbd_forward=a100-80g:32 --remat=full
  --compile      the config's own plan (its parallel.dp x pp x tp = --gpus) compiled for
                 --hardware (h100-80g or h200-141g) by XLA's GPU compiler on this machine, no
                 GPU needed (megajax.parallel.deviceless): XLA's bytes per device next to the
                 planner's estimate, whether it fits, and the collectives that overlap compute.
                 Before spending GPU time on a config: megajax-plan --config=configs/gpt.py:1p3b
                 --gpus=8 --config.parallel.dp=8 --hardware=h100-80g --compile
Each listed plan is followed by its memory and time by part and by what makes #1 faster than
it; a legend and the modelled executor (and how the other differs) come first. The best plan's
config overrides (megajax-train --config.<field>=...) are printed before its step-time
breakdown.
The model is megajax.parallel.planner.cost_model (its calibration: `python -m megajax.launch.bench
planner`). Mistakes in flags or config are one line on stderr and exit code 2.
"""

from absl import app
from absl import flags

from megajax.config import ConfigError
from megajax.launch import cli
from megajax.launch.cli import define_config_flag, fail, flags_parser, validated_config
from megajax.model import ModelConfig
from megajax.observe.schedule import overlap_counts
from megajax.parallel import deviceless
from megajax.sections import section
from megajax.parallel.planner import cost_model, explain, fbd, fits, hardware, memory, plans

PROGRAM = "megajax-plan"
EXECUTORS = tuple(explain.EXECUTORS)
_CONFIG = define_config_flag()
_GPUS = flags.DEFINE_integer("gpus", None, "Devices in the job.")
_HARDWARE = flags.DEFINE_string("hardware", "a100-80g", "Device type (megajax.parallel.planner.cost_model.HARDWARE).")
_BATCH = flags.DEFINE_integer("batch", 0, "Global batch in sequences (0: the config's train.batch_size).")
_TOP = flags.DEFINE_integer("top", 5, "Plans to print.")
_MEGATRON = flags.DEFINE_bool("megatron", False, "Model Megatron-LM: every MegaScale switch off.")
_EXECUTOR = flags.DEFINE_enum("executor", "megajax", EXECUTORS, "Whose training system executes the plan.")
flags.DEFINE_alias("runtime", "executor")     # its earlier name
_REMAT = flags.DEFINE_enum("remat", "", ["", "none", "dots", "full"], "Activation recomputation ('': the config's).")
_EXPLAIN = flags.DEFINE_string("explain", "", "dp,pp,tp,v,b[,cp]: print this plan's full accounting instead of the "
                               "search.")
_FBD_FORWARD = flags.DEFINE_string("fbd_forward", "", "HARDWARE:COUNT: MegaFBD plans with the forward on COUNT GPUs of "
                                   "HARDWARE and the backward on the --gpus --hardware ones, against those alone.")
_COMPILE = flags.DEFINE_bool("compile", False, "Compile the config's own plan for --hardware without a GPU and "
                              "print XLA's bytes per device next to the planner's.")
flags.mark_flags_as_required(["config", "gpus"])
flags.adopt_module_key_flags(cli)     # --config in this command's --help


def _flag_error(flag: str, value, problem: str, fix: str) -> None:
  fail(PROGRAM, "flag error", f"--{flag}={value}: {problem}; {fix}")


def main(argv):
  config = validated_config(PROGRAM, argv, _CONFIG)

  hw = cost_model.HARDWARE.get(_HARDWARE.value)
  if hw is None:
    _flag_error("hardware", _HARDWARE.value, "unknown hardware", f"choose one of {', '.join(cost_model.HARDWARE)}")
  gpus, batch, top = _GPUS.value, _BATCH.value or config.train.batch_size, _TOP.value
  if gpus < 1 or (gpus > hw.gpus_per_node and gpus % hw.gpus_per_node):
    _flag_error("gpus", gpus, f"not a whole number of {hw.gpus_per_node}-GPU {hw.name} nodes",
                f"use a multiple of {hw.gpus_per_node}, e.g. {max(1, round(gpus / hw.gpus_per_node)) * hw.gpus_per_node}")
  if batch < 1:
    _flag_error("batch", batch, "must be a positive number of sequences", "e.g. --batch=768")
  if top < 1:
    _flag_error("top", top, "must be at least 1", "e.g. --top=5")

  if _COMPILE.value:
    _compile(config, gpus, hw)
    return
  opts = cost_model.MEGATRON if _MEGATRON.value else cost_model.MEGASCALE
  c = ModelConfig.from_config(config.model)
  remat = _REMAT.value or c.remat
  if _EXPLAIN.value:
    _explain(c, gpus, batch, hw, opts, remat)
    return
  if _FBD_FORWARD.value:
    _fbd(c, gpus, batch, hw, remat, top)
    return
  best, even = plans.search(c, gpus, batch, hw, opts, _EXECUTOR.value, remat)
  if not even:
    _flag_error("batch", batch, f"no (dp, pp, tp, v, microbatch) divides {gpus} GPUs and this batch evenly "
                f"(dp must divide the batch; tp <= {hw.gpus_per_node}, pp * v divides {c.num_layers} layers)",
                "use a batch with more factors of 2, e.g. a multiple of --gpus / 64")
  if not best:
    smallest = min(plans.assess_fitting(c, p, hw, remat).memory.total
                   for p in plans.enumerate_plans(c, gpus, batch, hw, opts, _EXECUTOR.value))
    _flag_error("gpus", gpus, f"none of the {even} even plans fits in {hw.memory_gb:g} GB per device "
                f"(the smallest needs {smallest / cost_model.GB:.1f} GB)",
                "use more GPUs, --remat=full, or --hardware with more memory")

  params = cost_model.param_counts(c, cost_model.Plan(1, 1, 1, 1, 1, batch)).model
  run = cost_model.apply_switches(c, opts)
  window = f"SWA w={run.window}" if run.window else "full attention"
  switches = ("Megatron-LM (serial block, full attention, AdamW, no overlaps, unfused operators)"
              if _MEGATRON.value else f"MegaScale (PTB, {window}, TP/PP/DP overlap, fused operators, misc, LAMB)")
  print(f"{PROGRAM}: {params / 1e9:.1f}B parameters ({c.num_layers} layers, hidden {c.hidden_dim}, "
        f"{c.num_heads} heads, seq {c.seq_len}, vocab {c.vocab_size}) on {gpus} {hw.name}, batch {batch}")
  print(f"switches: {switches}; executor {_EXECUTOR.value}; remat {remat}")
  _note_extrapolated(hw)
  if remat == "full":
    print("note: remat full reruns every layer's forward in its backward; the published runs the planner is "
          "validated on (MegaScale, Megatron-LM) recompute selectively: --remat=dots compares with them")
  other = next(r for r in EXECUTORS if r != _EXECUTOR.value)
  print(f"executor {_EXECUTOR.value}: {explain.EXECUTORS[_EXECUTOR.value]} (--executor={other}: {explain.EXECUTORS[other]})")
  print(explain.LEGEND)
  margin = (f" with a {memory.ESTIMATE_MARGIN:.0%} margin for the memory estimate's error"
            if _EXECUTOR.value == "megajax" else "")
  print(f"{even} plans divide evenly, {len(best)} fit in {hw.memory_gb - cost_model.MEMORY_RESERVED_GB:g} GB{margin}")
  print(plans.PLAN_HEADER)
  for i, candidate in enumerate(best[:top], 1):
    print(plans.plan_line(i, candidate))
    print(f"{'':3}{explain.memory_line(candidate)}; {explain.time_line(candidate)}")
    if i > 1:
      print(f"{'':3}{explain.why_first(best[0], candidate)}")
  remat_flag = f" --config.model.remat={remat}" if remat != c.remat else ""
  print(f"overrides: {plans.config_overrides(best[0].plan)}{remat_flag}")
  print(f"best: {plans.describe(best[0].plan)}: {plans.breakdown(best[0].time)}")


def _fbd(c, gpus: int, batch: int, hw, remat: str, top: int) -> None:
  """MegaFBD on a mixed cluster: the forward group (--fbd_forward) beside the --gpus --hardware
  ones (the backward group), against the best 3D plan on the latter alone."""
  name, _, count = _FBD_FORWARD.value.partition(":")
  forward_hw = cost_model.HARDWARE.get(name)
  if forward_hw is None or not count.isdigit() or int(count) < 1:
    _flag_error("fbd_forward", _FBD_FORWARD.value, "not HARDWARE:COUNT",
                f"e.g. --fbd_forward=a100-80g:32 (hardware one of {', '.join(cost_model.HARDWARE)})")
  forward_gpus = int(count)
  found = fbd.search(c, forward_hw, forward_gpus, hw, gpus, batch, remat)
  alone, _ = plans.search(c, gpus, batch, hw, cost_model.MEGASCALE, "megajax", remat)
  print(f"{PROGRAM}: MegaFBD, forward on {forward_gpus} {forward_hw.name}, backward and optimizer on {gpus} "
        f"{hw.name}, batch {batch}, remat {remat} (megajax.parallel.planner.fbd: the 3D model's operation times; "
        "the residuals and weights cross the groups' NICs)")
  for extrapolated in {forward_hw, hw}:
    _note_extrapolated(extrapolated)
  if not found:
    _flag_error("fbd_forward", _FBD_FORWARD.value, "no MegaFBD plan fits (each group's tp within a node; the "
                "microbatch a multiple of both groups' dp dividing the batch)", "use more GPUs or --remat=full")
  print(f"{'#':>2}  {'plan':<78} {'step s':>7} {'MFU':>6}  per microbatch: forward / transfer / backward s, memory "
        "GB fwd / bwd")
  for i, x in enumerate(found[:top], 1):
    t = x.time
    print(f"{i:>2}  {fbd.describe(x.plan):<78} {t.total:>7.3f} {100 * t.mfu:>5.1f}%  {t.forward:.4f} / "
          f"{t.transfer:.4f} / {t.backward:.4f} ({t.bottleneck}-bound), weights {t.weights:.3f} a step; "
          f"{x.forward_bytes / cost_model.GB:.1f} / {x.backward_bytes / cost_model.GB:.1f}")
  best = found[0]
  if alone:
    base = alone[0]
    ratio = base.time.total / best.time.total
    verdict = "beats" if ratio > 1 else "does not beat"
    print(f"{hw.name} alone: {plans.describe(base.plan)}: {base.time.total:.3f} s, MFU {100 * base.time.mfu:.1f}%")
    print(f"MegaFBD {verdict} the {gpus} {hw.name} alone: {best.time.total:.3f} s against {base.time.total:.3f} s a "
          f"step ({ratio:.2f}x their speed), adding {forward_gpus} {forward_hw.name} for the forward")
  else:
    print(f"{hw.name} alone: no 3D plan fits on {gpus}; MegaFBD's #1 does: {best.time.total:.3f} s a step")
  print(f"overrides: {fbd.config_overrides(best.plan)}")
  hosts = hardware.nodes(forward_gpus, forward_hw) + hardware.nodes(gpus, hw)
  if hosts > 1:
    print(f"note: this plan spans {hosts} hosts; megajax-train runs MegaFBD in one process (one host) today, its "
          "groups' transfers being jax.device_put between that process's devices: the plan is what the design costs "
          "on this cluster, not a job megajax-train starts")


def _note_extrapolated(hw) -> None:
  """What an H100's or H200's figures are (hardware.EXTRAPOLATED), beside them."""
  if hw.name in hardware.EXTRAPOLATED:
    print(f"note: {hw.name} figures are {hardware.EXTRAPOLATED[hw.name]}")


def _explain(c, gpus, batch, hw, opts, remat) -> None:
  try:
    plan = explain.parse_explain(_EXPLAIN.value, batch, opts, _EXECUTOR.value)
  except ValueError as error:
    _flag_error("explain", _EXPLAIN.value, str(error), "see megajax-plan --help")
  if plan.gpus != gpus:
    _flag_error("explain", _EXPLAIN.value, f"dp x pp x tp = {plan.gpus}, not --gpus={gpus}",
                "make the product the GPU count")
  if plan not in plans.enumerate_plans(c, gpus, batch, hw, opts, _EXECUTOR.value, max_micro_batch=batch):
    _flag_error("explain", _EXPLAIN.value, "not an even plan (tp within a node dividing heads, MLP, vocabulary and "
                "sequence; pp x v dividing the layers; with v > 1, m a multiple of pp)",
                "pick one megajax-plan lists")
  _note_extrapolated(hw)
  print("\n".join(explain.explain(c, plan, hw, remat)))


def _compile(config, gpus: int, hw) -> None:
  """The config's plan compiled deviceless for `gpus` devices of `hw`: XLA's bytes per device
  against the planner's (fits.estimate, what megajax-train checks before it starts)."""
  if hw.name not in deviceless.GPU_TARGETS:
    _flag_error("hardware", hw.name, "no deviceless target for it",
                f"use --hardware={' or --hardware='.join(deviceless.GPU_TARGETS)} with --compile")
  parallel = section(config, "parallel")
  dp, pp, cp, tp = parallel.mesh_shape
  if parallel.device_count != gpus:
    _flag_error("gpus", gpus, f"--compile compiles the config's own plan, dp x pp x cp x tp = {parallel.device_count}",
                f"use --gpus={parallel.device_count}, or set --config.parallel.dp/pp/cp/tp to fill {gpus}")
  try:
    result = deviceless.compile_for_gpu(config, hw.name)
  except ConfigError as error:
    fail(PROGRAM, "config error", str(error))
  except deviceless.DevicelessUnavailable as error:
    fail(PROGRAM, "missing package", str(error))
  memory = result.compiled.memory_analysis()
  xla = result.bytes_per_device()
  predicted = fits.estimate(config, "gpu")
  limit = deviceless.GPU_TARGETS[hw.name].memory_bytes
  gib = lambda nbytes: f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
  c = config.model
  print(f"{PROGRAM} --compile: {ModelConfig.from_config(c).num_layers} layers, hidden {c.hidden_dim}, seq "
        f"{c.seq_len}, batch {config.train.batch_size} in {config.train.microbatches} microbatches, remat {c.remat}, "
        f"attention {c.attention_impl}; dp={dp} pp={pp} " + (f"cp={cp} " if cp > 1 else "") +
        f"tp={tp} v={config.parallel.virtual_stages} "
        f"(tp_overlap {parallel.tp_overlap_on('cuda')}, pipeline_recompute {parallel.pipeline_recompute_on('cuda')}) "
        f"on {gpus} {hw.name}, compiled without a GPU in {result.compile_seconds:.1f} s")
  print(f"  XLA      {gib(xla)} a device: arguments {gib(memory.argument_size_in_bytes)} (donated, aliased "
        f"{gib(memory.alias_size_in_bytes)}), outputs {gib(memory.output_size_in_bytes)}, temporaries "
        f"{gib(memory.temp_size_in_bytes)}")
  print(f"  planner  {gib(predicted.total)} a device ({predicted.total / xla:.2f} of XLA's): state "
        f"{gib(predicted.state)}, parameters and gradients {gib(predicted.params_temp)}, activations "
        f"{gib(predicted.activations)}, logits {gib(predicted.logits)}, pipeline {gib(predicted.pipeline)}")
  print(f"  fits     {'yes' if xla <= limit else 'NO'}: XLA's {gib(xla)} of the {gib(limit)} an {hw.name} reports "
        f"(XLA's allocator takes 75% of it by default: XLA_PYTHON_CLIENT_MEM_FRACTION)")
  counts = overlap_counts(result.text, result.step.mesh)
  print("  overlap  " + ", ".join(f"{kind} {axis} {done}/{total}" for (kind, axis), (done, total) in sorted(counts.items())
                                  if axis != "other") + " (collectives with compute between start and done / all)")


parse_flags = flags_parser(PROGRAM)


def run():
  app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
  run()
