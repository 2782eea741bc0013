r"""megajax-train: train a model from a config file.

  megajax-train --config=configs/default.py --workdir=/tmp/run \
      --config.model.num_layers=4 --config.train.steps=500

Every knob is a config field (`--config.a.b=v`); the only other flags are the workdir and
the process topology for jax.distributed (auto-detected on SLURM / Open MPI / Kubernetes).
Mistakes in the config or flags end the run with one line on stderr and exit code 2,
before anything is compiled. So does a run whose updates are skipped to the end (non-finite
loss or gradients: `non-finite error`), or that stays non-finite after rolling back as far
as it can: the same data and config would fail the same way, so the supervisor does not retry.
"""

from absl import app
from absl import flags

from megajax.launch import cli
from megajax.launch.cli import define_config_flag, define_topology_flags, flags_parser, validated_config
from megajax.launch.training import prepare_process, run_training

_CONFIG = define_config_flag()
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory: metrics.jsonl, TensorBoard, params.")
_COORDINATOR, _NUM_PROCESSES, _PROCESS_ID = define_topology_flags()
flags.mark_flags_as_required(["config", "workdir"])
flags.adopt_module_key_flags(cli)     # --config (and the topology flags) in this command's --help


def main(argv):
  prepare_process()
  # Validated before jax.distributed (which can wait minutes for peers) or any compile.
  config = validated_config("megajax-train", argv, _CONFIG)
  run_training("megajax-train", config, _WORKDIR.value, (_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value))


parse_flags = flags_parser("megajax-train")


def run():
  app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
  run()
