"""Liveness in one place (pipeline.run.executor): local attempts by pid and
start time, a scheduler's jobs only through the executor its run names, and
a Slurm run read without Slurm's executor refused, never read as dead."""

import os
import subprocess
import sys
import time

import pytest

from pipeline.run import executor
from pipeline.run.executor import ALIVE, GONE, UNKNOWN, Executor, NoExecutor, Scheduler
from pipeline.run.rundir import RunDir, proc_start_ticks
from tests.helpers import ROOT


def test_local_liveness_is_pid_start_time_and_the_attempts_token():
    import subprocess

    from pipeline.run.proctree import SUPERVISOR_VAR, carries
    token = "r/train/1/0123abcd"
    sup = subprocess.Popen(["sleep", "60"], env={**os.environ, SUPERVISOR_VAR: token})
    try:
        from tests.helpers import wait_for
        # (while execve runs, /proc/PID/environ reads empty: taken on pid and start time)
        wait_for(lambda: carries(sup.pid, SUPERVISOR_VAR, token), what="exec'd with its mark")
        ticks = proc_start_ticks(sup.pid)
        st = {"token": token, "supervisor_pid": sup.pid, "supervisor_create_time": ticks}
        assert Executor().liveness(st) == ALIVE
        # the same pid with another start time: a reused pid, not ours
        assert Executor().liveness({**st, "supervisor_create_time": ticks + 1}) == GONE
        # the right pid and start time, another attempt's token: not started by this one
        assert Executor().liveness({**st, "token": "r/train/2/ffff0000"}) == UNKNOWN
        assert "was not started by this run" in executor.unverifiable(
            {**st, "token": "r/train/2/ffff0000"})
    finally:
        sup.kill()
        sup.wait()
    # this process, its pid and start time exact, carries no token of any attempt
    me = {"supervisor_pid": os.getpid(), "supervisor_create_time": proc_start_ticks(os.getpid()),
          "token": token}
    assert Executor().liveness(me) == UNKNOWN
    # a pid without its start time cannot be told from anyone's
    assert Executor().liveness({"pid": os.getpid(), "create_time": None}) == UNKNOWN
    assert Executor().liveness({}) == GONE


def test_a_job_is_never_gone_to_the_local_executor():
    """A job row on a run that does not use a scheduler: unknown (shown,
    stopped by token only), never dead."""
    assert Executor().liveness({"slurm_job": "12", "supervisor_pid": None}) == UNKNOWN


class FakeScheduler(Scheduler):
    name, title = "slurm", "Fake"

    def __init__(self, active):
        self.active = active

    def job_liveness(self, job):
        return ALIVE if self.active else GONE

    def describe(self, st):
        return f"job {st['slurm_job']} {'running' if self.active else 'timed out'}"

    def submit(self, *a, **kw):
        raise NotImplementedError

    def job_gone(self, job):
        return not self.active

    def cancel(self, job, signal=None):
        pass


def slurm_run(tmp_path) -> RunDir:
    rd = RunDir(tmp_path / "r")
    rd.create('[cluster]\nscheduler = "slurm"\n', tmp_path)
    with rd.mutate_state() as state:
        state["stages"]["train"].update(status="running", attempt=1, slurm_job="77",
                                        started_at=time.time())
    return rd


def test_a_slurm_run_without_its_executor_is_refused(tmp_path, monkeypatch):
    from pipeline.run.reconcile import observe, reconcile
    monkeypatch.setattr(executor, "_REGISTERED", {"local": Executor()})
    rd = slurm_run(tmp_path)
    for read in (observe, reconcile):
        with pytest.raises(NoExecutor, match="no slurm executor is registered"):
            read(rd)
    assert rd.read_state()["stages"]["train"]["status"] == "running"   # nothing recorded


def test_the_registered_scheduler_answers_for_its_jobs(tmp_path, monkeypatch):
    from pipeline.run.reconcile import observe
    monkeypatch.setattr(executor, "_REGISTERED", {"local": Executor()})
    executor.register(FakeScheduler(active=True))
    rd = slurm_run(tmp_path)
    assert observe(rd)["stages"]["train"]["status"] == "running"
    gone = observe(rd, FakeScheduler(active=False))["stages"]["train"]   # given explicitly
    assert gone["status"] == "failed" and "job 77 timed out" in gone["reason"]


def test_a_config_name_no_scheduler_has_is_read_as_local():
    assert type(executor.for_scheduler("slurn")) is Executor


def test_pipeline_control_registers_slurm():
    """Every launcher, reader and the detached driver imports pipeline.control."""
    code = ("from pipeline.run import executor\n"
            "import pipeline.control\n"
            "print(type(executor.for_scheduler('slurm')).__name__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "SlurmScheduler"
