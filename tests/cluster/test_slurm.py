"""Stages as real Slurm jobs on a cluster of two nodes that are really two
(tests/netns_cluster.py: each node a network namespace with its own hostname,
process table and address, slurmctld on a third host, the shared disk mounted
on each node over the network; munged, slurmctld, slurmd from the
distribution's packages, as root, no GPUs asked), started and stopped by these
tests. The pipeline across both nodes against one node, and the faults a
cluster has: a node's link cut mid-extract and mid-train, the controller cut
off from the login node. Skipped, with the reason, only where namespaces or
the packages are missing; CI installs them (scripts/install.sh --dev).

Each fault's detection and recovery times are printed (`pytest -s`) and
stated in docs/cluster.md."""

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.cluster import slurm
from pipeline.run.rundir import RunDir
from pipeline.vllm.server import free_port
from tests.configs import merged, write
from tests.helpers import cli, stagekit_config, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two nodes that are really two (tests/netns_cluster.py): each its own
    network namespace, hostname, process table and address, slurmctld on a
    third host, the tests' folder mounted on each node over the network."""
    from tests.netns_cluster import NetCluster, Unavailable, unavailable_reason
    why = unavailable_reason()
    if why:
        pytest.skip(why)
    try:
        c = NetCluster(tmp_path_factory.getbasetemp()).start()
    except Unavailable as e:
        pytest.skip(str(e))
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(c.conf)
    try:
        yield c
    finally:
        c.stop()
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old


@pytest.fixture(autouse=True)
def fresh_answers():
    """Each test starts with nothing remembered of the controller (slurm.py's
    cache and silence gate live in this process: an earlier test's silent
    controller must not be this one's)."""
    slurm._cache.clear()
    slurm._silence.update(since=None, asked=0.0)
    yield


@pytest.fixture
def cancelled_after(tmp_path):
    """Whatever run the test left in its folder is cancelled when it ends, passed
    or failed: no driver left polling a cluster the module then stops."""
    yield
    cli("cancel", cwd=tmp_path, timeout=120)


CLUSTER = {"scheduler": "slurm", "partition": "debug"}


def slurm_config(tmp_path, actions=None, extra=None, name="t"):
    """stagekit_config's stages as Slurm jobs; `extra`: more of [cluster]."""
    return stagekit_config(tmp_path, actions, {"cluster": {**CLUSTER, **(extra or {})}}, name)


@pytest.fixture(scope="module")
def time_limited(cluster, tmp_path_factory):
    """A run whose vocab job outlives its one-minute time limit (--time=1),
    started by the first test that asks for it and looked at by a later one:
    its minute passes beside the tests between them (a sleeping stage costs no
    CPU), not on its own."""
    d = tmp_path_factory.mktemp("time-limit")
    slurm_config(d, {"vocab": "sleep_once:600"}, extra={"time_limit": "1"})
    cli("run", cwd=d, check=0)
    yield d, RunDir(d / "runs" / "t")
    cli("cancel", cwd=d, timeout=120)   # (whatever is left of it: its driver too)


def test_stages_run_as_slurm_jobs(cluster, tmp_path, time_limited):
    slurm_config(tmp_path)
    p = cli("run", "--wait", cwd=tmp_path, timeout=300, check=0)
    rd = RunDir(tmp_path / "runs" / "t")
    state = rd.read_state()
    jobs = {s: st["slurm_job"] for s, st in state["stages"].items()}
    assert all(jobs.values()), jobs
    assert len(set(jobs.values())) == len(jobs)   # one job per stage
    for s, job in jobs.items():
        # the run ends when its stages have recorded their end; Slurm may still be
        # finishing the last job (COMPLETING: its epilog) for a moment after that
        wait_for(lambda job=job: slurm.job_state(job, fresh=True).state == "COMPLETED",
                 timeout=120, what=f"{s}'s job {job} COMPLETED in Slurm")
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


