"""Stages as real Slurm jobs: a one-node cluster (munged, slurmctld, slurmd
from the distribution's packages, as root, no GPUs asked) started by these
tests on this machine. Skipped, with the reason, only where the packages
are missing or the daemons cannot run; CI installs them."""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline.cluster import slurm
from pipeline.run.rundir import RunDir
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
        assert "pipeline.run.supervise" in (rd.stage_dir(s) / "slurm-1.sh").read_text()
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
    shm = Path("/dev/shm")
    if shm.is_dir() and slurm.fs_type(shm) == "tmpfs":   # node-local by nature
        runs = shm / f"ep-test-{os.getpid()}"
        (tmp_path / "config.toml").write_text(
            f'[run]\nname = "t"\nruns_dir = "{runs}"\n' + CLUSTER.format(extra="nodes = 2"))
        p = cli("run", cwd=tmp_path, check=2)
        assert "tmpfs" in p.stderr and "runs_dir" in p.stderr and not runs.exists(), p.stderr
    slurm_config(tmp_path)
    env = dict(os.environ, PATH="/usr/local/bin/none")
    p = cli("run", cwd=tmp_path, check=2, env=env)
    assert "not on PATH" in p.stderr and not (tmp_path / "runs").exists()


def test_a_controller_that_does_not_answer_fails_nothing(monkeypatch, tmp_path):
    """No verdict from an unreachable slurmctld (a cluster whose controller
    is down: nothing listens at its port): the stage stays running."""
    if slurm.missing_tools():
        pytest.skip(f"Slurm client tools missing: {slurm.missing_tools()}")
    conf = tmp_path / "slurm.conf"
    conf.write_text(f"ClusterName=down\nSlurmctldHost=localhost\nSlurmctldPort={free_port()}\n"
                    "MessageTimeout=1\nAuthType=auth/munge\n"
                    "NodeName=localhost CPUs=1 State=UNKNOWN\n"
                    "PartitionName=debug Nodes=localhost Default=YES State=UP\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    assert slurm.job_state("424242", fresh=True) is None
    assert slurm.SlurmScheduler().alive({"slurm_job": "424242"})


MULTI_NODE = """
[run]
name = "mn"
runs_dir = "runs"

[data]
max_samples = 160

[stages.regenerate]
enabled = false

[stages.prepare]
seq_length = 192

[stages.extract]
backend = "hf"
workers = 1
layer_ids = [1, 2, 3]
batch_tokens = 192

[stages.vocab]
draft_vocab_size = 224

[runtime]
env = { EAGLE_PANEL_SIMULATE_GPUS = "2" }   # the node samplers' GPUs: SIMULATED (no GPU here)

[cluster]
scheduler = "slurm"
partition = "debug"
nodes = 2
lost_after_s = 3
# STAND-IN: this one machine stands in for two nodes (two tasks of one
# allocation on the same node); a real cluster gets --nodes=2 --ntasks-per-node=1.
sbatch_args = ["--nodes=1", "--ntasks-per-node=2"]
"""


def _node_worker_pids(task: str) -> list[int]:
    """The python processes of task `task` (not the srun that started them,
    whose command line names the module too)."""
    from pipeline.run import proctree
    return [pid for pid in proctree.live_pids()
            if "-m pipeline.extract.nodes" in (cmd := proctree.cmdline(pid))
            and not os.path.basename(cmd.split(" ", 1)[0]).startswith("srun")
            and f"SLURM_PROCID={task}".encode() in proctree.environ(pid)]


def _freeze_holding_a_chunk(queue, hs, task: str) -> bool:
    """SIGSTOP node `task`'s workers; True if, frozen, one has reported a
    sample done and holds a chunk not done yet with at least one of its files
    written (else they are let go again: SIGCONT)."""
    from pipeline.cluster.workqueue import WorkQueue
    from pipeline.model.hsfile import hs_path
    pids, ok = _node_worker_pids(task), False
    try:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        q = WorkQueue(queue, "test-observer")
        if not q.remaining_rows():
            raise AssertionError(f"node {task} finished every chunk before it was caught in one")
        done, mine = q.done(), (lambda w: w.endswith(f"-{task}") or f"-{task}." in w)
        held = [k for k, (_, w) in q.owners().items() if k not in done and mine(w)]
        started = [k for k in held if any(hs_path(hs, i).exists() for i in q.chunks[k])]
        reported = any(mine(w) and st.get("counters", (0,))[0] > 0
                       for w, st in q.statuses().items())
        ok = bool(pids) and bool(started) and reported
        return ok
    finally:
        if not ok:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)


