r"""Diagnostic tests (MegaScale section 4): find the slow host or device of a job.

Every process of the job calls `diagnose(config)` on the training config's mesh, which measures:
  per device     matmul TFLOP/s, host->device and device->host bandwidth (GB/s);
  collectives    all-reduce, all-gather and ppermute bus bandwidth (nccl-tests convention)
                 over each mesh axis (dp, pp, cp, tp) larger than 1, and over "processes" (one device
                 per process in each group) when the job has several processes; every process
                 times the same collective, so one waiting on a slow peer is visible.
Each figure is the median of `repeats` timed runs after a warm-up (on CPU the best run: there
every device shares the host's cores with whatever else runs). A value below 0.9 x the job's
median is an outlier, worth a look and nothing more. A device figure below SLOW_RATIO = 0.5 x
the median of the other processes' devices is slow (`find_slow`), and `bad_processes` lists
the processes with a slow device; a collective is timed by all its members at once, so a low
figure there names a slow group (an outlier) but not which member slowed it, and never makes
a process bad. `format_findings` prints it as tables.

Eviction needs evidence (`processes_to_evict`, the supervisor's rule): a process the failure
blamed is evicted only when SLOW_RUNS = 2 diagnostic runs in a row find it slow; the
supervisor runs the diagnostics again while that may be so, and restarts on the same hosts
as soon as it is not. Why these numbers: run-to-run noise measured on a 2-core CPU machine,
2 processes x 4 devices (`megajax-local --processes 2 --devices-per-process 4 --module
megajax.launch.diagnose -- --config=configs/default.py --config.parallel.dp=2
--config.parallel.pp=1 --config.parallel.tp=4`), 31 quiet runs (load 0.1-2.8) and 20 loaded
ones (two busy loops beside other tests, load 1.6-7.2): a healthy device's figure over the
other process's median was never below 0.69 (matmul 0.69, host-to-device 0.82, device-to-host
0.84; under load the 1st percentiles 0.71, 0.83, 0.89), and the job's median moved up to 1.4x between runs.
The former rule (a device outlier below 0.9 x the job's median) named a healthy process in 9
of those 51 runs (18%): the operator's host-to-device 8.6 vs 10.4 GB/s (0.83x) was noise.
The fault drill (debug.diagnose_slow_process) makes every device timing of its process
DRILL_SLOWDOWN = 4 x as long: measured at 0.22-0.24 x the other process, well below 0.5.

The command is megajax-diagnose (megajax.launch.diagnose); the supervisor runs it after a
failure and reads its JSON findings. Fault drill: debug.diagnose_slow_process (megajax.trainer.drills).
"""


from __future__ import annotations

import json
import os
import socket
import statistics
import time

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
import numpy as np

from megajax.observe.records import write_atomically
from megajax.parallel import make_mesh
from megajax.parallel.fbd import group_mesh
from megajax.sections import section
from megajax.trainer.drills import diagnose_slowed

# Sizes that keep an accelerator busy long enough to time, and a CPU run to a few seconds.
ACCELERATOR_SIZES = dict(matmul_size=8192, transfer_mib=1024, collective_mib=256, repeats=10)
CPU_SIZES = dict(matmul_size=256, transfer_mib=8, collective_mib=1, repeats=10)
DEVICE_METRICS = ("matmul_tflops", "h2d_gbps", "d2h_gbps")
COLLECTIVE_OPS = ("all_reduce", "all_gather", "ppermute")
PROCESSES = "processes"    # the cross-process group's axis name
CALLS = 4                  # back-to-back calls per timed collective trial
THRESHOLD = 0.9            # outlier (worth a look): below this fraction of the job's median
# Eviction evidence (the module docstring has the noise these stand clear of): a device below
# SLOW_RATIO x the median of the other processes' devices makes its process slow in a run; the
# supervisor evicts a process only when SLOW_RUNS runs in a row find it slow.
SLOW_RATIO = 0.5
SLOW_RUNS = 2
DRILL_SLOWDOWN = 4         # debug.diagnose_slow_process: the process's device timings x this


def find_outliers(values: list[dict], metric: str, threshold: float = THRESHOLD) -> list[dict]:
  """The entries of `values` whose `metric` is below threshold x the median over all of them."""
  if not values:
    return []
  median = statistics.median(v[metric] for v in values)
  return [{"metric": metric, "process": v["process"], "host": v["host"], "device_id": v.get("device_id"),
           "value": v[metric], "median": median}
          for v in values if v[metric] < threshold * median]