def test_a_scheduler_that_would_refuse_is_said_before_anything(cluster, tmp_path):
    slurm_config(tmp_path, extra={"partition": "gpu"})
    p = cli("run", cwd=tmp_path, check=2)
    assert "partition = 'gpu' does not exist" in p.stderr and "debug" in p.stderr
    assert not (tmp_path / "runs").exists()
    shm = Path("/dev/shm")
    if shm.is_dir() and slurm.fs_type(shm) == "tmpfs":   # node-local by nature
        runs = shm / f"ep-test-{os.getpid()}"
        write(tmp_path / "config.toml", {"run": {"name": "t", "runs_dir": str(runs)},
                                         "cluster": {**CLUSTER, "nodes": 2}})
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


def test_a_multi_node_job_asks_for_the_nodes_that_are_up():
    """min_nodes below nodes: as many nodes as are up, never fewer than
    min_nodes; at the default, exactly `nodes` whatever is up."""
    from pipeline.config import ClusterSection
    assert slurm.job_nodes(ClusterSection(nodes=4), up=1) == 4
    assert slurm.job_nodes(ClusterSection(nodes=4, min_nodes=2), up=3) == 3
    assert slurm.job_nodes(ClusterSection(nodes=4, min_nodes=2), up=1) == 2
    assert slurm.job_nodes(ClusterSection(nodes=4, min_nodes=2), up=9) == 4
    assert slurm.job_nodes(ClusterSection(nodes=4, min_nodes=2), up=None) == 4


MULTI_NODE = {
    "run": {"name": "mn", "runs_dir": "runs"},
    "data": {"max_samples": 160},
    "stages": {
        "regenerate": {"enabled": False},
        "prepare": {"seq_length": 192},
        "extract": {"backend": "hf", "workers": 1, "layer_ids": [1, 2, 3], "batch_tokens": 192},
        "vocab": {"draft_vocab_size": 224},
    },
    # the node samplers' GPUs: SIMULATED (no GPU here)
    "runtime": {"env": {"EAGLE_PANEL_SIMULATE_GPUS": "2"}},
    "cluster": {"scheduler": "slurm", "partition": "debug", "nodes": 2, "lost_after_s": 3},
}


def test_doctor_plans_each_node(cluster, tmp_path):
    write(tmp_path / "config.toml", MULTI_NODE)
    p = cli("doctor", "--json", cwd=tmp_path, timeout=300)
    found = [f for f in json.loads(p.stdout)["findings"] if f["area"] == "cluster"]
    plan = next((f["message"] for f in found if "nodes per extract" in f["message"]), None)
    assert plan, found
    assert "2 nodes per extract" in plan and "each node writes" in plan and "torchrun" in plan


def _pipeline_config(tmp_path, name: str, nodes: int, ranks: int, backend: str,
                     extra: dict | None = None):
    """The built-in target's pipeline at a test's size over `nodes` nodes,
    training on `ranks` CPU ranks per node (gloo); regenerate and evaluate off."""
    from tests.configs import tiny_pipeline
    tables = tiny_pipeline(name, samples=24, stages={
        "regenerate": {"enabled": False}, "evaluate": {"enabled": False},
        "extract": {"backend": backend, "workers": 1, "max_inflight": 2},
        "train": {"epochs": 2, "total_seq_len": 384, "ranks_per_node": ranks}})
    tables = merged(tables, {
        "run": {"runs_dir": "runs"},
        # one thread a rank on either side: the same float sums in 1 x 2 and 2 x 1
        "runtime": {"env": {"OMP_NUM_THREADS": "1"}},
        "cluster": {"scheduler": "slurm", "partition": "debug", "nodes": nodes,
                    "lost_after_s": 3, "collective_timeout_s": 30, "rendezvous_timeout_s": 60}})
    return write(tmp_path / "config.toml", merged(tables, extra or {}))


def _wait_run_end(rd: RunDir, timeout: float) -> None:
    """Until the run's driver has started a stage and is gone (run to its end)."""
    def ended():
        st = rd.read_state()
        return not st.get("driver") and any(s["status"] != "pending"
                                            for s in st["stages"].values())
    wait_for(ended, timeout=timeout, poll=1, what=f"run {rd.id} to end")


