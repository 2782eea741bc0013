r"""`python -m megajax.launch.bench NAME [flags]`: one benchmark of megajax.launch.bench, by name.

  python -m megajax.launch.bench pipeline [--stages=4] [--repeats=20]
  python -m megajax.launch.bench attention|operators|observe [--repeats=20]
  python -m megajax.launch.bench fbd [--repeats=20] [--fbd_size=cpu|tiny]   (MegaFBD vs the co-located 3D step)
  python -m megajax.launch.bench checkpoint [--checkpoint_hidden=1024] [--checkpoint_repeats=5]
  python -m megajax.launch.bench startup
  python -m megajax.launch.bench faults [--trials=20]
  python -m megajax.launch.bench planner [--measure_memory] [--measure_memory_gpu]
  python -m megajax.launch.bench data [--data_batches=50] [--data_steps=20] [--data_words=200000]
      [--data_tokens=20000000]
  python -m megajax.launch.bench train [--size=1.3b|3b|tiny] [--seq=2048] [--window=0] [--repeats=20]
      [--compile_for=h100-80g]   (no GPU: each row compiled for one, XLA's bytes and the fit)
  python -m megajax.launch.bench step_costs [--repeats=20] [--quick]
  python -m megajax.launch.bench sample [--repeats=20] [--new_tokens=512]
  python -m megajax.launch.bench scope [--repeats=20] [--new_tokens=32]   (the explorer's per-token latency)
  python -m megajax.launch.bench peer [--rounds=12] [--peer_size=cpu|tiny] [--peer_meshes=8x1x1,2x2x2]
      [--compile_for=h100-80g]   (no GPU: every contender compiled for the GPUs, bytes and overlap)
  python -m megajax.launch.bench cp [--repeats=20] [--quick]   (context parallelism's attention: bytes, memory,
      time per token)
  python -m megajax.launch.bench gpu --out=DIR [--parts=tests,attention,train,run]
      [--train_sizes=1.3b:2048] [--run_steps=30]
"""

import gc
import importlib
import os
import sys
import tempfile

from absl import app
from absl import flags

from megajax.config import default_config
from megajax.launch.cli import freeze_imported_objects
from megajax.launch.cluster import request_host_devices
from megajax.launch.runtime import configure_runtime

_STAGES = flags.DEFINE_integer("stages", 4, "Pipeline stages p for the memory and schedule figures.")
_REPEATS = flags.DEFINE_integer("repeats", 20, "Timed runs per measurement (the median is printed).")
_FBD_SIZE = flags.DEFINE_enum("fbd_size", "cpu", ["cpu", "tiny"], "fbd: the model (tiny: the CI smoke test).")
_CHECKPOINT_HIDDEN = flags.DEFINE_integer("checkpoint_hidden", 1024,
                                          "Hidden size of the checkpoint benchmark's model (1024: a 1.9 GiB state).")
_CHECKPOINT_REPEATS = flags.DEFINE_integer("checkpoint_repeats", 5,
                                           "Saves with and without checksums in the checkpoint benchmark (medians).")
_TRIALS = flags.DEFINE_integer("trials", 20, "Fault trials of the faults benchmark.")
_DATA_BATCHES = flags.DEFINE_integer("data_batches", 50, "Batches the data benchmark's loader is timed over.")
_DATA_STEPS = flags.DEFINE_integer("data_steps", 20, "Steps of the default job the data benchmark times.")
_DATA_WORDS = flags.DEFINE_integer("data_words", 200_000, "Words in each of the data benchmark's 4 text files "
                                   "(its prepare rows).", lower_bound=1000)
_DATA_TOKENS = flags.DEFINE_integer("data_tokens", 20_000_000, "Tokens in the token file the data benchmark's "
                                    "loader and step read (rows of 2048: at least 100,000).", lower_bound=100_000)
_SIZE = flags.DEFINE_enum("size", "1.3b", ["tiny", "1.3b", "3b"], "Model of the train (MFU) benchmark.")
_SEQ = flags.DEFINE_integer("seq", 2048, "Sequence length of the train benchmark (2048 or 8192 on a GPU).")
_WINDOW = flags.DEFINE_integer("window", 0, "SWA window of the train benchmark (0: a quarter of --seq).")
_COMPILE_FOR = flags.DEFINE_string("compile_for", "", "train, peer: compile the suite's rows for one GPU of this "
                                   "kind (h100-80g, h200-141g) without a GPU and print XLA's bytes and the fit "
                                   "(peer: every contender for as many GPUs as its mesh has, XLA's bytes, "
                                   "collectives and their overlap) instead of running them.")
_QUICK = flags.DEFINE_boolean("quick", False,
                              "step_costs benchmark: remat none and grad_sync=step only, no step time; cp: one "
                              "memory length, shorter rows (the smoke tests).")
_MEASURE_MEMORY_GPU = flags.DEFINE_boolean(
    "measure_memory_gpu", False, "planner: first compile the GPU memory cases for a described H100 and rewrite "
    "parallel/planner/memory_measured_gpu.py and memory_measured_gpu_pipeline.py (~25 minutes).")
