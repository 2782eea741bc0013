"""Plans a user can read: the legend, each plan's memory and time by part, why the best beats
the next ones, which executor is modelled, and one plan's full accounting (`explain`).

megajax-plan prints these (launch/plan.py); they read a Candidate (plans.assess) and the
cost model's parts, nothing else.
"""

from __future__ import annotations

from megajax import flops
from megajax.model import ModelConfig
from megajax.parallel.planner import cost_model, hardware, memory, operations
from megajax.parallel.planner.cost_model import GB, CALIBRATION, Calibration, Hardware, Plan
from megajax.parallel.planner.plans import Candidate, assess, describe

LEGEND = """legend: dp, pp, tp   data-, pipeline- and tensor-parallel degrees (dp x pp x tp = GPUs)
        v            model chunks per pipeline stage (interleaved 1F1B; 1: plain 1F1B)
        b            sequences per microbatch per dp rank;  m  microbatches per step per dp rank
        memory GB    per GPU of the busiest stage;  step s  one training step;  MFU  model FLOPs
                     (megajax.flops, recomputation not counted) / (step x GPUs x bf16 peak)
        bubble       idle share of a stage, (pp - 1) / (v m);  bottleneck  the step's largest part
                     (when that is compute, the largest loss beside it)"""

EXECUTORS = {
    "megajax": ("this repository's step: sequence-parallel tp with collective matmul, ZeRO gathers "
                "in bf16 (embedding and norms fp32), one fp32 gradient reduce-scatter per step, dp "
                "overlap as built (the first chunk's and the shared leaves' collectives exposed), the "
                "embedding and head on every stage, pipeline backward from kept residuals"),
    "paper": ("Megatron-LM with MegaScale's switches, the system the MegaScale paper measured: the "
              "first chunk's gather prefetched, the embedding and head on the first and last stages "
              "only, activations as Korthikanti et al. count them; megajax plans may not fit where "
              "these do, and expose more dp communication"),
}

# How each way the megajax executor is modelled apart from the paper's is known: checked in the
# compiled step's HLO by a test, read from the deviceless H100 schedule, or assumed.
MEGAJAX_TERMS = (
    ("tp: one all-gather and one reduce-scatter a parallel linear pair, forward and backward (no "
     "re-gather for the weight gradient)", "HLO-verified: test_tp_collectives_per_layer_without_overlap"),
    ("tp collectives hidden by the collective-matmul ring (Calibration.tp_overlap_hidden, fitted on MegaScale's)",
     "schedule-read: 103 of 104 ring hops have a matmul under them on the deviceless H100 step; time assumed"),
    ("ZeRO gathers in the compute dtype (fp32 embedding and norms), one layer ahead",
     "HLO-verified: test_zero_gathers_the_linears_in_the_compute_dtype, test_zero_gathers_are_issued_one_layer_ahead"),
    ("one fp32 gradient reduce-scatter a step (grad_sync step), per chunk in the pipeline's edge ticks",
     "HLO-verified: test_dp_reduce_scatters_once_per_step_or_per_microbatch, "
     "test_pipeline_dp_collectives_run_per_chunk_in_the_edge_ticks"),
    ("dp collectives exposed: the first chunk's and the shared leaves' around the tick scan",
     "schedule-read: every dp gather but the first and every reduce-scatter overlap on the deviceless H100 "
     "step; how much of each is hidden: assumed"),
    ("the embedding and head on every pipeline stage (memory and their gradients' reduction)",
     "counted from the step's layouts (test_param_counts_match_the_model)"),
    ("the pipeline's residual slots written and read every tick (the default backward)",
     "not in the step time: unknown (on CPU the rerun is faster, measured; on GPUs not yet measured)"),
)


def memory_parts(x: Candidate) -> dict:
  m = x.memory
  return {"state": m.state, "params+grads": m.params_temp, "activations": m.activations,
          "temporaries": m.logits + m.pipeline}


def memory_line(x: Candidate) -> str:
  return "memory " + ", ".join(f"{name} {nbytes / GB:.1f}" for name, nbytes in memory_parts(x).items()) + " GB"


def time_line(x: Candidate) -> str:
  return "time " + ", ".join(f"{name} {seconds:.2f}" for name, seconds in x.time.parts().items() if seconds >= 5e-3) + " s"


def _fields(plan: Plan) -> dict:
  return {"dp": plan.dp, "pp": plan.pp, "cp": plan.cp, "tp": plan.tp, "v": plan.virtual_stages, "b": plan.micro_batch,
          "m": plan.microbatches, "pipeline_recompute": plan.pipeline_recompute}


# Plans whose predicted steps differ by less than this share of #1's are ties: the validation
# set's median miss (`bench planner`: about 3 MFU points or 3% of the TFLOP/s published, 3-6%
# of a step) is larger, so the model cannot rank them.
TIE_FRACTION = 0.03


def why_first(best: Candidate, other: Candidate) -> str:
  """What differs between two plans, the parts of the step that differ most either way (#1's
  minus this one's; the rest summed, so they add up to the step's change), and whether the two
  are a tie within the model's error."""
  a, b = _fields(best.plan), _fields(other.plan)
  differs = ", ".join(f"{k} {b[k]} -> {a[k]}" for k in a if a[k] != b[k])
  theirs, ours = other.time.parts(), best.time.parts()
  deltas = {k: ours[k] - theirs[k] for k in ours}
  largest = [k for k in sorted(deltas, key=lambda k: -abs(deltas[k]))[:4] if abs(deltas[k]) >= 5e-3]
  rest = sum(d for k, d in deltas.items() if k not in largest)
  shown = ", ".join([f"{k} {deltas[k]:+.2f} s" for k in largest] + [f"other parts {rest:+.2f} s"])
  step = best.time.total - other.time.total
  tie = "; a tie: within the model's error" if abs(step) <= TIE_FRACTION * best.time.total else ""
  return (f"#1 over this: {differs}: {shown} (step {step:+.2f} s, memory "
          f"{(best.memory.total - other.memory.total) / GB:+.1f} GB){tie}")


