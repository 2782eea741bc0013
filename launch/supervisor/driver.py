"""The robust-training driver (MegaScale section 4): start the workers, watch their
heartbeats, and on a failure stop everything, diagnose, and restart from the latest
complete checkpoint, on fewer hosts if one is bad.

Detected failures: a worker exiting non-zero ("exit"), a worker whose heartbeat file stops
changing ("heartbeat_lost": killed, stopped, wedged host), no step finished by any worker for
`supervisor.hang_timeout_s` once training is under way ("hang"). A non-finite loss is handled
inside the workers (skip, then roll back; megajax.trainer) and recorded here ("nonfinite").
Every incident is one line in WORKDIR/incidents.jsonl once the job runs again (or is given
up): kind, process, host, time to detect (from the failed worker's last sign of life), time to
resume (from detection to the next finished step), steps lost (last step reached minus the
checkpoint step resumed from).

Workers start either as local processes (jobs.LocalJob) or through `supervisor.command`, a
template run once per (re)start (jobs.CommandJob: srun / kubectl / mpirun).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import signal
import time

from absl import logging
import ml_collections

from megajax.config import apply_overrides
from megajax.launch.supervisor.diagnostics import processes_to_evict
from megajax.launch.supervisor.hang_view import classify_hang, format_hang_view
from megajax.launch.supervisor.jobs import POLL_SECONDS, CommandJob, LocalJob, job_wait
from megajax.observe.goodput import append_supervisor_event, process_start_time
from megajax.observe.records import INCIDENTS, append_jsonl
from megajax.sections import section
from megajax.trainer.heartbeat import HEARTBEAT_DIR, read_heartbeats
from megajax.trainer.workdir import SUPERVISOR_LOCK_FILE, WorkdirLock, check_workdir

STACK_DUMP_SECONDS = 2.0
CRASH_SIGNALS = (signal.SIGKILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE)
# megajax-train's exit code for a fault a restart repeats: config, topology, workdir (held by
# another job, unwritable), checkpoint (none readable, a save that failed: a full disk) and
# non-finite (every update skipped, or after rolling back as far as there is to go).
NOT_RETRIED = (2,)


@dataclasses.dataclass
class Failure:
  kind: str                 # "exit", "heartbeat_lost", "hang"
  processes: list[int]      # the processes blamed (suspects)
  detected_at: float
  last_sign_of_life: float  # the blamed processes' last new beat (or their exit)
  last_step: int            # the furthest step any worker reported
  detail: str
  exit_code: int | None = None


def fill_template(template: str, command: list[str], processes: int, exclude: list[str]) -> str:
  """supervisor.command with its placeholders filled: {train} (the worker's whole command
  line: megajax-train or megajax-diagnose with its flags), {args} (the flags alone),
  {processes}, {exclude} (bad hosts, comma-separated). Plain replacement, so the shell's own
  ${...} stays as written."""
  return (template.replace("{train}", shlex.join(command)).replace("{args}", shlex.join(command[1:]))
          .replace("{processes}", str(processes)).replace("{exclude}", ",".join(exclude)))


def elastic_layout(config: ml_collections.ConfigDict, processes: int, devices_per_process: int,
                   usable: int) -> dict | None:
  """The largest job on at most `usable` processes that keeps pp, cp, tp and the global batch:
  {"processes", "parallel.dp", "train.microbatches"}, or None if there is none."""
  p, t = config.parallel, config.train
  replica = p.pp * p.cp * p.tp                # one dp replica's devices
  for count in range(usable, 0, -1):
    devices = count * devices_per_process
    if devices % replica:
      continue
    dp = devices // replica
    if dp < 1 or p.dp % dp:
      continue
    return {"processes": count, "parallel.dp": dp, "train.microbatches": t.microbatches * (p.dp // dp)}
  return None


class Supervisor:
  """Runs the training job to the end, restarting it up to `supervisor.max_restarts` times."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str, worker_args: list[str]):
    self.config, self.workdir = config, workdir
    self.worker_args = list(worker_args)      # --config=..., --config.a.b=v: passed on verbatim
    s = config.supervisor
    self.processes = s.processes
    self.devices_per_process = s.devices_per_process or max(1, section(config, "parallel").device_count // s.processes)
    self.overrides: dict = {}                 # elastic changes to the mesh and accumulation
    self.spares = s.spares
    self.excluded_hosts: list[str] = []
    self.stop_requested = False
    self._last_findings: dict | None = None     # the latest diagnostics findings (hosts of processes)

  # --- Starting jobs.

  def _config_args(self) -> list[str]:
    """The user's --config flags, then the elastic overrides (the later flag wins)."""
    return [*self.worker_args, *(f"--config.{k}={v}" for k, v in self.overrides.items())]

  def _start(self, module: str, args: list[str], attempt: int, log_name: str):
    s = self.config.supervisor
    if s.command:
      script = {"megajax.launch.train": "megajax-train", "megajax.launch.diagnose": "megajax-diagnose"}[module]
      env = {"MEGAJAX_PROCESSES": str(self.processes), "MEGAJAX_EXCLUDE_HOSTS": ",".join(self.excluded_hosts),
             "MEGAJAX_ARGS": shlex.join(args)}
      return CommandJob(fill_template(s.command, [script, *args], self.processes, self.excluded_hosts), attempt,
                        env, s.stop_command)
    logs = os.path.join(self.workdir, "logs")
    os.makedirs(logs, exist_ok=True)
    return LocalJob(module, args, self.processes, self.devices_per_process, attempt=attempt,
                    log_path=os.path.join(logs, f"{log_name}.process_{{process}}.log"))

  # --- The driver.

  def run(self) -> int:
    """The job to the end; WorkdirError (before anything is started or written) when the
    workdir cannot be used or another supervisor or training job holds it."""
    supervisor_lock = self._claim_workdir()
    previous = signal.signal(signal.SIGTERM, self._on_sigterm)
    # The goodput ledger's job starts with this process (its start-up is the job's too).
    append_supervisor_event(self.workdir, "start", time=process_start_time(), processes=self.processes)
    code = 1
    try:
      code = self._run()
      return code
    finally:
      append_supervisor_event(self.workdir, "end", code=code)
      signal.signal(signal.SIGTERM, previous)
      supervisor_lock.release()

  def _claim_workdir(self) -> WorkdirLock:
    """WORKDIR/supervisor.lock for the supervisor's whole life (its workers take WORKDIR/lock at
    each attempt), after checking that no training job holds WORKDIR/lock: a second supervisor
    or one started on a running job's workdir refuses before it clears the heartbeats."""
    check_workdir(self.workdir)
    supervisor_lock = WorkdirLock(self.workdir, SUPERVISOR_LOCK_FILE)
    supervisor_lock.acquire()
    try:
      job_lock = WorkdirLock(self.workdir)
      job_lock.acquire()
      job_lock.release()
    except BaseException:
      supervisor_lock.release()
      raise
    return supervisor_lock

  def _on_sigterm(self, signum, frame):
    self.stop_requested = True

  def _run(self) -> int:
    pending = None                  # the incident whose resume the next attempt will time
    for attempt in range(self.config.supervisor.max_restarts + 1):
      if self.stop_requested:
        return 143
      shutil.rmtree(os.path.join(self.workdir, HEARTBEAT_DIR), ignore_errors=True)
      logging.info("attempt %d: starting %d worker process(es)%s", attempt, self.processes,
                   f" with {self.overrides}" if self.overrides else "")
      job = self._start("megajax.launch.train", [*self._config_args(), f"--workdir={self.workdir}"], attempt,
                        f"attempt_{attempt}")
      try:
        failure = self._watch(job, pending, attempt)
      except BaseException:     # the supervisor itself failing (Ctrl-C, a bug) leaves no worker behind
        job.stop(grace=1.0)
        raise
      if pending is not None and not pending.get("resumed"):     # this attempt failed before a step
        self._append_incident({**pending, "time_to_resume_s": None, "steps_lost": None})
      pending = None
      if failure is None:
        return 0
      if failure.kind == "preempted":
        return 143
      logging.error("attempt %d failed: %s", attempt, failure.detail)
      append_supervisor_event(self.workdir, "failure", attempt=attempt, kind=failure.kind,
                              last_sign_of_life=failure.last_sign_of_life, detected_at=failure.detected_at,
                              last_step=failure.last_step)
      if failure.kind in ("hang", "heartbeat_lost"):
        # Each live worker prints its threads' Python stacks to its log (SIGUSR1, launch/train.py):
        # where the victims wait and what the suspects were doing.
        job.signal(signal.SIGUSR1)
        time.sleep(STACK_DUMP_SECONDS)
      job.stop(grace=1.0)       # a broken job cannot save anything: a moment for logs, then SIGKILL
      incident = self._incident(failure, attempt)
      if failure.exit_code in NOT_RETRIED:
        self._append_incident({**incident, "action": "give_up", "reason": "not retried: a config, "
                               "workdir, checkpoint or non-finite error repeats on every restart"})
        return failure.exit_code
      if attempt == self.config.supervisor.max_restarts:
        self._append_incident({**incident, "action": "give_up", "reason": "restart budget spent"})
        return 1
      incident.update(self._recover(attempt, failure.processes))
      pending = incident
    return 1

  def _watch(self, job, pending: dict | None, attempt: int) -> Failure | None:
    """Polls the job until it finishes (None) or fails; times the resume of `pending`."""
    s = self.config.supervisor
    started = time.time()
    last_seen, last_progress, last_state, times = {}, {}, {}, {}
    rollbacks = 0
    first_step = None
    furthest = 0
    while True:
      time.sleep(POLL_SECONDS)
      now = time.time()
      if self.stop_requested:
        job.signal(signal.SIGTERM)      # the workers save a checkpoint and stop
        job_wait(job)
        return Failure("preempted", [], now, now, furthest, "stopped by SIGTERM")
      # Beats of this attempt only: a straggler of the previous one may still write.
      beats = {p: b for p, b in read_heartbeats(self.workdir).items() if b["attempt"] == attempt}
      for process, beat in beats.items():
        if times.get(process) != beat["time"]:
          times[process], last_seen[process] = beat["time"], now
        state = (beat["step"], beat["phase"])
        if last_state.get(process) != state:
          last_state[process], last_progress[process] = state, now
        furthest = max(furthest, beat["step"])
        if beat["step"] > beat["start_step"] and first_step is None:
          first_step = now
          if pending is not None:
            pending["resumed"] = True
            self._append_incident({**pending, "time_to_resume_s": round(now - pending["detected_at"], 3),
                                   "resumed_from_step": beat["start_step"],
                                   "steps_lost": max(0, pending["last_step"] - beat["start_step"])})
      # Every process rolls back alike: one record per rollback, whichever beat shows it first.
      leader = max(beats.values(), key=lambda b: b["rollbacks"], default=None)
      if leader is not None and leader["rollbacks"] > rollbacks:
        rollbacks = leader["rollbacks"]
        self._record_rollback(leader["process"], leader)

      codes = job.poll()
      if all(code == 0 for code in codes):
        return None
      failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
      if failed:
        # A worker that crashed or was killed takes its peers down with it (they lose the
        # coordinator or a collective), and one poll can find them all gone: blame the ones a
        # crash signal ended when there are any.
        crashed = [i for i in failed if _crash_signal(codes[i])]
        code = codes[(crashed or failed)[0]]
        blamed = (crashed or failed) if len(codes) > 1 else classify_hang(last_seen, last_progress, now,
                                                                      s.heartbeat_timeout_s)[0]
        if code == 143 and not self.stop_requested:
          detail = f"process(es) {failed} stopped by SIGTERM (preempted by the cluster?)"
        else:
          detail = f"process(es) {failed} exited with code {code}"
        return Failure("exit", blamed, now, min((last_seen.get(p, now) for p in blamed), default=now), furthest,
                       detail, exit_code=code)

      done = {p for p, b in beats.items() if b["done"]}
      missing = [p for p in range(self.processes) if p not in last_seen and now - started > s.hang_timeout_s]
      # Before its first step a worker may hold the GIL in one long call (tracing, compiling,
      # restoring) and miss beats: only the start-up deadline applies to it then.
      lost = [p for p in last_seen if p not in done and beats.get(p, {}).get("step", 0) > beats.get(p, {}).get(
          "start_step", 0) and now - last_seen[p] > s.heartbeat_timeout_s]
      if missing or lost:
        suspects, victims = classify_hang(last_seen, last_progress, now, s.heartbeat_timeout_s)
        suspects = [*missing, *(p for p in suspects if p not in missing)]
        self._print_hang_view(beats, suspects, victims)
        return Failure("heartbeat_lost", suspects, now, min((last_seen.get(p, started) for p in suspects)),
                       furthest, f"no heartbeat from process(es) {suspects} for over {s.heartbeat_timeout_s} s")
      working = {p: t for p, t in last_progress.items() if p not in done}
      if len(done) == self.processes and now - max(last_progress[p] for p in done) > s.hang_timeout_s:
        return Failure("hang", [p for p, code in enumerate(codes) if code is None], now, now, furthest,
                       f"every worker finished training but the job did not exit within {s.hang_timeout_s} s")
      if first_step is None and now - started > s.startup_timeout_s:
        suspects, victims = classify_hang(last_seen, working, now, s.heartbeat_timeout_s)
        self._print_hang_view(beats, suspects, victims)
        return Failure("hang", suspects, now, max(working.values(), default=started), furthest,
                       f"no step finished within supervisor.startup_timeout_s={s.startup_timeout_s} s of the start")
      if first_step is not None and working and now - max(working.values()) > s.hang_timeout_s:
        suspects, victims = classify_hang(last_seen, working, now, s.heartbeat_timeout_s)
        self._print_hang_view(beats, suspects, victims)
        return Failure("hang", suspects, now, max(working.values()), furthest,
                       f"no worker made progress for {s.hang_timeout_s} s")

  def _print_hang_view(self, beats, suspects, victims) -> None:
    c = self.config.parallel
    mesh = (int(self.overrides.get("parallel.dp", c.dp)), c.pp, c.cp, c.tp)
    view = format_hang_view(beats, mesh, suspects, victims)
    logging.error("%s", view)
    with open(os.path.join(self.workdir, "hang_views.txt"), "a") as f:
      f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}\n{view}\n")

  # --- After a failure.

  def _incident(self, failure: Failure, attempt: int) -> dict:
    beats = read_heartbeats(self.workdir)
    return {"kind": failure.kind, "attempt": attempt, "processes": failure.processes,
            "hosts": [beats.get(p, {}).get("host") for p in failure.processes],
            "errors": sorted({e for p in failure.processes for e in beats.get(p, {}).get("errors", [])}),
            "detail": failure.detail, "detected_at": failure.detected_at,
            "time_to_detect_s": round(failure.detected_at - failure.last_sign_of_life, 3),
            "last_step": failure.last_step}

  def _recover(self, attempt: int, blamed: list[int]) -> dict:
    """Diagnostics, then the next attempt's layout: the same hosts, a spare for a bad one, or
    (elastic) fewer processes with a smaller dp and more accumulation. Bad: a process the
    failure blamed that the diagnostics find slow, run after run (`_diagnose`)."""
    bad = self._diagnose(attempt, blamed) if self.config.supervisor.diagnose else []
    action = {"action": "restart", "bad_processes": bad}
    if not bad:
      return action
    hosts = self._hosts_of(bad)
    if self.spares >= len(bad) and self.config.supervisor.command:
      self.spares -= len(bad)
      self.excluded_hosts += hosts
      return {**action, "action": "replace", "excluded_hosts": hosts}
    if not self.config.supervisor.elastic:
      return action
    layout = elastic_layout(self._current_config(), self.processes, self.devices_per_process,
                            self.processes - len(bad))
    if layout is None:
      logging.error("no smaller mesh keeps pp=%d, cp=%d and tp=%d on the %d good process(es): restarting as before",
                    self.config.parallel.pp, self.config.parallel.cp, self.config.parallel.tp,
                    self.processes - len(bad))
      return action
    self.processes = layout.pop("processes")
    self.overrides.update(layout)
    self.excluded_hosts += hosts
    c = self.config.parallel
    logging.warning("elastic continue without process(es) %s: %d process(es), mesh dp=%d pp=%d cp=%d tp=%d, "
                    "train.microbatches=%d (the global batch stays %d)", bad, self.processes, layout["parallel.dp"],
                    c.pp, c.cp, c.tp, layout["train.microbatches"], self.config.train.batch_size)
    return {**action, "action": "elastic", "excluded_hosts": hosts, "processes_after": self.processes,
            "mesh_after": [layout["parallel.dp"], c.pp, c.cp, c.tp]}

  def _current_config(self) -> ml_collections.ConfigDict:
    return apply_overrides(ml_collections.ConfigDict(self.config.to_dict()), self.overrides)

  def _hosts_of(self, processes: list[int]) -> list[str]:
    if not self.config.supervisor.command:
      return [f"local-process-{p}" for p in processes]
    findings = self._last_findings or {}
    hosts = {d["process"]: d["host"] for d in findings.get("devices", [])}
    return sorted({hosts.get(p, f"process-{p}") for p in processes})

  def _diagnose(self, attempt: int, blamed: list[int]) -> list[int]:
    """The bad processes: megajax-diagnose on the same processes, run again while a process the
    failure blamed is slow in every run so far, until diagnostics.processes_to_evict decides
    (SLOW_RUNS slow runs in a row). A healthy bystander that measures slow (a shared host) is
    no reason to shrink the job, nor is one noisy run. A failed run: the same hosts."""
    findings_of_runs = []
    while (bad := processes_to_evict(findings_of_runs, blamed)) is None:
      findings = self._diagnose_once(attempt, len(findings_of_runs))
      if findings is None:
        return []
      findings_of_runs.append(findings)
      logging.warning("diagnostics run %d: %s", len(findings_of_runs),
                      f"slow process(es) {findings['bad_processes']}" if findings["bad_processes"] else "none slow")
    if bad:
      logging.warning("diagnostics: process(es) %s slow in %d runs in a row", bad, len(findings_of_runs))
    return bad

  def _diagnose_once(self, attempt: int, run: int) -> dict | None:
    """One megajax-diagnose job's findings (None when it failed)."""
    output = os.path.join(self.workdir, "diagnostics", f"after_attempt_{attempt}_run_{run}.json")
    os.makedirs(os.path.dirname(output), exist_ok=True)
    job = self._start("megajax.launch.diagnose", [*self._config_args(), f"--output={output}"], attempt,
                      f"diagnose_{attempt}_run_{run}")
    code = job_wait(job, timeout=max(120.0, self.config.supervisor.hang_timeout_s))
    if code != 0 or not os.path.exists(output):
      logging.error("diagnostics did not complete (exit code %s): restarting on the same hosts", code)
      return None
    with open(output) as f:
      self._last_findings = json.load(f)
    return self._last_findings

  def _record_rollback(self, process: int, beat: dict) -> None:
    rollback = beat.get("last_rollback") or {}
    self._append_incident({"kind": "nonfinite", "attempt": beat.get("attempt"), "processes": [process],
                           "hosts": [beat.get("host")], "action": "rollback",
                           "detail": f"{self.config.train.nonfinite_rollback_after} non-finite steps in a row",
                           "time_to_detect_s": 0.0, "time_to_resume_s": 0.0,
                           "last_step": rollback.get("step"), "resumed_from_step": rollback.get("to_step"),
                           "steps_lost": (rollback.get("step") or 0) - (rollback.get("to_step") or 0)})

  def _append_incident(self, incident: dict) -> None:
    incident = {k: v for k, v in incident.items() if k not in ("detected_at", "resumed")}
    logging.warning("incident: %s", json.dumps(incident))
    append_jsonl(os.path.join(self.workdir, INCIDENTS), [incident])


def _crash_signal(code: int) -> bool:
  """An exit code that says a crash signal ended the process: -N from Popen, 128 + N from a
  shell or srun."""
  number = -code if code < 0 else code - 128 if code > 128 else 0
  return number in CRASH_SIGNALS