def _hold_the_first_server_up(queue: Path) -> None:
    """The node worker whose vLLM server is up first is held (SIGSTOP) until
    the other's is: the tiny target's 24 samples take one server a second,
    and the two servers' starts, on two shared cores, can be a minute apart."""
    def serving():
        return {w.rsplit("-", 1)[1] for w, st in WorkQueue(queue, "test").statuses().items()
                if st.get("kv_cache")} if (queue / "status").is_dir() else set()
    from pipeline.cluster.workqueue import WorkQueue
    first = wait_for(serving, timeout=600, poll=0.005, what="a node's vLLM server up")
    held = [pid for task in first for pid in _node_worker_pids(task)] if len(first) == 1 else []
    try:
        for pid in held:
            os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: len(serving()) == 2, timeout=600, poll=0.2,
                 what="both nodes' vLLM servers up")
    finally:
        for pid in held:
            os.kill(pid, signal.SIGCONT)


def _train_losses(rd) -> list[tuple[int, float]]:
    from pipeline.run.events import read_events
    return [(e["step"], e["values"]["loss"]) for e in read_events(rd.events_path("train"))
            if e["type"] == "metric" and e.get("split") == "train"]


@pytest.mark.vllm
def test_the_pipeline_over_two_nodes_equals_one_node(cluster, tmp_path):
    """Extract over both nodes, each node's worker with its own real vLLM
    server (0.32 CPU build) on that node's loopback, the queue on the shared
    disk; vocab; speculators' trainer under torchrun over both nodes (gloo
    over the link, one rank each). Against the same run on one node with two
    ranks: the same hidden states, and the same training step by step (the
    same global batch: two data-parallel ranks either way)."""
    cluster.wait_idle(timeout=180)   # both nodes up (an earlier test may have cut one)
    from pipeline.extract.job import RowIds
    from pipeline.model.hsfile import hs_path
    from pipeline.paths import VLLM_VENV
    from pipeline.run.events import read_events
    if not (VLLM_VENV / "bin" / "python").exists():
        pytest.skip(f"no real vLLM: {VLLM_VENV} is missing (scripts/install.sh makes it)")
    runs = {}
    for name, nodes, ranks in (("two-nodes", 2, 1), ("one-node", 1, 2)):
        d = tmp_path / name
        d.mkdir()
        _pipeline_config(d, name, nodes, ranks, "vllm-server")
        rd = RunDir(d / "runs" / name)
        cli("run", cwd=d, check=0)
        if nodes == 2:
            _hold_the_first_server_up(rd.stage_dir("extract") / "queue")
        _wait_run_end(rd, timeout=900)
        logs = {s: rd.log_path(s).read_text()[-3000:] for s in ("extract", "train")
                if rd.log_path(s).exists()}
        assert rd.read_state()["stages"]["train"]["status"] == "succeeded", logs
        runs[name] = rd
    two, one = runs["two-nodes"], runs["one-node"]
    # each node's sampler wrote its own file for the panel, and ended with its job
    from pipeline.cluster.node_telemetry import NodeWatch
    from pipeline.run import proctree
    assert sorted(r.host for r in NodeWatch(two.path).read()) == ["n0", "n1"]
    wait_for(lambda: not [p for p in proctree.live_pids() if "pipeline.cluster.node_telemetry"
                          in (cmd := proctree.cmdline(p)) and str(two.path) in cmd],
             timeout=60, what="the node samplers to end with their jobs")
    # each node's worker ran its own server: two hosts' names in the queue, both at work
    statuses = [json.loads(p.read_text())
                for p in (two.stage_dir("extract") / "queue" / "status").glob("*.json")]
    assert sorted(s["worker"].split("-")[0] for s in statuses) == ["n0", "n1"], statuses
    assert all(s["state"] == "done" and s["counters"][0] > 0 for s in statuses), statuses
    kv = [e for e in read_events(two.events_path("extract")) if e["type"] == "kv_cache"]
    assert {e["server"].split("-")[0] for e in kv} == {"n0", "n1"}, kv
    for node_logs in (two.stage_dir("extract") / "nodes").iterdir():
        assert "127.0.0.1" in next(node_logs.glob("vllm*.log")).read_text()
    # the same hidden states (each server batched other requests together: float noise)
    import torch
    from safetensors.torch import load_file
    rows = RowIds(two.out_dir("prepare") / "data")
    for i in range(len(rows)):
        a = load_file(str(hs_path(two.out_dir("extract") / "hidden_states", i)))
        b = load_file(str(hs_path(one.out_dir("extract") / "hidden_states", i)))
        assert torch.equal(a["token_ids"], b["token_ids"])
        torch.testing.assert_close(a["hidden_states"], b["hidden_states"], rtol=1e-4, atol=1e-5)
    log = two.log_path("train").read_text()
    assert "torchrun over 2 node(s) x 1 CPU ranks (gloo)" in log, log[-3000:]
    assert "torchrun over 1 node(s) x 2 CPU ranks (gloo)" in one.log_path("train").read_text()
    a, b = _train_losses(two), _train_losses(one)
    assert a and [s for s, _ in a] == [s for s, _ in b], (a, b)
    print(f"two nodes vs one: {len(rows)} hidden-state files, losses {a} vs {b}")
    torch.testing.assert_close([v for _, v in a], [v for _, v in b], rtol=1e-4, atol=1e-5)


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


