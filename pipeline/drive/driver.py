"""Launch, cancel and reset stage attempts: the acting side of a run.

Process layout (all detached from whoever asked for the run):

    driver      python -m pipeline.control drive      own session, holds runs/<id>/lock,
                                                  starts the stages one after another
    supervisor  python -m pipeline.run.supervise      own session per stage attempt,
                                                  records the exit in state.json
    stage       python -m pipeline.stages.NAME    own process group under the supervisor

Nothing here holds a pipe to a stage: the panel and the CLI learn everything
from state.json, events.jsonl and stage.log. Whether a stage still runs is
asked of the run's executor (pipeline.run.executor: local processes, or a
scheduler's jobs), which the callers pass in; reading a run without acting on
it is pipeline.run.reconcile's `observe`, and needs nothing from here. The
driver's entry point is in pipeline.control, above run/ and cluster/, where
the Slurm executor is registered.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline import config as config_mod
from pipeline.config import GPU_STAGES, Config
from pipeline.paths import pythonpath_with_project
from pipeline.run.diskspace import EXIT_DISK_FULL, DiskFull, is_full_errno
from pipeline.run.events import EventWriter
from pipeline.run.executor import (
    Executor,
    Scheduler,
    SchedulerError,
    driver_alive,
    for_run,
    for_scheduler,
    proc_alive,
)
from pipeline.run.proctree import (
    SUPERVISOR_VAR,
    TOKEN_VAR,
    carries,
    proc_name,
    signal_all,
    stage_processes,
    wait_gone,
)
from pipeline.run.reconcile import observe, reconcile
from pipeline.run.rundir import (
    DONE,
    SHARED_UMASK,
    RunDir,
    RunDirError,
    Status,
    check_run_id,
    check_runs_dir,
    proc_start_ticks,
)
from pipeline.run.snapshot import read_run
from pipeline.stage_graph import STAGE_INPUTS, STAGE_NAMES
from pipeline.vllm.log_shape import VLLM  # the stage log's lines, handed to its supervisor

POLL_S = 0.2


# -- planning ---------------------------------------------------------------

def fingerprints(cfg: Config) -> dict[str, str]:
    fps: dict[str, str] = {}
    for s in STAGE_NAMES:
        fps[s] = cfg.fingerprint(s, fps)
    return fps


@dataclass
class Step:
    stage: str
    action: str  # "run" | "skip" | "off" (an optional stage turned off) | "blocked"
    why: str


def plan(cfg: Config, state: dict, only: str | None = None, force: bool = False) -> list[Step]:
    """What `run` will do for each stage, and why."""
    fps = fingerprints(cfg)
    steps, stale = [], set()
    for s in STAGE_NAMES:
        st = state["stages"][s]
        upstream_stale = [u for u in STAGE_INPUTS[s] if u in stale]
        selected = only is None or only == s
        if not selected:
            # a stage turned off is no prerequisite: what reads it reads what it replaces
            if only is not None and s in STAGE_INPUTS[only] and st["status"] not in DONE \
                    and not cfg.off_reason(s):
                steps.append(Step(s, "blocked", f"{only} needs {s}, which has not succeeded"))
            continue
        off = cfg.off_reason(s)
        if off:
            if st["status"] == Status.SKIPPED and st.get("fingerprint") == fps[s]:
                steps.append(Step(s, "skip", off))
            else:
                steps.append(Step(s, "off", off))
            continue
        if force:
            steps.append(Step(s, "run", "forced re-run"))
        elif st["status"] in DONE and st.get("fingerprint") == fps[s] and not upstream_stale:
            steps.append(Step(s, "skip", f"up to date (fingerprint {fps[s]})" if
                              st["status"] == Status.SUCCEEDED else
                              f"skipped before: {st.get('reason') or 'see its log'} "
                              "(--force, or run --stage, tries again)"))
            continue
        elif st["status"] in DONE and st.get("fingerprint") == fps[s]:
            steps.append(Step(s, "run", f"it reads {', '.join(upstream_stale)}, which runs again"))
        elif st["status"] in DONE:
            steps.append(Step(s, "run", "config changed (fingerprint "
                                        f"{st.get('fingerprint')} -> {fps[s]})"))
        elif st["status"] in (Status.FAILED, Status.CANCELLED):
            steps.append(Step(s, "run", f"resume after {st['status']} attempt {st['attempt']}"))
        elif st["status"] == Status.MISSING:
            steps.append(Step(s, "run", st.get("reason") or "its outputs are gone"))
        elif st["status"] == Status.RUNNING:
            steps.append(Step(s, "run", "already running: wait for it"))
        else:
            steps.append(Step(s, "run", "not run yet"))
        stale.add(s)
    return steps


# -- launching --------------------------------------------------------------

def _stage_env(cfg: Config, stage: str, attempt: int,
               extra: dict[str, str] | None = None) -> dict[str, str]:
    env = os.environ.copy()
    env.update(cfg.runtime.env)
    env.update(cfg.stage(stage).env)
    env.update(extra or {})
    env["PYTHONPATH"] = pythonpath_with_project(env.get("PYTHONPATH"))
    env["PYTHONUNBUFFERED"] = "1"
    # The supervisor hands the token to the stage only: a scan for the token
    # must find the stage's processes, never the supervisor recording them.
    env.pop(TOKEN_VAR, None)
    env["EAGLE_PANEL_STAGE"] = stage
    env["EAGLE_PANEL_ATTEMPT"] = str(attempt)
    # The devices a stage was given are the only reliable map of GPUs to
    # stages inside containers; an empty list means CPU. In a Slurm job the
    # scheduler sets CUDA_VISIBLE_DEVICES to the job's own GPUs.
    if cfg.cluster.scheduler == "slurm":
        env.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, cfg.stage_devices(stage)))
    return env


def _reset_outputs(rd: RunDir, stage: str) -> None:
    """Move the stage's outputs aside, then delete them: a crash in between
    leaves a hidden trash folder, never a half-deleted out/."""
    out = rd.out_dir(stage)
    if out.exists() and any(out.iterdir()):
        trash = rd.stage_dir(stage) / f".trash-{secrets.token_hex(4)}"
        os.replace(out, trash)
        shutil.rmtree(trash, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)


def launch(rd: RunDir, cfg: Config, stage: str, fingerprint: str, force: bool = False,
           ex: Executor | None = None, extra_env: dict[str, str] | None = None) -> dict:
    """Start one stage attempt under its supervisor (as a job when the
    config's executor is a scheduler); returns the stage state. The caller
    must hold the run's launcher lock. `extra_env`: what the run's services
    give the stage (the shared server's endpoint)."""
    ex = ex or for_scheduler(cfg.cluster.scheduler, rd.path)
    st = rd.read_state()["stages"][stage]
    if st["status"] == Status.RUNNING and ex.alive(st):
        raise RuntimeError(f"{stage} is already running (pid {st['pid']})")
    if force or st.get("out_fingerprint") != fingerprint:
        _reset_outputs(rd, stage)
    # (a stage folder deleted behind the run's back: its log and outputs go here again)
    rd.out_dir(stage).mkdir(parents=True, exist_ok=True)
    attempt = st["attempt"] + 1
    token = f"{rd.id}/{stage}/{attempt}/{secrets.token_hex(4)}"
    argv = [cfg.python(), "-m", cfg.stage_entry(stage), "--run-dir", str(rd.path),
            "--config", str(rd.config_path)]
    rd.update_stage(stage, status=Status.RUNNING, attempt=attempt, pid=None, pgid=None,
                    create_time=None, started_at=time.time(), ended_at=None, exit_code=None,
                    signal=None, fingerprint=fingerprint, out_fingerprint=fingerprint,
                    devices=cfg.held_devices(stage), token=token, cancel_requested=False,
                    reason=None, slurm_job=None, supervisor_pid=None,
                    supervisor_create_time=None)
    log = append_log(rd.log_path(stage))
    log.write(f"\n===== eagle-panel: {stage} attempt {attempt} at "
              f"{time.strftime('%Y-%m-%d %H:%M:%S')} =====\n".encode())
    log.flush()
    supervise = [sys.executable, "-m", "pipeline.run.supervise", "--run-dir", str(rd.path),
                 "--stage", stage, "--log-prefix", VLLM.prefix, "--log-pointer", VLLM.pointer,
                 "--", *argv]
    if isinstance(ex, Scheduler):
        log.close()
        return _submit(rd, cfg, stage, attempt, supervise, ex)
    with log:
        sup = subprocess.Popen(
            supervise,
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            env={**_stage_env(cfg, stage, attempt, extra_env), SUPERVISOR_VAR: token},
            cwd=str(rd.path), start_new_session=True,
        )
    return rd.update_stage(stage, supervisor_pid=sup.pid,
                           supervisor_create_time=proc_start_ticks(sup.pid))


def _submit(rd: RunDir, cfg: Config, stage: str, attempt: int, supervise: list[str],
            sched: Scheduler) -> dict:
    """The attempt's supervisor as the scheduler's job; a refusal fails the
    attempt with the scheduler's words (nothing ran, resume retries it)."""
    try:
        job = sched.submit(cfg, rd, stage, attempt, stage in GPU_STAGES, supervise,
                           _stage_env(cfg, stage, attempt))
    except SchedulerError as e:
        with EventWriter(rd.events_path(stage)) as events:
            events.error(str(e), hint="fix [cluster] in config.toml, then resume")
        return rd.update_stage(stage, status=Status.FAILED, ended_at=time.time(),
                               reason=str(e))
    _say(f"[{stage}] {sched.title} job {job}")
    return rd.update_stage(stage, slurm_job=job)


def wait_stage(rd: RunDir, stage: str, poll: float = POLL_S, ex: Executor | None = None) -> dict:
    """Block until the stage is no longer running (works for a stage this
    process did not start: the launcher may have been restarted)."""
    ex = ex or for_run(rd)
    while True:
        state = reconcile(rd, ex)
        st = state["stages"][stage]
        if st["status"] != Status.RUNNING:
            return st
        time.sleep(poll)


# Run-level services: factories of objects with begin(run, cfg, steps), env(stage) ->
# the stage's extra environment, after(stage, term_grace) and close(term_grace).
# pipeline.control registers them (run/ imports nothing above it): the shared
# vLLM server of regenerate and extract (pipeline.extract.shared_server).
SERVICES: list = []


def _begin_services(rd: RunDir, cfg: Config, steps: list[Step]) -> list:
    """The run's services, started; one that cannot start is said and left
    out (each stage then does without it: starts its own server)."""
    out = []
    for make in SERVICES:
        svc = make()
        try:
            svc.begin(rd, cfg, steps)
        except Exception as e:  # noqa: BLE001 - a service is an optimization: the run goes on
            _say(f"{type(svc).__module__}: not started ({type(e).__name__}: {e})")
            svc.close(cfg.runtime.term_grace_s)
            continue
        out.append(svc)
    return out


def _each_service(services: list, what: str, *args) -> None:
    """`what` of every service; one that fails is said, never the driver's end
    (its `finally` must still release the run)."""
    for svc in services:
        try:
            getattr(svc, what)(*args)
        except Exception as e:  # noqa: BLE001 - said in driver.log; the run goes on
            _say(f"{type(svc).__module__}: {what} failed ({type(e).__name__}: {e})")


def drive(rd: RunDir, only: str | None = None, force: bool = False,
          lock_fd: int | None = None) -> int:
    """Run the pipeline to its end (the body of the detached driver). With
    `lock_fd`, the launcher lock its launcher took and handed over: the
    launcher cleared the run's cancel request as it took it, and a cancel
    that came since is this launch's (seen before the first stage)."""
    fd = rd.adopt_lock(lock_fd) if lock_fd is not None else rd.try_lock()
    if fd is None:
        print(f"another launcher (pid {rd.lock_holder()}) is driving {rd.path}", file=sys.stderr)
        return 3
    state = rd.read_state()
    cfg = load_run_config(rd, state)
    ex = for_run(rd)
    if cfg.run.shared:
        # what the stages write: group-readable, never group-writable
        os.umask(SHARED_UMASK)
    with rd.mutate_state() as state:
        state["driver"] = {"pid": os.getpid(), "create_time": proc_start_ticks(os.getpid()),
                           "started_at": time.time(), "only": only, "force": force}
        if lock_fd is None:   # no launcher before us: no cancel can be this launch's yet
            state["cancel_requested"] = False
    result, services = 0, []
    try:
        fps = fingerprints(cfg)   # (before any service starts: nothing to stop if it fails)
        steps = plan(cfg, reconcile(rd, ex), only, force)
        services = _begin_services(rd, cfg, steps)
        result = _run_steps(rd, cfg, ex, steps, services, force, fps)
    except DiskFull as e:
        _say(f"eagle-panel: {e}. {e.hint}")
        result = EXIT_DISK_FULL
    finally:
        _each_service(services, "close", cfg.runtime.term_grace_s)
        try:
            with rd.mutate_state() as state:
                state["driver"] = None
        except DiskFull:
            pass   # a driver entry with a dead pid reads as no driver
        os.close(fd)
    if result == 1:
        reconcile(rd, ex)
        if read_run(rd, ex).failed_for_disk():
            result = EXIT_DISK_FULL
    return result


def _run_steps(rd: RunDir, cfg, ex, steps, services, force: bool,
               fps: dict[str, str]) -> int:
    """The planned steps in order, each to its end: the driver's exit code
    (0, 1 for a blocked or failed stage, 130 for a cancel)."""
    for step in steps:
        if step.action == "blocked":
            _say(f"[{step.stage}] {step.why}")
            return 1
        if step.action == "skip":
            _say(f"[{step.stage}] skipped: {step.why}")
            continue
        if step.action == "off":
            _say(f"[{step.stage}] {step.why}")
            rd.update_stage(step.stage, status=Status.SKIPPED, fingerprint=fps[step.stage],
                            reason=step.why, started_at=None, ended_at=None,
                            exit_code=None, signal=None)
            continue
        if rd.read_state().get("cancel_requested"):
            return 130
        st = rd.read_state()["stages"][step.stage]
        if not (st["status"] == Status.RUNNING and ex.alive(st)):
            _say(f"[{step.stage}] starting: {step.why}")
            launch(rd, cfg, step.stage, fps[step.stage], force, ex,
                   {k: v for svc in services for k, v in svc.env(step.stage).items()})
        st = wait_stage(rd, step.stage, ex=ex)
        _say(f"[{step.stage}] {st['status']}")
        _each_service(services, "after", step.stage, cfg.runtime.term_grace_s)
        if st["status"] not in DONE:
            return 130 if st["status"] == Status.CANCELLED else 1
    return 0


def _say(line: str) -> None:
    """A line for driver.log, timestamped like say_in_log's (the diary is read
    after the fact: when did train start?), on the run's disk: a full disk
    must not crash the driver over its own diary."""
    with contextlib.suppress(OSError):
        print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}", flush=True)


def say_in_log(rd: RunDir, line: str) -> None:
    """A line in the run's driver.log, from whoever launches it."""
    with contextlib.suppress(OSError), append_log(rd.path / "driver.log") as f:
        f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n".encode())


def append_log(path: Path):
    """A log opened for appending, made 0644 at most whatever the umask: a
    shared run's group reads its logs, never writes them."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644), "ab")


def load_run_config(rd: RunDir, state: dict | None = None) -> Config:
    """The run's frozen config, with relative paths meaning what they meant
    next to the original config file."""
    from pipeline.model import hub
    state = state or rd.read_state()
    rd.readable(rd.config_path, "the frozen config")   # never through a link out of the run
    base = state.get("base_dir")
    # a hub target: the snapshot the run froze (state.json `target`), not what
    # its revision names in the cache now
    with hub.loading_run(state.get("target")):
        cfg = config_mod.load(rd.config_path,
                              base_dir=Path(base) if base else None)
    return hub.apply_pin(cfg, state.get("target"))


def prepare_run(cfg: Config, run_id: str | None = None) -> RunDir:
    """Create (or reuse) the run directory and freeze the config into it, and
    a hub target's snapshot (repo id, revision asked, commit, path) into
    state.json's `target`: resumes use that commit whatever the cache's
    revision becomes. `cfg` is given the same snapshot."""
    from pipeline.model import hub
    rid = check_run_id(run_id, "--run") if run_id is not None else cfg.run.name
    check_runs_dir(cfg.runs_dir())
    try:   # before anything is created: a refusal leaves nothing
        target = hub.freeze(cfg)
    except hub.HubError as e:
        raise config_mod.ConfigError(str(e)) from None
    rd = RunDir(cfg.runs_dir() / rid)
    if rd.is_run():   # damage refused before even the create-lock is made (again below)
        rd.read_state()
        rd.check_readable()
    try:
        return _create_run(cfg, rd, rid, target)
    except OSError as e:
        if isinstance(e, DiskFull) or is_full_errno(e):
            raise
        raise RunDirError(f"{rd.path}: cannot create or lock the run there "
                          f"({e.strerror or e}). Point [run] runs_dir (or --runs-dir) at a "
                          "folder you can write.") from None


def _create_run(cfg: Config, rd: RunDir, rid: str, target) -> RunDir:
    """prepare_run's writes: the run folder under its create-lock, the frozen
    config, the hub snapshot."""
    from pipeline.model import hub
    rd.path.parent.mkdir(parents=True, exist_ok=True)
    # Two launchers creating the same run at once: one creates, the other
    # must not mistake the half-made folder for a foreign one.
    with open(rd.path.parent / f".{rid}.create-lock", "w") as creating:
        fcntl.flock(creating, fcntl.LOCK_EX)
        if rd.path.exists() and not rd.is_run() and any(rd.path.iterdir()):
            raise config_mod.ConfigError(
                f"{rd.path} exists and is not an eagle-panel run; choose another --run name "
                "or [run] name.")
        text = cfg.source.read_text() if cfg.source else ""
        fresh = True
        if rd.is_run():
            rd.read_state()  # a corrupt state is reported, never silently reset
            rd.check_readable()   # ...and so is a damaged file or folder
            fresh = rd.lock_holder() is None
            if fresh:
                rd.create(text, cfg.base_dir, cfg.run.shared)
        else:
            rd.create(text, cfg.base_dir, cfg.run.shared)
        if fresh and (target or rd.read_state().get("target")):
            with rd.mutate_state() as state:
                state["target"] = target
        else:   # a launcher drives it: its snapshot stays
            target = rd.read_state().get("target")
    hub.apply_pin(cfg, target)
    return rd


def claim(rd: RunDir, wait: float = 3.0, ex: Executor | None = None) -> tuple[int | None, int]:
    """(the launcher lock, 0) for a launch, or (None, the pid driving the
    run). The lock is handed to the driver the launch starts (start_driver),
    so of two launches of one run exactly one starts a driver; taking it
    clears the run's cancel request, so a cancel from then on is this
    launch's. A launcher whose stage just ended takes a moment to exit: when
    no stage is running, wait up to `wait` seconds for it."""
    ex = ex or for_run(rd)
    deadline = time.monotonic() + wait
    while True:
        fd = rd.try_lock()
        if fd is not None:
            if rd.read_state().get("cancel_requested"):   # (an earlier launch's)
                with rd.mutate_state() as state:
                    state["cancel_requested"] = False
            return fd, 0
        holder = rd.lock_holder()
        if holder is None:
            continue   # released between the two looks: try again
        running = any(st["status"] == Status.RUNNING
                      for st in reconcile(rd, ex)["stages"].values())
        if running or time.monotonic() >= deadline:
            return None, holder
        time.sleep(0.1)


def start_driver(rd: RunDir, only: str | None = None, force: bool = False,
                 lock_fd: int | None = None) -> subprocess.Popen:
    """Detach a driver for the run: it survives the terminal that started it.
    `lock_fd`: the launcher lock (claim), inherited by the driver."""
    # (the entry point is above run/ and cluster/: it registers the Slurm executor)
    args = [sys.executable, "-m", "pipeline.control", "drive", "--run-dir", str(rd.path)]
    if only:
        args += ["--stage", only]
    if force:
        args.append("--force")
    if lock_fd is not None:
        args += ["--lock-fd", str(lock_fd)]
    env = os.environ.copy()
    env["PYTHONPATH"] = pythonpath_with_project(env.get("PYTHONPATH"))
    log = append_log(rd.path / "driver.log")
    with log:
        return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env, cwd=str(rd.path),
                                pass_fds=() if lock_fd is None else (lock_fd,))


# -- cancelling -------------------------------------------------------------

@dataclass
class CancelResult:
    stage: str | None        # None: a launch under way, stopped before any stage ran
    was_running: bool
    signals: list[str]
    survivors: list[tuple[int, str]]


def cancel_stage(rd: RunDir, stage: str, grace: float, term_grace: float,
                 kill_grace: float = 5.0, ex: Executor | None = None) -> CancelResult:
    """SIGINT (graceful: training saves a checkpoint), then SIGTERM, then
    SIGKILL to the stage's whole process tree: only to processes whose
    identity is verified (cancel_targets); a row that cannot be verified is
    recorded as cancelled, and nothing but its token's processes stopped."""
    ex = ex or for_run(rd)
    if observe(rd, ex)["stages"][stage]["status"] == Status.UNKNOWN:
        rd.update_stage(stage, cancel_requested=True)
        reconcile(rd, ex)
        return CancelResult(stage, True, [], [])
    st = reconcile(rd, ex)["stages"][stage]
    if st["status"] != Status.RUNNING:
        return CancelResult(stage, False, [], [])
    rd.update_stage(stage, cancel_requested=True)
    if st.get("slurm_job") and isinstance(ex, Scheduler):
        return _cancel_job(rd, stage, st["slurm_job"], grace, term_grace + kill_grace, ex)
    # The supervisor records the pid right after it starts the stage, and the
    # driver the supervisor's right after starting it: a cancel that comes in
    # between (a `cancel` at once after `run`) waits for them, or it would find
    # nothing to signal and the stage would run on. (Should it still find none:
    # the supervisor reads the stage's cancel_requested after its record.)
    deadline = time.monotonic() + 15
    while st.get("pid") is None and st["status"] == Status.RUNNING and \
            time.monotonic() < deadline and \
            (st.get("supervisor_pid") is None or ex.alive(st)):
        time.sleep(0.05)
        st = rd.read_state()["stages"][stage]
    find = lambda: cancel_targets(st)  # noqa: E731
    sent = []
    for sig, wait_s in ((signal.SIGINT, grace), (signal.SIGTERM, term_grace),
                        (signal.SIGKILL, kill_grace)):
        left = find()
        if not left:
            break
        sent.append(signal.Signals(sig).name)
        signal_all(left, sig)
        wait_gone(find, wait_s)
    survivors = [(p, proc_name(p)) for p in find()]
    # Let the supervisor record the end before we report.
    end = time.monotonic() + 5
    while time.monotonic() < end and rd.read_state()["stages"][stage]["status"] == Status.RUNNING:
        if not proc_alive(st.get("supervisor_pid"), st.get("supervisor_create_time")):
            reconcile(rd, ex)
            break
        time.sleep(0.05)
    return CancelResult(stage, True, sent, survivors)


def cancel_targets(st: dict) -> list[int]:
    """The live processes of a stage attempt that can be told apart from
    unrelated ones, re-checked on every call: those carrying its token, the
    members of its supervisor's session (pipeline.run.leftovers: pid and
    start time verified), and its process group only while the group's
    leader is the recorded stage (pid and start time) and carries the token.
    A pid without a start time verifies nothing: the kernel may have given it
    to anyone; nor does one without the token: anyone can copy a pid and its
    start time into state.json."""
    from pipeline.run.leftovers import session_processes, token_processes
    found = set(token_processes(st.get("token")))
    found.update(session_processes(st.get("supervisor_pid"), st.get("supervisor_create_time"),
                                   st.get("token")))
    pid, pgid = st.get("pid"), st.get("pgid")
    if pid and pgid == pid and proc_alive(pid, st.get("create_time")) and \
            carries(pid, TOKEN_VAR, st.get("token")):
        found.update(stage_processes(None, pgid))
    return sorted(found)


def _cancel_job(rd: RunDir, stage: str, job: str, grace: float, term_grace: float,
                sched: Scheduler) -> CancelResult:
    """The same escalation through the scheduler: SIGINT to every process
    of the job, then scancel (SIGTERM, and SIGKILL after Slurm's KillWait)."""
    def gone():
        return sched.job_gone(job)
    sent = []
    for sig, wait_s in (("INT", grace), (None, term_grace)):
        if gone():
            break
        sent.append(f"SIG{sig}" if sig else "scancel")
        sched.cancel(job, sig)
        end = time.monotonic() + wait_s
        while time.monotonic() < end and not gone():
            time.sleep(0.2)
    reconcile(rd, sched)
    return CancelResult(stage, True, sent, [] if gone() else [(0, f"{sched.title} job {job}")])


def cancel_run(rd: RunDir, stage: str | None, grace: float, term_grace: float) -> list[CancelResult]:
    """Cancel one stage, or the pipeline: no further stage is started, and
    the running one is stopped."""
    ex = for_run(rd)
    seen = observe(rd, ex)
    active = [s for s in STAGE_NAMES if seen["stages"][s]["status"] in (Status.RUNNING,
                                                                        Status.UNKNOWN)]
    # a launch under way (its lock taken, its driver not at a stage yet) is cancelled too
    launching = stage is None and not active and rd.lock_holder() is not None
    if stage is None and (active or driver_alive(seen) or launching):
        # (a finished run is left as it is: nothing to stop, nothing written)
        with rd.mutate_state() as state:
            state["cancel_requested"] = True
    if launching:
        active = _first_stage_or_end(rd, ex)
        if not active:
            return [CancelResult(None, True, [], [])]
    targets = [stage] if stage else active
    return [cancel_stage(rd, s, grace, term_grace, ex=ex) for s in targets]


def _first_stage_or_end(rd: RunDir, ex: Executor, limit_s: float = 600.0) -> list[str]:
    """After a cancel recorded during a launch: the driver either sees it
    before its first stage and ends, or had already started that stage,
    which is then cancelled like any other. Waits for one of the two (the
    run's shared server may start first: the limit is for a driver that
    hangs, and then the request stays recorded for it)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        running = [s for s, st in observe(rd, ex)["stages"].items()
                   if st["status"] == Status.RUNNING]
        if running or rd.lock_holder() is None:
            return running
        time.sleep(0.05)
    return []
