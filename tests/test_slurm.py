"""Stages as real Slurm jobs: a one-node cluster (munged, slurmctld, slurmd
from the distribution's packages, as root, no GPUs asked) started by these
tests on this machine. Skipped, with the reason, only where the packages
are missing or the daemons cannot run; CI installs them."""

import os
import shutil
import socket
import subprocess
import textwrap

import pytest

from pipeline import slurm
from pipeline.rundir import RunDir
from pipeline.vllm.server import free_port
from tests.helpers import cli, stagekit_config, wait_for

pytestmark = pytest.mark.integration


def _ok(argv) -> bool:
    return subprocess.run(argv, capture_output=True, check=False).returncode == 0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    missing = [t for t in ("munged", "slurmctld", "slurmd", *slurm.TOOLS) if not shutil.which(t)]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)}): apt-get install "
                    "slurmctld slurmd slurm-client munge")
    if os.geteuid() != 0:
        pytest.skip("the test cluster runs its daemons as root")
    d = tmp_path_factory.mktemp("slurm")
    host = socket.gethostname().split(".")[0]
    (d / "state").mkdir()
    (d / "spool").mkdir()
    conf = d / "slurm.conf"
    conf.write_text(textwrap.dedent(f"""\
        ClusterName=eptest
        SlurmctldHost={host}
        SlurmUser=root
        SlurmdUser=root
        AuthType=auth/munge
        ProctrackType=proctrack/linuxproc
        TaskPlugin=task/none
        SelectType=select/cons_tres
        SelectTypeParameters=CR_Core
        AccountingStorageType=accounting_storage/none
        JobCompType=jobcomp/none
        ReturnToService=2
        StateSaveLocation={d}/state
        SlurmdSpoolDir={d}/spool
        SlurmctldPidFile={d}/slurmctld.pid
        SlurmdPidFile={d}/slurmd.pid
        SlurmctldLogFile={d}/slurmctld.log
        SlurmdLogFile={d}/slurmd.log
        SlurmctldPort={free_port()}
        SlurmdPort={free_port()}
        MpiDefault=none
        KillWait=5
        MinJobAge=600
        OverTimeLimit=0
        NodeName={host} CPUs={os.cpu_count()} State=UNKNOWN
        PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
        """))
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(conf)
    daemons = []
    if not _ok(["sh", "-c", "munge -n | unmunge"]):
        if not os.path.exists("/etc/munge/munge.key"):
            subprocess.run(["mungekey", "-c"], capture_output=True, check=False)
        os.makedirs("/run/munge", exist_ok=True)
        subprocess.run(["munged", "--force"], capture_output=True, check=False)
    for argv in (["slurmctld", "-D", "-i"], ["slurmd", "-D"]):
        daemons.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        wait_for(lambda: "idle" in subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True,
                                                  text=True, check=False).stdout,
                 timeout=60, poll=0.5, what="the test cluster's node idle")
    except AssertionError:
        for p in daemons:
            p.kill()
        logs = "".join((d / f).read_text()[-800:] for f in ("slurmctld.log", "slurmd.log")
                       if (d / f).exists())
        pytest.skip(f"the Slurm daemons did not come up here: {logs}")
    yield conf
    for p in daemons:
        p.terminate()
    for p in daemons:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
    if old is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = old


CLUSTER = '[cluster]\nscheduler = "slurm"\npartition = "debug"\n{extra}\n'


def slurm_config(tmp_path, actions=None, extra="", name="t"):
    return stagekit_config(tmp_path, actions, CLUSTER.format(extra=extra), name)


def test_stages_run_as_slurm_jobs(cluster, tmp_path):
    slurm_config(tmp_path)
    p = cli("run", "--wait", cwd=tmp_path, timeout=300, check=0)
    rd = RunDir(tmp_path / "runs" / "t")
    state = rd.read_state()
    jobs = {s: st["slurm_job"] for s, st in state["stages"].items()}
    assert all(jobs.values()), jobs
    assert len(set(jobs.values())) == len(jobs)   # one job per stage
    for s, job in jobs.items():
        assert slurm.job_state(job, fresh=True).state == "COMPLETED"
        assert state["stages"][s]["status"] == "succeeded" and state["stages"][s]["pid"]
        assert f"stagekit {s}: ok" in rd.log_path(s).read_text()   # the job's output: the log
        assert "pipeline.supervise" in (rd.stage_dir(s) / "slurm-1.sh").read_text()
    assert "Slurm job" in (rd.path / "driver.log").read_text() and "succeeded" in p.stdout