def test_a_job_past_its_time_limit_is_resumed(cluster, time_limited):
    """--time=1 (a minute): Slurm stops the job; the stage reads as failed
    with the scheduler's TIMEOUT, and resume completes it."""
    d, rd = time_limited
    wait_for(lambda: rd.read_state()["stages"]["vocab"]["status"] not in ("pending", "running"),
             timeout=400, poll=1, what="vocab past its time limit")
    st = rd.read_state()["stages"]["vocab"]
    assert st["status"] == "failed"
    assert "timeout" in (st.get("reason") or "").lower() or \
        "TIME LIMIT" in rd.log_path("vocab").read_text(), st
    cli("resume", "--wait", cwd=d, timeout=300, check=0)
    assert rd.read_state()["stages"]["evaluate"]["status"] == "succeeded"


def _files(hs: Path) -> dict[str, tuple[int, int, int]]:
    """Each finished file of the folder: (inode, size, mtime): a file replaced
    or rewritten changes at least one."""
    return {p.name: (st.st_ino, st.st_size, st.st_mtime_ns)
            for p in hs.glob("hs_*.safetensors") for st in [p.stat()]}


def test_a_node_cut_off_mid_extract(cluster, tmp_path, cancelled_after):
    """Node n1's link goes down while it holds a chunk it has started (its
    processes keep running; its writes to the shared disk block, as on a hard
    NFS mount): after lost_after_s node n0 does n1's unfinished rows, the stage
    succeeds with every file written once, and when the link comes back the
    stale worker's blocked writes do not replace a finished file."""
    cluster.wait_idle(timeout=180)   # both nodes up (an earlier test may have cut one)
    from pipeline.extract.job import RowIds
    from pipeline.model.hsfile import hs_path, validate_file
    from pipeline.run.events import read_events
    write(tmp_path / "config.toml", merged(MULTI_NODE, {"data": {"max_samples": 80}}))
    cli("run", cwd=tmp_path, check=0)
    rd = RunDir(tmp_path / "runs" / "mn")
    hs = rd.out_dir("extract") / "hidden_states"
    queue = rd.stage_dir("extract") / "queue"
    node0 = wait_for(lambda: _node_worker_pids("0"), timeout=300, poll=0.005,
                     what="node 0's worker to start")
    try:
        for pid in node0:
            os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: (queue / "plan.json").exists() and _freeze_holding_a_chunk(queue, hs, "1"),
                 timeout=300, poll=0.005, what="node 1 frozen in a chunk it has started")
        cluster.cut("n1")
        cut_at = time.monotonic()
        for pid in _node_worker_pids("1"):
            os.kill(pid, signal.SIGCONT)     # running again, cut off
    finally:
        for pid in node0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    try:
        wait_for(lambda: any("stopped reporting" in e.get("message", "")
                             for e in read_events(rd.events_path("extract"))),
                 timeout=120, poll=0.1, what="n1's worker said lost")
        detected = time.monotonic() - cut_at
        wait_for(lambda: rd.read_state()["stages"]["extract"]["status"] != "running",
                 timeout=300, poll=0.2, what="extract to end")
        recovered = time.monotonic() - cut_at
        st = rd.read_state()["stages"]["extract"]
        log = rd.log_path("extract").read_text()
        assert st["status"] == "succeeded", (st, log[-3000:])
        before = _files(hs)
    finally:
        cluster.mend("n1")
    print(f"fault: n1 cut mid-extract: lost after {detected:.1f} s (lost_after_s 3), "
          f"extract succeeded {recovered:.1f} s after the cut")
    # the stale worker, its link back: its blocked writes go through, and it ends
    wait_for(lambda: not _node_worker_pids("1"), timeout=180, poll=0.5,
             what="n1's stale worker to end after its link came back")
    cli("cancel", cwd=tmp_path, timeout=120, check=0)
    after = _files(hs)
    # What the stale worker may leave: a temp file it was writing when Slurm
    # ended it (its node back, its job over); the next extract removes it.
    from pipeline.model.hsfile import SAFETENSORS_TEMP
    debris = [p.name for p in hs.iterdir() if not p.name.startswith("hs_")]
    assert all(n.endswith(".tmp") or SAFETENSORS_TEMP.fullmatch(n) for n in debris), debris
    assert after == before, {k: (before.get(k), after.get(k)) for k in set(before) | set(after)
                             if before.get(k) != after.get(k)}
    rows = RowIds(rd.out_dir("prepare") / "data")
    meta = json.loads((rd.out_dir("extract") / "meta.json").read_text())
    import torch
    bad = [i for i in range(len(rows)) if validate_file(
        hs_path(hs, i), rows[i], len(meta["layer_ids"]), meta["hidden_size"], torch.float32)]
    assert not bad and sorted(before) == sorted(hs_path(hs, i).name for i in range(len(rows)))


