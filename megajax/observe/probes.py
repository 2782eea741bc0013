"""MegaScope's core: activation capture and perturbation inside the 3D step, all by config.

Off by default, and then free: `Probes.of` is None and the step traces exactly as
without this module. The trainer hands the probes to the step (ParallelStep.build(...,
probes=Probes.of(run.observe, run.model.num_layers))); the step calls them, it never imports them. With `observe.capture` ("0:attn_probs,*:residual") the model's sharded
forward pass (megajax.parallel.tensor_parallel) hands each observation point's tensor to
`LayerProbe.capture`, which reduces it to global statistics inside the shard_map:

  residual    [b, s/tp, hidden]      a layer's output (the residual stream), after any perturbation
  attn_out    [b, s, heads/tp * d]   the attention kernel's output, before the out projection
  mlp_out     [b, s, mlp/tp]         GeLU(x W_in + b), before the MLP's down projection
  attn_probs  [b, kv/tp, g, s, s]    softmax(QK^T / sqrt(d)) with the layer's causal / window mask,
                                     recomputed for that layer only (fused kernels never hold it);
                                     masked entries count as zeros, so its mean is 1 / seq_len

Every device holds a shard (rows over dp; the sequence or heads / hidden units over tp): the
sums, sums of squares and counts are psum'ed and the absmax pmax'ed over (dp, tp), so every
device ends with the same values (the step's metrics leave with out_spec P()). Microbatches
(train.microbatches) combine exactly (sums add, maxima max): the statistics are over the
whole global batch. The sample is the first `capture_sample` values of the flattened tensor
on the shard holding global row 0 (tp rank 0), psum'ed with the other shards' zeros: the
global tensor's first values while the sample fits in that shard's innermost extent.

Perturbations (`observe.perturb` at `observe.perturb_at`) hit a residual-stream tensor
[b, s/tp, hidden]: a layer's output ("layer:<i>", pp = 1) or what a pipeline stage sends on
("stage:<s>", parallel.pipeline). Their randomness is a counter-based hash of (step, the
layer whose output it is, global row, position, hidden unit), so a run repeats exactly and
every mesh perturbs the same elements alike: "stage:0" of a 2-stage pipeline equals
"layer:k-1" without one (k layers per stage). Backward, a perturbation is the identity
(straight-through): it is an event that happened to the activation, not part of the model.

The trainer writes the statistics to WORKDIR/activations.jsonl (`ActivationLog`); megajax-report
reads them back (`read_activations`).
"""

from __future__ import annotations

import dataclasses
import os

import jax
from jax import lax
import jax.numpy as jnp

from megajax.config import CAPTURE_TENSOR_CHOICES
from megajax.layers.attention import attention_probs
from megajax.observe.records import ACTIVATIONS, append_jsonl, drop_after, read_jsonl
from megajax.parallel import collectives
from megajax.parallel.mesh import DP, TP, to_varying

PREFIX = "capture/"           # the step's metrics keys: capture/<layer>:<tensor>/<statistic>
SEED = 0x6D4A5350             # the perturbations' hash seed: fixed, runs repeat exactly


# --- Configuration.

def parse_points(capture: str, num_layers: int) -> tuple[tuple[int, str], ...]:
  """"0:attn_probs,*:residual" -> ((0, "attn_probs"), (0, "residual"), (1, "residual"), ...),
  sorted by layer, then in CAPTURE_TENSOR_CHOICES order, without repeats."""
  points = set()
  for point in (x.strip() for x in capture.split(",") if x.strip()):
    layer, _, tensor = point.partition(":")
    layers = range(num_layers) if layer == "*" else (int(layer),)
    points.update((i, tensor) for i in layers)
  return tuple(sorted(points, key=lambda p: (p[0], CAPTURE_TENSOR_CHOICES.index(p[1]))))


def point_name(layer: int, tensor: str) -> str:
  return f"{layer}:{tensor}"


