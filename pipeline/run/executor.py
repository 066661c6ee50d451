"""Who runs a run's stage attempts, and whether one still runs: the one place that is asked.

An attempt runs either as local processes (its supervisor, under it the
stage), identified by the pid and kernel start time recorded in state.json;
or, on a `[cluster] scheduler` run, as a batch job, of which only the
scheduler knows whether it still runs. `Executor` is the local answer;
`Scheduler` is what a scheduler's implementation adds (pipeline.cluster.slurm:
its jobs' liveness, submitting and cancelling them).

run/ never imports cluster/ (cluster is above run): a scheduler's
implementation is registered here by a module above both (pipeline.control,
which every launcher, reader and the detached driver imports), and
`for_run` refuses a run whose scheduler is not registered in this process
rather than read its jobs without it. Even the local executor never calls
a job gone: a stage recorded on a job is UNKNOWN to it (nothing of it can
be verified here), which readers show and launchers stop only by token.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

from pipeline.run.proctree import SUPERVISOR_VAR, TOKEN_VAR, carries
from pipeline.run.rundir import RunDir, proc_start_ticks

ALIVE, GONE, UNKNOWN = "alive", "gone", "unknown"
# `[cluster] scheduler`'s choices (pipeline.config checks the config against them).
SCHEDULERS = ("local", "slurm")


class NoExecutor(RuntimeError):
    """A run's scheduler has no executor registered in this process: its
    stages' liveness cannot be asked, so nothing is read or recorded."""


def proc_alive(pid: int | None, start_ticks: int | None) -> bool:
    """Whether the process recorded as (pid, start time) still runs. Without
    a start time the pid cannot be told from an unrelated process that got it
    since: that is not a match (never signal, never trust it)."""
    if not isinstance(pid, int) or pid <= 0 or not isinstance(start_ticks, int):
        return False
    return proc_start_ticks(pid) == start_ticks


def driver_alive(state: dict) -> bool:
    """Whether the run's launcher (the detached driver, always a local
    process whatever runs the stages) still runs, as recorded."""
    d = state.get("driver") or {}
    return proc_alive(d.get("pid"), d.get("create_time"))


def unverifiable(st: dict) -> str:
    """Why a running row's identity cannot be verified, in words."""
    if st.get("slurm_job"):
        return f"Slurm job {st['slurm_job']} is recorded, but this run does not use Slurm"
    for who, pid, ticks, _ in _recorded(st):
        if pid and ticks is None:
            return f"its {who}'s pid {pid} is recorded without a start time"
    for who, pid, ticks, var in _recorded(st):
        if proc_alive(pid, ticks) and carries(pid, var, st.get("token")) is False:
            return (f"its {who}'s pid {pid} runs with the recorded start time but was not "
                    f"started by this run (no {var} of this attempt in its environment)")
    return "its processes are not recorded"


def _recorded(st: dict) -> tuple:
    """(who, pid, start time, the variable that proves the run started it)."""
    return (("supervisor", st.get("supervisor_pid"), st.get("supervisor_create_time"),
             SUPERVISOR_VAR), ("stage", st.get("pid"), st.get("create_time"), TOKEN_VAR))


class Executor:
    """Stage attempts as local processes under their supervisor."""

    name = "local"

    def liveness(self, st: dict) -> str:
        """ALIVE when the stage's supervisor or the stage itself still runs, as
        recorded (pid and start time: the supervisor's is recorded first, so a
        stage that has just started is anchored on it) and carries the
        attempt's token in its environment (a pid and start time copied into
        state.json prove which process it is, not that the run started it);
        GONE when neither runs; UNKNOWN when a pid was recorded without its
        start time, or runs without the token (it cannot be told from an
        unrelated process). A recorded job is the job's executor's to answer
        (`job_liveness`)."""
        if st.get("slurm_job"):
            return self.job_liveness(st["slurm_job"])
        live = [(pid, var) for _, pid, ticks, var in _recorded(st) if proc_alive(pid, ticks)]
        # (None: another user's process, its environment unreadable; it cannot be signalled)
        if any(carries(pid, var, st.get("token")) is not False for pid, var in live):
            return ALIVE
        if live or any(pid and ticks is None for _, pid, ticks, _ in _recorded(st)):
            return UNKNOWN
        return GONE

    def alive(self, st: dict) -> bool:
        return self.liveness(st) == ALIVE

    def job_liveness(self, job: str) -> str:
        """A job recorded on a run that does not use a scheduler: nothing of
        it can be verified here, so it is neither alive nor gone."""
        return UNKNOWN

    def describe(self, st: dict) -> str:
        """The attempt's job as its executor sees it, in words: pending (and
        why), running, or how it ended; "" when it cannot say (a local
        process leaves nothing behind to ask)."""
        return ""


class SchedulerError(Exception):
    """The scheduler refused or is not there: said before anything is submitted."""


class Scheduler(Executor, ABC):
    """Stage attempts as a scheduler's batch jobs: the job's command is the
    supervisor, so pids, exit codes and events land in the run directory as
    locally; only whether the job still runs, and why it ended when the
    supervisor could not say, come from the scheduler."""

    title = "scheduler"   # how a job is named in the driver's log and in results ("Slurm job 12")

    @abstractmethod
    def job_liveness(self, job: str) -> str:
        """ALIVE or GONE by the scheduler; a scheduler that does not answer
        is ALIVE (a slow controller must never fail a running stage)."""

    @abstractmethod
    def describe(self, st: dict) -> str:
        """What the scheduler says of the attempt's job ("" when it does not answer)."""

    @abstractmethod
    def submit(self, cfg, rd: RunDir, stage: str, attempt: int, gpu_stage: bool,
               command: list[str], env: dict[str, str]) -> str:
        """Submit `command` (the supervisor) as the attempt's job; returns the
        job id, or raises SchedulerError with the fix."""

    @abstractmethod
    def job_gone(self, job: str) -> bool:
        """Whether the job has ended, asked afresh (cancelling waits on it);
        False while the scheduler does not answer."""

    @abstractmethod
    def cancel(self, job: str, signal: str | None = None) -> None:
        """Cancel the job; with a signal name ("INT"), send it to every process of the job."""


_REGISTERED: dict[str, Executor] = {"local": Executor()}


def register(executor: Executor) -> None:
    """Make `executor` the one that answers for runs of its scheduler, in
    this process (called by a module above run/ and cluster/)."""
    _REGISTERED[executor.name] = executor


def for_scheduler(name: str, where: str | Path = "this run") -> Executor:
    """The executor for `[cluster] scheduler = name`. A name the config
    refuses is read as local, as it always was; a scheduler with no
    executor registered here raises NoExecutor: read without it, its
    stages would be told apart from nothing."""
    if name not in SCHEDULERS:
        name = "local"
    try:
        return _REGISTERED[name]
    except KeyError:
        raise NoExecutor(f"{where} runs its stages with {name}, but no {name} executor is "
                         "registered in this process (import pipeline.control, which "
                         "registers it): its stages' liveness cannot be asked") from None


def for_run(rd: RunDir) -> Executor:
    """The executor of the run's frozen `[cluster] scheduler`."""
    return for_scheduler(rd.scheduler(), rd.path)
