"""The (dp, pp, cp, tp) device mesh, and the axis names every spec and collective in megajax uses.

Placement follows MegaScale section 2: tensor parallelism is the innermost axis, so a TP
group is a set of devices on one host (NVLink); context parallelism next (its halo and ring
permutes every layer want the next-fastest links, as in Megatron-Core's tp-cp-dp-pp order);
across hosts data-parallel groups are built before pipeline groups, so DP traffic crosses
the fewest network tiers. The devices are laid out physically as (pp, dp, cp, tp), outermost
first, then viewed as (dp, pp, cp, tp) - the order every spec in megajax is written in.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
import numpy as np

from megajax.config import ConfigError
from megajax.parallel.collectives import live_axes

DP = "dp"  # data parallel (ZeRO-2 shards optimizer state and gradients along it)
PP = "pp"  # pipeline stages
CP = "cp"  # context parallel: a row's positions split over devices (megajax.parallel.context_parallel)
TP = "tp"  # tensor + sequence parallel
MESH_AXES = (DP, PP, CP, TP)

# The whole step is one shard_map (manual on every axis), so the axes' type only matters for
# the jitted code around it (initialization, batch placement): Auto lets XLA propagate the
# shardings we hand to jit there, instead of jax 0.10's default of Explicit sharding-in-types.
AXIS_TYPES = (AxisType.Auto,) * len(MESH_AXES)


def varying_axes(x) -> frozenset:
  """The mesh axes a value inside shard_map varies over (its type's manual-axis info)."""
  return aval_varying_axes(jax.typeof(x))


def aval_varying_axes(aval) -> frozenset:
  """varying_axes of an abstract value (a traced program's variable)."""
  manual = getattr(aval, "manual_axis_type", None)  # jax 0.10; older/newer lines keep `vma`
  return frozenset(manual.varying if manual is not None else getattr(aval, "vma", None) or ())


def to_varying(x, axes: tuple[str, ...]):
  """Marks a value equal on every device of `axes` as per-device there (no data moves), so
  its gradient stays per-device too and the caller reduces it explicitly. Axes of one device
  are left out: nothing varies along them (megajax.parallel.collectives)."""
  missing = tuple(a for a in live_axes(axes) if a not in varying_axes(x))
  if not missing:
    return x
  pcast = getattr(jax.lax, "pcast", None)
  return pcast(x, missing, to="varying") if pcast is not None else jax.lax.pvary(x, missing)


def after(x, deps, never):
  """`x` bit for bit, computed only once `deps` are: one element of each leaf of `deps`
  selected under `never`, a condition false at run time that the compiler cannot see
  through. How the step orders work XLA would otherwise place freely (XLA:CPU drops
  optimization barriers before it runs a program; a data dependency it keeps), and the
  earliest an asynchronous collective on `x` can start. The result varies over the mesh
  axes of x, deps and never together. No gradient flows into `deps` (an order, not a value:
  inside a differentiated function a cotangent there would transpose whatever made them)."""
  return jnp.where(never, picked(deps).astype(x.dtype), x)


def after_by_one_element(x, deps, never):
  """after(x, deps, never), the dependency carried by x's first element alone: -0.0 (which
  adds to every value bit for bit) added there, or what `deps` pick under `never`. XLA adds
  it in place where x has no reader left (no pass over x, as after()'s select is where no
  consumer fuses it), and the gradient w.r.t. x is the cotangent itself (after()'s select
  has a select of the cotangent for transpose)."""
  first = (0,) * x.ndim
  return x.at[first].add(jnp.where(never, picked(deps), -0.0).astype(x.dtype))


def picked(deps):
  """One element of each leaf of `deps`, summed (fp32), no gradient: what after() selects."""
  return sum(jnp.ravel(jax.lax.stop_gradient(leaf))[0].astype(jnp.float32) for leaf in jax.tree.leaves(deps))


def _host_split(dp: int, pp: int, cp: int, tp: int, per_host: int):
  """(in-host, across-host) sizes in physical (pp, dp, cp, tp) order; TP first, then CP, then
  DP, in a host."""
  if per_host % tp:
    raise ConfigError("parallel.tp", tp, f"a tensor-parallel group must fit on one host of {per_host} devices",
                      f"use a divisor of {per_host}")
  rest = per_host // tp
  cp_in = math.gcd(cp, rest)
  dp_in = math.gcd(dp, rest // cp_in)
  pp_in = math.gcd(pp, rest // cp_in // dp_in)
  if dp_in * pp_in * cp_in * tp != per_host:
    raise ConfigError("parallel", f"dp={dp} pp={pp} cp={cp} tp={tp}",
                      f"hosts of {per_host} devices cannot be filled by whole cp/dp/pp groups",
                      "make dp * pp * cp * tp a multiple of the devices per host with tp dividing it")
  return (pp_in, dp_in, cp_in, tp), (pp // pp_in, dp // dp_in, cp // cp_in, 1)


def make_mesh(parallel, devices=None) -> Mesh:
  """The (dp, pp, cp, tp) mesh of the config's parallel section over `devices` (default: every
  device of the job)."""
  dp, pp, cp, tp = parallel.dp, parallel.pp, parallel.cp, parallel.tp
  count = dp * pp * cp * tp
  devices = list(jax.devices() if devices is None else devices)
  if count != len(devices):
    raise ConfigError("parallel", f"dp={dp} pp={pp} cp={cp} tp={tp}",
                      f"the mesh has {count} devices but the job has {len(devices)}",
                      f"choose dp * pp * cp * tp = {len(devices)} (or run on {count} devices; on CPU set "
                      f"XLA_FLAGS=--xla_force_host_platform_device_count={count})")
  processes = {d.process_index for d in devices}
  if len(processes) == 1:
    physical = mesh_utils.create_device_mesh((pp, dp, cp, tp), devices, allow_split_physical_axes=True)
  else:
    in_host, across_hosts = _host_split(dp, pp, cp, tp, len(devices) // len(processes))
    physical = mesh_utils.create_hybrid_device_mesh(in_host, across_hosts, devices, process_is_granule=True,
                                                    allow_split_physical_axes=True)
  return Mesh(np.transpose(physical, (1, 0, 2, 3)), MESH_AXES, axis_types=AXIS_TYPES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Global batches [B, S]: rows split over dp, with cp > 1 the positions over cp (the
  dual-chunk layout: ParallelStep.put_batch), replicated over pp and tp."""
  return NamedSharding(mesh, P(DP, CP) if mesh.shape[CP] > 1 else P(DP))


def batch_spec(mesh: Mesh) -> P:
  """The batch's spec inside the step's shard_map: rows over dp, positions over cp; an axis of
  one device left out (P() for dp = cp = 1), so that nothing in the step varies over an axis
  of one device (megajax.parallel.collectives)."""
  rows = DP if mesh.shape[DP] > 1 else None
  return P(rows, CP) if mesh.shape[CP] > 1 else P(rows) if rows else P()


def local_device_coordinates(mesh: Mesh) -> list[dict]:
  """This process's devices of the mesh, in jax.local_devices() order (a trace names a
  device by that local ordinal): [{"id", "coords": [dp, pp, cp, tp]}]."""
  coords = {device.id: [int(i) for i in index] for index, device in np.ndenumerate(mesh.devices)}
  return [{"id": int(d.id), "coords": coords[d.id]} for d in jax.local_devices() if d.id in coords]


def local_batch_slice(mesh: Mesh, global_batch: int) -> tuple[int, int]:
  """(index, count): this process holds rows index*B/count .. (index+1)*B/count - 1 of each batch.

  The data loader reads exactly these rows, so a process never loads data it does not hold.
  """
  indices = NamedSharding(mesh, P(DP)).addressable_devices_indices_map((global_batch,))
  starts = sorted({s[0].start or 0 for s in indices.values()})
  stops = sorted({s[0].stop if s[0].stop is not None else global_batch for s in indices.values()})
  lo, hi = starts[0], stops[-1]
  rows = hi - lo
  if global_batch % rows or lo % rows or sum(stop - start for start, stop in zip(starts, stops)) != rows:
    raise ConfigError("parallel", f"dp={mesh.shape[DP]}", "this process's batch rows are not one contiguous slice",
                      "use a dp that is a multiple of the process count")
  return lo // rows, global_batch // rows