@dataclasses.dataclass(frozen=True, eq=False)
class Probes:
  """What observe.* asks of one step: the points to capture and the perturbation. `step`
  (the traced TrainState.step) is bound inside the step (`bind`): the perturbations' key."""
  points: tuple[tuple[int, str], ...]
  sample: int
  perturb: str                  # "", "noise", "offset" or "bitflip"
  perturb_site: str             # "layer" or "stage"
  perturb_where: int            # the layer or stage index
  scale: float
  bit: int
  fraction: float
  step: jax.Array | None = None

  @classmethod
  def of(cls, observe, num_layers: int) -> "Probes | None":
    """The observe section's probes for a model of `num_layers` layers; None unless
    observe.capture or observe.perturb is set: the step is then untouched."""
    o = observe
    if not o.wants_probes:
      return None
    site, _, where = o.perturb_at.partition(":") if o.perturb else ("", "", "-1")
    return cls(parse_points(o.capture, num_layers), o.capture_sample, o.perturb, site,
               int(where), float(o.perturb_scale), int(o.perturb_bit), float(o.perturb_fraction))

  def bind(self, step) -> "Probes":
    return dataclasses.replace(self, step=jnp.zeros((), jnp.int32) if step is None else step)

  @property
  def capturing(self) -> bool:
    return bool(self.points)

  def perturbs(self, site: str, where: int) -> bool:
    return self.perturb != "" and (self.perturb_site, self.perturb_where) == (site, where)

  def at_layer(self, layer: int, rows) -> "LayerProbe | None":
    """What the block of `layer` does (None: nothing, it runs as without probes). `rows`:
    the global batch rows of this device's microbatch, int32[b]."""
    tensors = tuple(t for i, t in self.points if i == layer)
    if not tensors and not self.perturbs("layer", layer):
      return None
    return LayerProbe(self, layer, tensors, rows)

  def rows(self, batch: dict):
    """int32[b]: the global batch rows of this device's batch shard (split over dp)."""
    b = batch["inputs"].shape[0]
    return collectives.axis_index(DP) * b + jnp.arange(b, dtype=jnp.int32)

  def perturb_sent(self, activation, stage, chunk, rows, stages: int, layers_per_chunk: int):
    """perturb_at="stage:<s>": the activation [b, s/n, hidden] a pipeline stage sends on,
    perturbed on stage s only (stage, chunk traced). Its site is the layer whose output it
    is, so this equals perturb_at="layer:<that layer>" on a mesh without a pipeline."""
    layer = (chunk * stages + stage) * layers_per_chunk + layers_per_chunk - 1
    return jnp.where(stage == self.perturb_where, perturb(activation, self, layer, rows), activation)

  # --- Statistics across microbatches and into the step's metrics.

  def zeros(self) -> dict:
    """The statistics of no data: what a microbatch scan's carry starts from."""
    zero = jnp.zeros((), jnp.float32)
    stats = dict(sum=zero, sum_sq=zero, count=zero, absmax=zero)
    if self.sample:
      stats["sample"] = jnp.zeros((self.sample,), jnp.float32)
    return {point_name(*p): dict(stats) for p in self.points}

  def combine(self, stats: dict, more: dict) -> dict:
    """Loss stats add; captured ones (under "capture") add too, except the maxima."""
    total = {k: v + more[k] for k, v in stats.items() if k != "capture"}
    if "capture" in stats:
      total["capture"] = {point: {k: (jnp.maximum if k == "absmax" else jnp.add)(v, more["capture"][point][k])
                                  for k, v in s.items()} for point, s in stats["capture"].items()}
    return total

  def metrics(self, captured: dict) -> dict:
    """Summed statistics -> {"capture/0:attn_probs/mean": ..., "/std", "/rms", "/absmax", "/sample"}."""
    out = {}
    for point, s in captured.items():
      count = jnp.maximum(s["count"], 1.0)
      mean, mean_sq = s["sum"] / count, s["sum_sq"] / count
      values = dict(mean=mean, std=jnp.sqrt(jnp.maximum(mean_sq - mean * mean, 0.0)), rms=jnp.sqrt(mean_sq),
                    absmax=s["absmax"])
      if self.sample:
        values["sample"] = s["sample"]
      out.update({f"{PREFIX}{point}/{k}": v for k, v in values.items()})
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class LayerProbe:
  """One layer's share of the probes, inside the shard_map: the tensors it captures and
  whether its output is perturbed."""
  probes: Probes
  layer: int
  tensors: tuple[str, ...]
  rows: jax.Array               # int32[b]: this microbatch's global batch rows

  def wants(self, tensor: str) -> bool:
    return tensor in self.tensors

  def capture(self, tensor: str, x) -> dict:
    """The global statistics of one tensor, this device holding its shard x."""
    with jax.named_scope(f"capture {tensor}"):
      return tensor_statistics(x, self.probes.sample, self.rows)

  def capture_probs(self, q, k, window, segment_ids=None) -> dict:
    """attn_probs from this layer's (rotated) local heads q [b, s, h/n, d], k [b, s, kv/n, d]
    (segment_ids [b, s]: packed documents)."""
    with jax.named_scope("capture attn_probs"):
      return tensor_statistics(attention_probs(q, k, window, segment_ids), self.probes.sample, self.rows)

  @property
  def perturbed(self) -> bool:
    return self.probes.perturbs("layer", self.layer)

  def perturb(self, x):
    """This layer's output x [b, s/n, hidden], perturbed."""
    return perturb(x, self.probes, self.layer, self.rows)


# --- Statistics inside the shard_map.

def tensor_statistics(x, sample: int, rows) -> dict:
  """Sums over the global tensor of which x is this device's shard (split over dp and tp):
  psum / pmax over (dp, tp), equal on every device. The sample comes from the shard holding
  global row 0 on tp rank 0. Observed, not differentiated (pmax has no derivative)."""
  local = lax.stop_gradient(x).astype(jnp.float32)
  sums = dict(sum=jnp.sum(local), sum_sq=jnp.sum(local * local), count=jnp.float32(local.size))
  if sample:
    first = local.reshape(-1)[:sample]
    holder = (rows[0] == 0) & (collectives.axis_index(TP) == 0)
    sums["sample"] = jnp.where(holder, jnp.pad(first, (0, sample - first.shape[0])), 0.0)
  stats = collectives.psum(jax.tree.map(lambda v: to_varying(v, (DP, TP)), sums), (DP, TP))   # one all-reduce
  stats["absmax"] = collectives.pmax(to_varying(jnp.max(jnp.abs(local)), (DP, TP)), (DP, TP))
  return stats