def find_slow(devices: list[dict]) -> list[dict]:
  """The devices with a DEVICE_METRICS figure below SLOW_RATIO x the median of that figure over
  the other processes' devices: a slow host cannot pull its own reference down, as it does
  the job's median when it holds half the devices. None in a one-process job (no other host
  to compare with, none to continue on)."""
  slow = []
  for metric in DEVICE_METRICS:
    for process in sorted({d["process"] for d in devices}):
      others = [d[metric] for d in devices if d["process"] != process]
      reference = statistics.median(others) if others else 0.0
      slow += [{"metric": metric, "process": process, "host": d["host"], "device_id": d["device_id"],
                "value": d[metric], "others_median": reference}
               for d in devices if d["process"] == process and d[metric] < SLOW_RATIO * reference]
  return slow


def processes_to_evict(findings_of_runs: list[dict], blamed: list[int], runs: int = SLOW_RUNS) -> list[int] | None:
  """The eviction rule, after these consecutive diagnostic runs' findings: the processes the
  failure blamed that every one of `runs` runs found slow (`bad_processes`). None while
  undecided: fewer runs than that, and a blamed process slow in each so far (run again). A
  run that clears every blamed process decides at once: nobody."""
  suspects = set(blamed).intersection(*(r["bad_processes"] for r in findings_of_runs))
  if suspects and len(findings_of_runs) < runs:
    return None
  return sorted(suspects)


def _summary(platform: str):
  """How repeats become one figure: the median on accelerators; on CPU the best run, since a
  CPU device shares its cores with everything else on the host and slower runs time that."""
  return min if platform == "cpu" else statistics.median


def _timed(fn, slow: bool) -> float:
  """Seconds of one fn() call; the fault drill (slow) sleeps inside the timed region until the
  call has taken DRILL_SLOWDOWN x as long."""
  start = time.perf_counter()
  fn()
  if slow:
    time.sleep((DRILL_SLOWDOWN - 1) * (time.perf_counter() - start))
  return time.perf_counter() - start


def _measure_devices(devices, coords_of, matmul_size: int, transfer_bytes: int, repeats: int,
                     slow: bool) -> list[dict]:
  """Matmul TFLOP/s and transfer GB/s of each local device (from `repeats` timed runs)."""
  platform = devices[0].platform
  summary = _summary(platform)
  dtype = jnp.float32 if platform == "cpu" else jnp.bfloat16
  matmul = jax.jit(jnp.matmul)   # runs on the device its (committed) inputs live on
  square = np.ones((matmul_size, matmul_size), dtype)
  operands = {d: jax.device_put(square, d) for d in devices}
  host_buffer = np.ones(transfer_bytes // 4, np.float32)
  for d in devices:            # warm-up: compile, first touches
    matmul(operands[d], operands[d]).block_until_ready()
    jax.device_put(host_buffer, d).block_until_ready()
  # On CPU np.asarray can alias the device buffer; a copy makes it a real transfer.
  to_host = (lambda x: np.array(x, copy=True)) if platform == "cpu" else np.asarray
  times = {d: {m: [] for m in DEVICE_METRICS} for d in devices}
  # Repeats go round the devices, so a burst of load elsewhere on the host hits them all alike.
  for _ in range(repeats):
    for d in devices:
      a = operands[d]
      times[d]["matmul_tflops"].append(_timed(lambda: matmul(a, a).block_until_ready(), slow))
      put = []
      times[d]["h2d_gbps"].append(_timed(lambda: put.append(jax.device_put(host_buffer, d).block_until_ready()), slow))
      times[d]["d2h_gbps"].append(_timed(lambda: to_host(put[0]), slow))   # a fresh array: nothing cached
  flops = 2 * matmul_size ** 3
  host = socket.gethostname()
  return [{"process": d.process_index, "host": host, "device_id": d.id, "coords": coords_of(d),
           "matmul_tflops": flops / summary(times[d]["matmul_tflops"]) / 1e12,
           "h2d_gbps": transfer_bytes / summary(times[d]["h2d_gbps"]) / 1e9,
           "d2h_gbps": transfer_bytes / summary(times[d]["d2h_gbps"]) / 1e9}
          for d in devices]


def _collective_programs(mesh: Mesh, axis: str) -> dict:
  """op -> the jitted shard_map program doing it over `axis` on every device's block."""
  n = mesh.shape[axis]
  spec = P(tuple(mesh.axis_names))    # every device holds its own row
  ring = [(i, (i + 1) % n) for i in range(n)]
  bodies = {"all_reduce": lambda x: lax.psum(x, axis),
            "all_gather": lambda x: lax.all_gather(x, axis, tiled=True),
            "ppermute": lambda x: lax.ppermute(x, axis, ring)}
  return {op: jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
          for op, body in bodies.items()}


def _bus_bandwidth(op: str, nbytes: int, seconds: float, n: int) -> float:
  """GB/s by the nccl-tests convention, so figures compare across group sizes."""
  algbw = nbytes / seconds / 1e9
  return algbw * {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "ppermute": 1.0}[op]


def _measure_collectives(mesh: Mesh, group: str, collective_bytes: int, repeats: int) -> list[dict]:
  """This process's time and bus bandwidth of each op over the mesh axis `group`."""
  n = mesh.shape[group]
  elements = max(n, collective_bytes // 4 // n * n)    # all-gather: n equal pieces
  sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))   # one row per device
  host = socket.gethostname()
  results = []
  for op, program in _collective_programs(mesh, group).items():
    # all_reduce / ppermute move one buffer per device; all_gather's bytes are the gathered size.
    per_device = elements // n if op == "all_gather" else elements
    x = jax.jit(lambda: jnp.ones((mesh.size, per_device), jnp.float32), out_shardings=sharding)()
    program(x).block_until_ready()    # compile
    trials = []
    for _ in range(repeats):
      if jax.process_count() > 1:
        multihost_utils.sync_global_devices("megajax-diagnose")   # every process starts a trial together
      trials.append(_time_calls(program, x))
    seconds = _summary(mesh.devices.flat[0].platform)(trials)
    results.append({"group": group, "op": op, "bytes": elements * 4, "process": jax.process_index(),
                    "host": host, "seconds": seconds, "busbw_gbps": _bus_bandwidth(op, elements * 4, seconds, n)})
  return results