async def test_the_controller_cut_off_from_the_login_node(cluster, tmp_path, cancelled_after):
    """The login node's link to the cluster goes down while a stage runs as a
    job: `status` and the panel say that the controller does not answer (and
    that the stage is taken to be alive: nothing is failed for it), and both
    recover once it answers again; the stage runs on."""
    from app.panel import PanelApp
    from pipeline.telemetry import Telemetry
    from tests.helpers import select_stage, until
    slurm_config(tmp_path, {"extract": "sleep:120"})
    cli("run", cwd=tmp_path, check=0)
    rd = RunDir(tmp_path / "runs" / "t")
    wait_for(lambda: rd.read_state()["stages"]["extract"].get("pid"), timeout=120,
             what="extract running in its job")
    job = rd.read_state()["stages"]["extract"]["slurm_job"]
    app = PanelApp(rd, tmp_path / "config.toml", runs_dir=tmp_path / "runs",
                   telemetry=Telemetry(simulate=2))

    def detail() -> str:
        return str(app.query_one("#detail").render())
    try:
        async with app.run_test(size=(80, 24)) as pilot:
            await select_stage(app, pilot, "extract")
            cluster.cut("login")
            cut_at = time.monotonic()
            def timed_status():
                p = cli("status", cwd=tmp_path, timeout=120, check=0)
                return p, time.monotonic() - cut_at
            status = asyncio.get_running_loop().run_in_executor(None, timed_status)
            await until(pilot, lambda: "not answering" in detail(), timeout=90,
                        what="the panel saying the controller does not answer")
            panel_said = time.monotonic() - cut_at
            p, said = await status
            assert "Slurm controller not answering" in p.stdout, p.stdout
            assert "extract    running" in p.stdout, p.stdout
            cluster.mend("login")
            mended_at = time.monotonic()
            await until(pilot, lambda: "not answering" not in detail(), timeout=90,
                        what="the panel recovering")
            recovered = time.monotonic() - mended_at
    finally:
        cluster.mend("login")
    p = cli("status", cwd=tmp_path, timeout=120, check=0)
    assert f"Slurm job {job} running" in p.stdout and rd.read_state()["stages"]["extract"][
        "status"] == "running", p.stdout
    cli("cancel", cwd=tmp_path, timeout=120, check=0)
    print(f"fault: controller cut off from the login node: status said so in {said:.1f} s, "
          f"the panel in {panel_said:.1f} s; the panel recovered {recovered:.1f} s after the "
          "link came back")