def test_extract_over_two_nodes_survives_a_lost_one(cluster, tmp_path):
    """Extract as data parallel over the tasks of one allocation (srun), one
    shared queue; the worker of task 1 is SIGKILLed mid-chunk (its node lost):
    task 0 takes over its unfinished samples without redoing the ones written,
    the stage succeeds with every file valid, none missing."""
    from pipeline.extract.job import RowIds
    from pipeline.model.hsfile import hs_path, validate_file
    from pipeline.run.events import read_events
    (tmp_path / "config.toml").write_text(MULTI_NODE)
    cli("run", cwd=tmp_path, check=0)
    rd = RunDir(tmp_path / "runs" / "mn")
    hs = rd.out_dir("extract") / "hidden_states"
    queue = rd.stage_dir("extract") / "queue"
    status = queue / "status"
    # The points this test controls (the tiny model extracts all 160 samples in
    # about a second, and on a loaded machine one task may start seconds after
    # the other): node 0 is held (SIGSTOP) from its start, before it can claim
    # anything, so node 1 works alone; node 1 is frozen and killed only while it
    # holds a chunk it has started and not finished; then node 0 is let go, and
    # has the rest to do, node 1's unfinished chunk among it.
    node0 = wait_for(lambda: _node_worker_pids("0"), timeout=300, poll=0.005,
                     what="node 0's worker to start")
    try:
        for pid in node0:
            os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: hs.is_dir() and _freeze_holding_a_chunk(queue, hs, "1"),
                 timeout=300, poll=0.005, what="node 1 frozen in a chunk it has started")
    finally:
        for pid in node0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    for pid in _node_worker_pids("1"):
        os.kill(pid, 9)
    wait_for(lambda: rd.read_state()["stages"]["extract"]["status"] != "running",
             timeout=300, what="extract to end")
    cli("cancel", cwd=tmp_path, timeout=120, check=0)   # the later stages are not tested here
    st = rd.read_state()["stages"]["extract"]
    log = rd.log_path("extract").read_text()
    assert st["status"] == "succeeded", (st, log[-3000:])
    rows = RowIds(rd.out_dir("prepare") / "data")
    n = len(rows)
    meta = json.loads((rd.out_dir("extract") / "meta.json").read_text())
    import torch
    bad = [i for i in range(n) if validate_file(hs_path(hs, i), rows[i], len(meta["layer_ids"]),
                                                meta["hidden_size"], torch.float32) is not None]
    assert not bad, f"{len(bad)} files missing or invalid, e.g. {bad[:5]}"
    import re
    taken = re.findall(r"took over chunk \d+ from \S+, which stopped \((\d+) of (\d+) rows left\)",
                       log)
    assert taken and all(int(left) < int(size) for left, size in taken), log[-3000:]
    warnings = [e["message"] for e in read_events(rd.events_path("extract"))
                if e["type"] == "warning"]
    assert any("stopped reporting" in w for w in warnings), warnings
    # Each job's node sampler wrote the node's (simulated) GPUs for the panel,
    # and ended with its job.
    from pipeline.run import proctree
    report = json.loads(next((rd.path / "telemetry").glob("*.json")).read_text())
    assert report["source"] == "simulated" and len(report["gpus"]) == 2, report
    assert report["stage"] in ("prepare", "extract", "vocab", "train") and report["job"]
    wait_for(lambda: not [p for p in proctree.live_pids() if "pipeline.cluster.node_telemetry" in
                          proctree.cmdline(p) and str(rd.path) in proctree.cmdline(p)],
             timeout=60, what="the node samplers to end with their jobs")
    statuses = [json.loads(p.read_text()) for p in status.glob("*.json")]
    assert len(statuses) == 2 and all(s["counters"][0] > 0 for s in statuses), statuses