def _time_calls(program, x) -> float:
  """Seconds per call of CALLS back-to-back calls (a process's start skew spread over them)."""
  start = time.perf_counter()
  for _ in range(CALLS):
    y = program(x)
  y.block_until_ready()
  return (time.perf_counter() - start) / CALLS


def _process_mesh() -> Mesh:
  """(processes, local): the same local index on every process forms a cross-process group."""
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  grid = np.array(devices, dtype=object).reshape(jax.process_count(), jax.local_device_count())
  return Mesh(grid, (PROCESSES, "local"), axis_types=(AxisType.Auto,) * 2)


def _gather_from_processes(local) -> list:
  """Every process's JSON-serialisable `local`, in process order, on every process."""
  if jax.process_count() == 1:
    return [local]
  data = np.frombuffer(json.dumps(local).encode(), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int32))).reshape(-1)
  padded = np.zeros(int(sizes.max()), np.uint8)
  padded[:data.size] = data
  rows = np.asarray(multihost_utils.process_allgather(padded))
  return [json.loads(bytes(row[:size])) for row, size in zip(rows, sizes)]


def diagnose(config, *, matmul_size=None, transfer_mib=None, collective_mib=None, repeats=None) -> dict:
  """Measures this job's devices and collectives; every process must call it. Returns the whole
  job's findings (see the module docstring) on every process."""
  start = time.perf_counter()
  # MegaFBD's job is two groups, not one mesh: every device measured as one dp line of them.
  parallel = section(config, "parallel")
  mesh = group_mesh(jax.devices(), len(jax.devices()), 1) if parallel.fbd.enabled else make_mesh(parallel)
  platform = jax.devices()[0].platform
  sizes = CPU_SIZES if platform == "cpu" else ACCELERATOR_SIZES
  matmul_size = matmul_size or sizes["matmul_size"]
  transfer_bytes = max(4, int((transfer_mib or sizes["transfer_mib"]) * 2**20))
  collective_bytes = max(4, int((collective_mib or sizes["collective_mib"]) * 2**20))
  repeats = repeats or sizes["repeats"]

  def coords_of(device):       # {axis: index} over the mesh's axes (megajax.parallel.mesh.MESH_AXES)
    index = np.argwhere(mesh.devices == device)[0]
    return {axis: int(i) for axis, i in zip(mesh.axis_names, index)}

  slow = diagnose_slowed(config.debug, jax.process_index())
  devices = _measure_devices(jax.local_devices(), coords_of, matmul_size, transfer_bytes, repeats, slow)
  collectives = []
  for axis in mesh.axis_names:
    if mesh.shape[axis] > 1:
      collectives += _measure_collectives(mesh, axis, collective_bytes, repeats)
  if jax.process_count() > 1:
    collectives += _measure_collectives(_process_mesh(), PROCESSES, collective_bytes, repeats)

  gathered = _gather_from_processes({"devices": devices, "collectives": collectives})
  devices = sorted((d for g in gathered for d in g["devices"]), key=lambda d: (d["process"], d["device_id"]))
  order = {(c["group"], c["op"]): i for i, c in enumerate(gathered[0]["collectives"])}   # the same everywhere
  collectives = sorted((c for g in gathered for c in g["collectives"]),
                       key=lambda c: (order[c["group"], c["op"]], c["process"]))
  outliers = [o for metric in DEVICE_METRICS for o in find_outliers(devices, metric)]
  for group in dict.fromkeys(c["group"] for c in collectives):
    for op in COLLECTIVE_OPS:
      for o in find_outliers([c for c in collectives if c["group"] == group and c["op"] == op], "busbw_gbps"):
        outliers.append({**o, "metric": f"{op} over {group} busbw_gbps"})
  slow = find_slow(devices)
  return {"platform": platform, "process_count": jax.process_count(), "devices": devices,
          "collectives": collectives, "outliers": outliers, "slow": slow,
          "bad_processes": sorted({s["process"] for s in slow}), "seconds": time.perf_counter() - start}