def test_a_node_cut_off_mid_train_fails_in_bounded_time_and_resumes(cluster, tmp_path, cancelled_after):
    """Node n1's link goes down mid-training (torchrun over both nodes): the
    stage fails within the collective timeout, with Slurm's word for the node,
    not a silent hang; `resume` (n1 still cut off; min_nodes = 1) continues
    from the last checkpoint on the node that is up."""
    cluster.wait_idle(timeout=180)   # both nodes up (an earlier test may have cut one)
    _pipeline_config(tmp_path, "cut", 2, 1, "hf", {
        "stages": {"train": {"epochs": 3, "total_seq_len": 192}},
        "cluster": {"min_nodes": 1, "collective_timeout_s": 20}})
    cli("run", cwd=tmp_path, check=0)
    rd = RunDir(tmp_path / "runs" / "cut")
    ckpts = rd.out_dir("train") / "checkpoints"
    try:
        from pipeline.train.checkpoints import complete_checkpoint
        wait_for(lambda: complete_checkpoint(ckpts / "0") and rd.read_state()["stages"]["train"]
                 ["status"] == "running", timeout=600, poll=0.02, what="train's first checkpoint")
        cluster.cut("n1")
        cut_at = time.monotonic()
        # the panel's node view: n1's sampler writes no more, and Slurm says it is down
        from pipeline.cluster.node_telemetry import NodeWatch
        from widgets.gpu_table import GpuTable
        watch = NodeWatch(rd.path)
        lost = wait_for(lambda: [n for n in watch.read() if n.host == "n1" and n.lost],
                        timeout=120, poll=0.5, what="n1 shown as lost")[0]
        lost_after = time.monotonic() - cut_at
        assert GpuTable._node_state(SimpleNamespace(running={"train"}), lost)[0].startswith(
            "LOST") and ("down" in lost.lost or "not responding" in lost.lost), lost
        wait_for(lambda: rd.read_state()["stages"]["train"]["status"] != "running",
                 timeout=300, poll=0.5, what="train to fail after the cut")
        failed_after = time.monotonic() - cut_at
        st = rd.read_state()["stages"]["train"]
        log = rd.log_path("train").read_text()
        assert st["status"] == "failed", (st, log[-3000:])
        assert "node n1" in (st.get("reason") or "") + log, (st, log[-3000:])
        done_before = sorted(p.name for p in ckpts.iterdir() if complete_checkpoint(p))
        t = time.monotonic()
        p = cli("resume", "--wait", cwd=tmp_path, timeout=600, check=None)
        resumed_in = time.monotonic() - t
        st = rd.read_state()["stages"]["train"]
        log = rd.log_path("train").read_text()
        assert p.returncode == 0 and st["status"] == "succeeded", (p.stdout[-2000:], log[-4000:])
        second = log.split("attempt 2")[-1]
        assert "torchrun over 1 node(s) x 1 CPU ranks (gloo)" in second, log[-3000:]
        assert "Found checkpoint at" in second and "Resuming training on epoch" in second, \
            second[-3000:]
    finally:
        cluster.mend("n1")
    print(f"fault: n1 cut mid-train: the node view said LOST ({lost.lost}) {lost_after:.1f} s "
          f"after the cut; train failed {failed_after:.1f} s after the cut "
          f"(collective timeout 20 s, SlurmdTimeout 10 s); resumed on n0 from checkpoint(s) "
          f"{done_before} and finished in {resumed_in:.1f} s")
