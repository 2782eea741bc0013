"""Observability: every artefact a run leaves for people to read, its writer and its reader.

  records.py         the workdir's JSON-lines files (metrics, activations, incidents): names,
                     append, read, and the records dropped when a run resumes
  metrics.py         metrics.jsonl / TensorBoard / the terminal (MetricsWriter, read_metrics),
                     throughput and MFU, the compilation cache's hits and misses
  traces.py          sampled step traces: which steps, jax.profiler, each operation's category
  trace_analysis.py  the traces merged on one clock, the per-rank heat map, stragglers and victims
  probes.py          activation capture and perturbation inside the step (Probes, handed to
                     megajax.parallel.ParallelStep), and activations.jsonl (ActivationLog)
  goodput.py         the goodput clock: a run's time by cause (laps), WORKDIR/goodput/'s records
  goodput_ledger.py  the job's ledger across restarts: wall time split into causes that add up,
                     the effective training time ratio (MegaScale 6.3), its table
  report.py          the run's HTML page from all of the above
  hlo.py             the compiled step's HLO text read: its collectives (axis, phase, dtype,
                     bytes) and the matmul FLOPs one run executes (loops times their trips,
                     the pipeline's slots weighed by its tables), which cost_analysis misses
  schedule.py        a scheduled (GPU) module read: what compute runs while each asynchronous
                     collective is in flight, per kind and mesh axis; the copies a loop makes

The named scopes the traces classify by ("forward", "dp reduce-scatter", ...) are written
where the step's code runs (megajax.parallel); the commands are megajax-trace and
megajax-report (megajax.launch).
"""

from megajax.observe.goodput import GoodputClock
from megajax.observe.goodput_ledger import Ledger, format_table, job_ledger
from megajax.observe.metrics import CompilationCacheCounter, MetricsWriter, Throughput, read_metrics
from megajax.observe.probes import ActivationLog, Probes, read_activations
from megajax.observe.report import write_report
from megajax.observe.trace_analysis import analyse
from megajax.observe.traces import StepTracer

__all__ = ["ActivationLog", "CompilationCacheCounter", "GoodputClock", "Ledger", "format_table", "job_ledger", "MetricsWriter", "Probes", "StepTracer", "Throughput", "analyse",
           "read_activations", "read_metrics", "write_report"]