def format_findings(findings: dict) -> str:
  """The findings as tables: devices (with their coordinates on each mesh axis the findings
  name), collectives, outliers, then the bad processes."""
  axes = list(findings["devices"][0]["coords"]) if findings["devices"] else []
  lines = [f"megajax-diagnose: {findings['platform']}, {findings['process_count']} process(es), "
           f"{len(findings['devices'])} devices, {findings['seconds']:.1f} s",
           "", f"{'process':>7}  {'host':<16} {'device':>6}  " + " ".join(f"{a:>3}" for a in axes)
           + f"  {'matmul TFLOP/s':>14} {'h2d GB/s':>9} {'d2h GB/s':>9}"]
  for d in findings["devices"]:
    lines.append(f"{d['process']:>7}  {d['host'][:16]:<16} {d['device_id']:>6}  "
                 + " ".join(f"{d['coords'][a]:>3}" for a in axes)
                 + f"  {d['matmul_tflops']:>14.3f} {d['h2d_gbps']:>9.2f} {d['d2h_gbps']:>9.2f}")
  lines += ["", f"{'group':<9} {'op':<10} {'MiB':>8} {'process':>7}  {'host':<16} {'ms':>9} {'busbw GB/s':>10}"]
  for c in findings["collectives"]:
    lines.append(f"{c['group']:<9} {c['op']:<10} {c['bytes'] / 2**20:>8.2f} {c['process']:>7}  "
                 f"{c['host'][:16]:<16} {c['seconds'] * 1e3:>9.3f} {c['busbw_gbps']:>10.2f}")
  lines += ["", f"outliers (below {THRESHOLD} x the job's median): {len(findings['outliers']) or 'none'}"]
  for o in findings["outliers"]:
    where = f"process {o['process']} ({o['host']})" + ("" if o["device_id"] is None else f" device {o['device_id']}")
    lines.append(f"  {o['metric']:<32} {where}: {o['value']:.3f} (median {o['median']:.3f})")
  lines.append(f"slow (below {SLOW_RATIO} x the other processes' median): {len(findings['slow']) or 'none'}")
  for o in findings["slow"]:
    lines.append(f"  {o['metric']:<32} process {o['process']} ({o['host']}) device {o['device_id']}: "
                 f"{o['value']:.3f} (others' median {o['others_median']:.3f})")
  hosts = {d["process"]: d["host"] for d in findings["devices"]}
  bad = ", ".join(f"{p} (host {hosts[p]})" for p in findings["bad_processes"]) or "none"
  lines.append(f"bad processes: {bad}")
  return "\n".join(lines)


def save_findings(path: str, findings: dict) -> None:
  """The JSON findings at `path`, atomically: a reader (the supervisor) never sees half of it."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  write_atomically(path, json.dumps(findings, indent=1) + "\n")