def explain(c: ModelConfig, plan: Plan, hw: Hardware, remat: str, calibration: Calibration = CALIBRATION) -> list[str]:
  """One plan's full accounting, line by line."""
  x = assess(c, plan, hw, remat, calibration)
  run = cost_model.apply_switches(c, plan.opts)
  t, usable = x.time, cost_model.usable_bytes(hw)
  lines = [f"plan {describe(plan)} on {plan.gpus} {hw.name}, batch {plan.batch}, executor {plan.executor}, "
           f"remat {remat}",
           f"executor: {EXECUTORS[plan.executor]}",
           f"memory per GPU (busiest stage): {x.memory.total / GB:.1f} GB of {usable / GB:.0f} usable: "
           f"{'fits' if x.fits else 'DOES NOT FIT'}"
           + (f" (with the {memory.estimate_margin(plan):.0%} margin for the estimate's error)"
              if memory.estimate_margin(plan) else "")]
  notes = {"state": "fp32 master + 2 moments (+ bf16 weights and fp32 gradients for paper)",
           "params+grads": "gathered compute parameters, gradient buffers and sums",
           "activations": ("what the backward needs: " + (
               f"{memory.residual_slots(plan)} residual slots of a microbatch-chunk and one chunk's working set"
               if plan.executor == "megajax" else
               f"{memory.megatron_microbatches_in_flight(plan):.1f} microbatches of the stage's layers "
               "in flight (Korthikanti et al.)")),
           "temporaries": "fp32 logits of a microbatch, pipeline message buffers"}
  for name, nbytes in memory_parts(x).items():
    lines.append(f"  {name:14} {nbytes / GB:8.2f} GB   {notes[name]}")
  k = calibration
  device_rows = cost_model.per_device_rows(run, plan)      # a device's share of the rows (cp)
  layer = cost_model.mean_layer(device_rows, plan, hw, k)
  head = operations.head_times(device_rows, plan.micro_batch, plan.tp, hw, k)
  layers = run.num_layers // plan.pp
  lines.append(f"step {t.total:.3f} s, MFU {100 * t.mfu:.1f}%: {plan.microbatches} microbatches x "
               f"{layers} layers (+ the head) on the last stage")
  ms = lambda s: f"{1e3 * s:.2f} ms"
  lines.append(f"  one layer, one microbatch: GEMMs forward {ms(layer.gemm_forward)}, dX {ms(layer.gemm_input_grad)}, "
               f"dW {ms(layer.gemm_weight_grad)}; attention {ms(layer.attention_forward)} + "
               f"{ms(layer.attention_backward)}; memory-bound {ms(layer.elementwise_forward)} + "
               f"{ms(layer.elementwise_backward)}; head {ms(head[0])} + {ms(head[1])}")
  parts = [("gemm", t.gemm, "matmuls, recomputation included"), ("attention", t.attention, "attention core"),
           ("memory-bound", t.memory_bound, "norms, activations, dropout, residuals"),
           ("tp-comm", t.tp_comm, "exposed tensor-parallel collectives"),
           ("cp-comm", t.cp_comm, "exposed context-parallel sends (halos, ring steps)"),
           ("pp-comm", t.pp_comm, "exposed pipeline transfers"),
           ("bubble", t.bubble, f"(pp - 1) / v = {(plan.pp - 1) / plan.virtual_stages:.2f} microbatches' time"),
           ("dp-comm", t.dp_comm, "exposed gradient and parameter collectives"),
           ("optimizer", t.optimizer, "the update's pass over its shard"),
           ("data", t.data, "exposed data loading"),
           ("stragglers", t.straggler, f"the wait for a slow machine ({100 * calibration.straggler_slowdown:.0f}% "
            f"longer x its chance in {hardware.nodes(plan.gpus, hw)} nodes, "
            f"{hardware.slow_machine_chance(plan.gpus, hw):.0%})"),
           ("(recompute)", t.recompute, "of the above, forwards rerun")]
  lines += [f"  {name:14} {seconds:8.3f} s   {note}" for name, seconds, note in parts]
  model_flops = flops.training_flops_per_token(run) * plan.batch * run.seq_len
  lines.append(f"model FLOPs per step {model_flops:.4g}: {model_flops / (t.total * plan.gpus) / 1e12:.1f} TFLOP/s "
               f"per GPU of {hw.peak_tflops:g}")
  return lines


def parse_explain(value: str, batch: int, opts, executor: str) -> Plan:
  """`dp,pp,tp,v,b` or `dp,pp,tp,v,b,cp` -> a Plan (ValueError naming what is wrong)."""
  parts = value.split(",")
  if len(parts) not in (5, 6) or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
    raise ValueError("want five positive integers dp,pp,tp,v,b (and cp), e.g. --explain=128,12,8,8,2")
  dp, pp, tp, v, b, *cp = map(int, parts)
  if batch % (dp * b):
    raise ValueError(f"dp x b = {dp * b} does not divide the batch {batch}")
  return Plan(dp, pp, tp, v, b, batch, opts, executor, cp=cp[0] if cp else 1)