# --- Perturbations.

def _mix(x):
  """A bijective avalanche hash of uint32 values (Wellons' lowbias32)."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x21F0AAAD)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x735A2D97)
  return x ^ (x >> 15)


def _uniform(x, step, site, rows):
  """One uniform draw in (0, 1) per element of a residual-stream shard x [b, s/n, hidden],
  hashed from (step, site, global row, global position, hidden unit): the same on every mesh."""
  b, s_local, hidden = x.shape
  u32 = lambda v: jnp.asarray(v).astype(jnp.uint32)
  key = _mix(_mix(u32(step) ^ jnp.uint32(SEED)) + u32(site))
  positions = collectives.axis_index(TP) * s_local + jnp.arange(s_local)
  bits = _mix(_mix(_mix(key ^ u32(rows))[:, None] + u32(positions)[None, :])[..., None] + u32(jnp.arange(hidden)))
  return ((bits >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))          # [b, s/n, hidden]


def _straight_through(fn, x):
  """fn(x) forward, the identity backward."""
  @jax.custom_jvp
  def apply(x):
    return fn(x)
  apply.defjvp(lambda primals, tangents: (apply(*primals), tangents[0]))
  return apply(x)


@jax.named_scope("perturb")
def perturb(x, probes: Probes, site, rows):
  """observe.perturb on a residual-stream shard x [b, s/n, hidden] (site: the layer whose
  output x is). noise: + scale * N(0, 1); offset: + scale; bitflip: bit `bit` of the
  float32 value flipped on a `fraction` of the elements, then rounded back to x's dtype
  (for bf16 x, bits 0-15 of the float32 are below its precision: flips there vanish)."""
  def perturbed(x):
    value = x.astype(jnp.float32)
    if probes.perturb == "offset":
      return (value + probes.scale).astype(x.dtype)
    uniform = _uniform(x, probes.step, site, rows)
    if probes.perturb == "noise":
      normal = jnp.sqrt(2.0) * lax.erf_inv(2.0 * uniform - 1.0)
      return (value + probes.scale * normal).astype(x.dtype)
    flipped = lax.bitcast_convert_type(lax.bitcast_convert_type(value, jnp.uint32) ^ jnp.uint32(1 << probes.bit),
                                       jnp.float32)
    return jnp.where(uniform < probes.fraction, flipped, value).astype(x.dtype)
  return _straight_through(perturbed, x)


# --- The trainer's side.

class ActivationLog:
  """Takes the capture/* statistics out of each step's metrics; every `observe.capture_every`
  steps the chief appends one JSON line per point to WORKDIR/activations.jsonl:
  {"step", "point", "mean", "std", "rms", "absmax"[, "sample"]}. A step's values are read
  after the next step was dispatched (no stall), like the trainer's non-finite guard. A run
  resumed from step n (`start_step`) first drops the file's records after step n."""

  def __init__(self, observe, workdir: str | None, enabled: bool, start_step: int = 0):
    self.every = observe.capture_every if observe.capture else 0
    self.path = os.path.join(workdir, ACTIVATIONS) if self.every and workdir and enabled else None
    self.pending = None                      # (step, captured metrics) not yet written
    if self.path and start_step:
      drop_after(self.path, start_step)
    elif self.path:
      open(self.path, "w").close()

  def take(self, step: int, metrics: dict) -> dict:
    """The step's metrics without capture/* keys; writes the previous captured step."""
    if not self.every:
      return metrics
    captured = {k: v for k, v in metrics.items() if k.startswith(PREFIX)}
    previous, self.pending = self.pending, (step, captured) if self.path and step % self.every == 0 else None
    if previous:
      self._write(*previous)
    return {k: v for k, v in metrics.items() if not k.startswith(PREFIX)}

  def flush(self) -> None:
    previous, self.pending = self.pending, None
    if previous:
      self._write(*previous)

  def _write(self, step: int, captured: dict) -> None:
    records = {}
    for key, value in jax.device_get(captured).items():      # waits for that step only
      point, statistic = key[len(PREFIX):].rsplit("/", 1)
      records.setdefault(point, {"step": step, "point": point})[statistic] = (
          [float(v) for v in value] if statistic == "sample" else float(value))
    append_jsonl(self.path, list(records.values()))


def read_activations(path: str) -> dict[str, list[dict]]:
  """{point: [record, ...] sorted by step} from activations.jsonl, the last record of each (step, point) kept."""
  by_point: dict[str, dict[int, dict]] = {}
  for record in read_jsonl(path):
    if "step" in record and "point" in record:
      by_point.setdefault(str(record["point"]), {})[int(record["step"])] = record
  return {point: [records[s] for s in sorted(records)] for point, records in sorted(by_point.items())}