def test_train_torchrun_meets_over_the_allocation(cluster, tmp_path):
    """The train stage's torchrun command over two tasks of one allocation
    (STAND-IN: one machine for two nodes): every agent finds the
    rendezvous, the ranks form one world and an all_reduce goes through
    (gloo; the speculators trainer itself needs GPUs)."""
    script = tmp_path / "launch.py"
    script.write_text(textwrap.dedent(f"""\
        import subprocess, sys
        sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
        from pipeline.stages.train import torchrun_command
        from pipeline.cluster.slurm import allocation_tasks
        cmd = torchrun_command("tests.fakes.dist_probe", [{str(tmp_path)!r}], 1, allocation_tasks())
        print(cmd, flush=True)
        sys.exit(subprocess.call(cmd))
        """))
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    p = subprocess.run(["sbatch", "--wait", "--nodes=1", "--ntasks-per-node=2",
                        f"--output={tmp_path}/out.log", f"--chdir={tmp_path}",
                        f"--wrap={sys.executable} {script}"],
                       capture_output=True, text=True, env=env, timeout=300, check=False)
    log = (tmp_path / "out.log").read_text() if (tmp_path / "out.log").exists() else ""
    assert p.returncode == 0, (p.stdout, p.stderr, log)
    assert "--rdzv-endpoint=" in log and "srun" in log
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert {r["world"] for r in ranks} == {2} and {r["sum"] for r in ranks} == {3}
    assert {r["group_rank"] for r in ranks} == {0, 1}       # one torchrun agent per task
    assert {r["slurm_procid"] for r in ranks} == {"0", "1"}


def test_doctor_plans_each_node(cluster, tmp_path):
    (tmp_path / "config.toml").write_text(MULTI_NODE)
    p = cli("doctor", "--json", cwd=tmp_path, timeout=300)
    found = [f for f in json.loads(p.stdout)["findings"] if f["area"] == "cluster"]
    plan = next((f["message"] for f in found if "nodes per extract" in f["message"]), None)
    assert plan, found
    assert "2 nodes per extract" in plan and "each node writes" in plan and "torchrun" in plan


@pytest.mark.vllm
def test_extract_over_two_nodes_through_real_vllm_servers(cluster, tmp_path):
    """The vllm-server backend fed by the shared queue: each of two node
    workers (STAND-IN: two tasks on this one machine) starts its own real
    vLLM server (0.32 CPU build) and takes chunks until the queue is empty;
    the stage gets both nodes' KV-cache reports and every file is valid."""
    from pipeline.extract.job import RowIds
    from pipeline.model.hsfile import hs_path, validate_file
    from pipeline.paths import VLLM_VENV
    from pipeline.run.events import read_events
    if not (VLLM_VENV / "bin" / "python").exists():
        pytest.skip(f"no real vLLM: {VLLM_VENV} is missing (scripts/install.sh makes it)")
    config = (MULTI_NODE.replace('backend = "hf"', 'backend = "vllm-server"\nmax_inflight = 2')
              .replace("max_samples = 160", "max_samples = 24"))
    (tmp_path / "config.toml").write_text(config)
    cli("run", cwd=tmp_path, check=0)
    rd = RunDir(tmp_path / "runs" / "mn")
    try:
        wait_for(lambda: rd.read_state()["stages"]["extract"]["status"] not in
                 ("pending", "running"), timeout=400, poll=1, what="extract to end")
    finally:
        cli("cancel", cwd=tmp_path, timeout=120, check=0)   # the later stages, or a hang
    st = rd.read_state()["stages"]["extract"]
    log = rd.log_path("extract").read_text()
    assert st["status"] == "succeeded", (st, log[-3000:])
    meta = json.loads((rd.out_dir("extract") / "meta.json").read_text())
    assert meta["backend"] == "vllm-server"
    rows = RowIds(rd.out_dir("prepare") / "data")
    import torch
    hs = rd.out_dir("extract") / "hidden_states"
    assert all(validate_file(hs_path(hs, i), rows[i], len(meta["layer_ids"]), meta["hidden_size"],
                             torch.float32) is None for i in range(len(rows)))
    kv = [e for e in read_events(rd.events_path("extract")) if e["type"] == "kv_cache"]
    assert len({e["server"].split("/")[0] for e in kv}) == 2, kv   # both nodes' servers
    statuses = [json.loads(p.read_text())
                for p in (rd.stage_dir("extract") / "queue" / "status").glob("*.json")]
    assert len(statuses) == 2 and sum(s["counters"][0] for s in statuses) == len(rows), statuses
    assert all(s["state"] == "done" for s in statuses)
    assert sorted(p.name for p in (rd.stage_dir("extract") / "nodes").iterdir()) == \
        sorted(s["worker"] for s in statuses)           # each node's server logs apart