def test_cancel_scancel_kill_and_resume(cluster, tmp_path):
    """eagle-panel cancel goes through the scheduler; a job killed from
    outside (scancel --signal=KILL) is a failed stage with the scheduler's
    word for it, and resume finishes the run."""
    slurm_config(tmp_path, {"extract": "sleep_once:120", "train": "sleep:120"})
    cli("run", cwd=tmp_path, check=0)
    rd = RunDir(tmp_path / "runs" / "t")
    wait_for(lambda: rd.read_state()["stages"]["extract"].get("pid"), timeout=120,
             what="extract running in its job")
    job = rd.read_state()["stages"]["extract"]["slurm_job"]
    assert slurm.job_state(job, fresh=True).state == "RUNNING"
    assert f"note: Slurm job {job} running" in cli("status", cwd=tmp_path, check=0).stdout
    subprocess.run(["scancel", "--signal=KILL", "--full", job], check=True)
    wait_for(lambda: rd.read_state()["stages"]["extract"]["status"] == "failed", timeout=120,
             what="extract failed")
    st = rd.read_state()["stages"]["extract"]
    # recorded by the supervisor (the stage died first) or, if the supervisor
    # went with it, taken from the scheduler
    assert st["signal"] in ("SIGKILL", "SIGTERM") or f"Slurm job {job}" in (st["reason"] or ""), st
    # resume: extract's second attempt is quick; train sleeps, and is cancelled
    cli("resume", cwd=tmp_path, check=0)
    wait_for(lambda: rd.read_state()["stages"]["train"].get("pid"), timeout=180,
             what="train running in its job")
    train_job = rd.read_state()["stages"]["train"]["slurm_job"]
    p = cli("cancel", cwd=tmp_path, timeout=120, check=0)
    st = rd.read_state()["stages"]["train"]
    assert st["status"] == "cancelled", (st, p.stdout, p.stderr)
    assert not slurm.job_state(train_job, fresh=True).active
    assert "train: cancelled (sent SIGINT" in p.stdout


def test_a_job_past_its_time_limit_is_resumed(cluster, tmp_path):
    """--time=1 (a minute): Slurm stops the job; the stage reads as failed
    with the scheduler's TIMEOUT, and resume completes it."""
    slurm_config(tmp_path, {"vocab": "sleep_once:600"}, extra='time_limit = "1"')
    p = cli("run", "--wait", cwd=tmp_path, timeout=400, check=1)
    rd = RunDir(tmp_path / "runs" / "t")
    st = rd.read_state()["stages"]["vocab"]
    assert st["status"] == "failed"
    assert "timeout" in (st.get("reason") or "").lower() or \
        "TIME LIMIT" in rd.log_path("vocab").read_text(), (st, p.stdout)
    cli("resume", "--wait", cwd=tmp_path, timeout=300, check=0)
    assert rd.read_state()["stages"]["evaluate"]["status"] == "succeeded"


def test_a_scheduler_that_would_refuse_is_said_before_anything(cluster, tmp_path):
    slurm_config(tmp_path, extra="").write_text(
        slurm_config(tmp_path).read_text().replace('partition = "debug"', 'partition = "gpu"'))
    p = cli("run", cwd=tmp_path, check=2)
    assert "partition = 'gpu' does not exist" in p.stderr and "debug" in p.stderr
    assert not (tmp_path / "runs").exists()
    slurm_config(tmp_path)
    env = dict(os.environ, PATH="/usr/local/bin/none")
    p = cli("run", cwd=tmp_path, check=2, env=env)
    assert "not on PATH" in p.stderr and not (tmp_path / "runs").exists()


def test_a_controller_that_does_not_answer_fails_nothing(monkeypatch):
    """No verdict from an unreachable slurmctld: the stage stays running."""
    if slurm.missing_tools():
        pytest.skip(f"Slurm client tools missing: {slurm.missing_tools()}")
    from pipeline import runner
    monkeypatch.setenv("SLURM_CONF", "/nonexistent/slurm.conf")
    assert slurm.job_state("424242", fresh=True) is None
    assert runner.stage_alive({"slurm_job": "424242"})
