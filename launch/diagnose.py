r"""megajax-diagnose: find the slow host or device of a job (MegaScale section 4, diagnostic tests).

  megajax-diagnose --config=configs/default.py --output=/tmp/diagnose.json
  megajax-diagnose --config=... --coordinator_address=H:P --num_processes=N --process_id=I

Every process of the job runs it on the training config's mesh: matmul TFLOP/s and host <->
device GB/s per device, all-reduce / all-gather / ppermute bus bandwidth over each mesh axis
and across processes, outliers below 0.9 x the job's median, and the slow devices (below
0.5 x the other processes' median) and the processes they name: the supervisor's eviction
evidence (megajax.launch.supervisor.diagnostics). Process 0 prints the tables and writes the
JSON findings. Fault drill: `--config.debug.diagnose_slow_process=I` (megajax.trainer.drills).
"""

from absl import app
from absl import flags
from absl import logging
import jax

from megajax.config import ConfigError
from megajax.launch import cli
from megajax.launch.cli import (QuietLibraries, define_config_flag, define_topology_flags, fail, flags_parser,
                                join_job, validated_config)
from megajax.launch.cluster import TopologyError
from megajax.launch.supervisor.diagnostics import diagnose, format_findings, save_findings

PROGRAM = "megajax-diagnose"
_CONFIG = define_config_flag()
_OUTPUT = flags.DEFINE_string("output", None, "Where process 0 writes the JSON findings (optional).")
_MATMUL_SIZE = flags.DEFINE_integer("matmul_size", None, "Square matmul side (default by platform).")
_TRANSFER_MIB = flags.DEFINE_float("transfer_mib", None, "Host<->device transfer size in MiB (default by platform).")
_COLLECTIVE_MIB = flags.DEFINE_float("collective_mib", None, "Collective buffer size in MiB (default by platform).")
_REPEATS = flags.DEFINE_integer("repeats", None, "Timed runs per measurement (default by platform).")
_COORDINATOR, _NUM_PROCESSES, _PROCESS_ID = define_topology_flags()
flags.mark_flags_as_required(["config"])
flags.adopt_module_key_flags(cli)     # --config (and the topology flags) in this command's --help


def main(argv):
  logging.get_absl_handler().addFilter(QuietLibraries())
  config = validated_config(PROGRAM, argv, _CONFIG)
  try:
    join_job(config, _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    findings = diagnose(config, matmul_size=_MATMUL_SIZE.value, transfer_mib=_TRANSFER_MIB.value,
                      collective_mib=_COLLECTIVE_MIB.value, repeats=_REPEATS.value)
  except TopologyError as error:
    fail(PROGRAM, "topology error", error)
  except ConfigError as error:
    fail(PROGRAM, "config error", error)
  if jax.process_index() == 0:
    print(format_findings(findings), flush=True)
    if _OUTPUT.value:
      save_findings(_OUTPUT.value, findings)


def run():
  app.run(main, flags_parser=flags_parser(PROGRAM))


if __name__ == "__main__":
  run()
