"""The supervisor and megajax-local starting real processes: command mode's template and its
failure, a failing local process's exit code."""

import subprocess
import sys

from megajax.config import default_config
from megajax.launch.supervisor import Supervisor
from tests.support import REPO
from tests.support.processes import HANG_S, child_env
from tests.support.records import incidents


def test_command_mode_runs_the_template_and_sees_its_failure(tmp_path):
  """supervisor.command: the job is whatever the template starts; a failing command is an
  "exit" incident, and the restart budget ends it."""
  config = default_config()
  marker = tmp_path / "ran"
  config.supervisor.command = f"echo {{args}} >> {marker}; exit 3"
  config.supervisor.max_restarts, config.supervisor.diagnose = 1, False
  code = Supervisor(config, str(tmp_path / "run"), ["--config=configs/default.py"]).run()
  assert code == 1
  runs = marker.read_text().splitlines()
  assert len(runs) == 2 and all(f"--workdir={tmp_path}/run" in r for r in runs)
  kinds = [(i["kind"], i["action"]) for i in incidents(tmp_path / "run")]
  assert kinds == [("exit", "restart"), ("exit", "give_up")]


def test_megajax_local_passes_a_failing_process_exit_code_on():
  """megajax-local (its 2-process success path runs in test_launcher.py): a process that fails ends
  the job with its exit code."""
  local = [sys.executable, "-m", "megajax.launch.local", "--processes", "2", "--devices-per-process", "4", "--"]
  failed = subprocess.run([*local, "--config=configs/default.py", "--workdir=/tmp/unused", "--config.parallel.tp=3"],
                          cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=HANG_S)
  assert failed.returncode == 2 and "parallel.tp" in failed.stderr
