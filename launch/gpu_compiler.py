r"""megajax-gpu-compiler: XLA's GPU compiler on a machine without a GPU (the deviceless compile).

  megajax-gpu-compiler --install    # the CUDA plugin's two wheels, at jaxlib's version, into their folder
  megajax-gpu-compiler              # where they are, and the GPUs it compiles for

The deviceless compile (megajax.parallel.deviceless: `megajax-plan --compile`, the tests of
tests/integration/test_gpu_compile.py) needs jax-cuda12-plugin and jax-cuda12-pjrt (about 180 MB,
no nvidia-* wheels, no driver). They go to their own folder (deviceless.plugin_dir(): inside the
virtual environment, or $MEGAJAX_GPU_COMPILER), not beside jax: there every process that imports
jax would load them and print the CUDA stub's lines on stderr. A GPU host's own jax[cuda]
install needs none of this. A failed install is one line on stderr and exit code 2.
"""

import importlib.metadata
import subprocess
import sys

from absl import app
from absl import flags

from megajax.launch.cli import fail, flags_parser
from megajax.parallel import deviceless

PROGRAM = "megajax-gpu-compiler"
_INSTALL = flags.DEFINE_bool("install", False, "pip-install the CUDA plugin's wheels (jaxlib's version) into "
                             "their folder.")


def install(folder: str, version: str) -> None:
  """pip --target: the plugin's two wheels at `version`, nothing they depend on (jax is here)."""
  command = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--upgrade", "--target", folder,
             *(f"{wheel}=={version}" for wheel in deviceless.PLUGIN_WHEELS)]
  result = subprocess.run(command, capture_output=True, text=True)
  if result.returncode:
    last = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
    fail(PROGRAM, "install error", f"{' '.join(command[3:])} exited {result.returncode}: {last}")


def main(argv):
  del argv
  folder, version = deviceless.plugin_dir(), importlib.metadata.version("jaxlib")
  if _INSTALL.value:
    install(folder, version)
    print(f"{PROGRAM}: installed {' and '.join(deviceless.PLUGIN_WHEELS)} {version} in {folder}")
  try:
    devices = deviceless.gpu_devices("h100-80g", 1)
  except deviceless.DevicelessUnavailable as error:
    fail(PROGRAM, "missing package", str(error))
  print(f"{PROGRAM}: compiles for {devices[0].device_kind} (and {', '.join(deviceless.GPU_TARGETS)}) from "
        f"{folder}, jaxlib {version}")


parse_flags = flags_parser(PROGRAM)


def run():
  app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
  run()