_MEASURE_MEMORY = flags.DEFINE_boolean(
    "measure_memory", False, "planner: first recompile the CPU memory fit sets and held-out cases and rewrite "
    "parallel/planner/memory_measured.py and memory_measured_cpu.py (about 8 minutes).")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 512, "Tokens the sample benchmark generates per row.")
_ROUNDS = flags.DEFINE_integer("rounds", 12, "peer: interleaved rounds, one step of each contender per round.")
_PEER_SIZE = flags.DEFINE_enum("peer_size", "cpu", ["cpu", "tiny"],
                               "peer: the model (cpu: compute-bound steps on CPU; tiny: the smoke test's).")
_PEER_MESHES = flags.DEFINE_string("peer_meshes", "", "peer: megajax's meshes to run (dpxppxtp, comma-separated; "
                                   "default: every one of launch/bench/peer.py's CASES).")
_OUT = flags.DEFINE_string("out", "gpu_check", "gpu: the folder gpu_check.json and gpu_check.md are written to.")
_PARTS = flags.DEFINE_string("parts", "tests,train,attention,run,checkpoint", "gpu: the parts to run, comma-separated.")
_BUDGET_S = flags.DEFINE_float("budget_s", 470, "gpu: seconds for the whole check, each part in its own process under "
                               "its planned share (gpu.PLAN_S); 0: the parts in this process, without limits.")
_TRAIN_SIZES = flags.DEFINE_string("train_sizes", "1.3b:2048",
                                   "gpu: the MFU suites of the train part, SIZE:SEQ comma-separated (e.g. 3b:8192).")
_RUN_STEPS = flags.DEFINE_integer("run_steps", 30, "gpu: steps of each megajax-train run of the run part.")

# name (its module, megajax.launch.bench.<name>, imported only when run) -> what runs it, with
# the flags it reads.
BENCHMARKS = {
    "pipeline": lambda bench: bench.pipeline(_STAGES.value, _REPEATS.value),
    "attention": lambda bench: bench.attention(_REPEATS.value),
    "operators": lambda bench: bench.operators(_REPEATS.value),
    "checkpoint": lambda bench: bench.checkpoint(_CHECKPOINT_HIDDEN.value, _CHECKPOINT_REPEATS.value),
    "startup": lambda bench: bench.startup(),
    "faults": lambda bench: bench.faults(_TRIALS.value),
    "observe": lambda bench: bench.observe(_REPEATS.value),
    "fbd": lambda bench: bench.fbd(_REPEATS.value, _FBD_SIZE.value),
    "planner": lambda bench: bench.planner(_MEASURE_MEMORY.value, _MEASURE_MEMORY_GPU.value),
    "data": lambda bench: bench.data(_DATA_BATCHES.value, _DATA_STEPS.value, _DATA_WORDS.value, _DATA_TOKENS.value),
    "train": lambda bench: (bench.fit_on_gpu(_SIZE.value, _SEQ.value, _WINDOW.value, _COMPILE_FOR.value)
                            if _COMPILE_FOR.value else bench.train(_SIZE.value, _SEQ.value, _WINDOW.value, _REPEATS.value)),
    "step_costs": lambda bench: bench.step_costs(_REPEATS.value, _QUICK.value),
    "sample": lambda bench: bench.sample(_REPEATS.value, _NEW_TOKENS.value),
    # the explorer's tokens: 32 unless --new_tokens is given (the sample benchmark's 512 is long for a 125M on CPU)
    "scope": lambda bench: bench.run(_REPEATS.value, _NEW_TOKENS.value if flags.FLAGS["new_tokens"].present else 32),
    "peer": lambda bench: bench.peer(_ROUNDS.value, _PEER_SIZE.value, _PEER_MESHES.value, _COMPILE_FOR.value),
    "cp": lambda bench: bench.cp(_REPEATS.value, _QUICK.value),
    "gpu": lambda bench: bench.gpu_check(_OUT.value, _PARTS.value, _REPEATS.value, _TRAIN_SIZES.value,
                                         _RUN_STEPS.value, _BUDGET_S.value),
}


def main(argv):
  if len(argv) != 2 or argv[1] not in BENCHMARKS:
    print(f"usage: python -m megajax.launch.bench {{{'|'.join(BENCHMARKS)}}}", file=sys.stderr)
    sys.exit(2)
  # No automatic garbage collection while benchmarks build and time their programs (timeit's
  # practice: a collection inside a timed run is noise; timing.median_seconds collects before
  # it times), and none walking the imports' objects.
  freeze_imported_objects()
  gc.disable()
  request_host_devices(8)   # CPU: enough devices for every mesh of the benchmarks (ignored on GPU)
  # The launcher's start-up settings apply to the benchmarks too: on a GPU the XLA flag preset
  # (before jax starts its backend) and a compilation cache shared by the benchmark runs.
  configure_runtime(default_config(), workdir=os.path.join(tempfile.gettempdir(), "megajax-bench"))
  BENCHMARKS[argv[1]](importlib.import_module(f"megajax.launch.bench.{argv[1]}"))


if __name__ == "__main__":
  app.run(main)
