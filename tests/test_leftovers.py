"""Nothing outlives its stage: what an attempt started is found by its
supervisor's session even where vLLM's process titles erased the token
from /proc/PID/environ, and nothing else is (pipeline.run.leftovers).

The unit tests build a real session (a leader like a supervisor, children
with an erased, a token-carrying and an unrelated environment) and SIGKILL
its leader; the real-vLLM test SIGKILLs a stage's process group, and then a
supervisor with its stage, while the stage's real `vllm serve` is up, and
asserts no VLLM:: process of that attempt is left."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from pipeline.run import leftovers
from pipeline.run.proctree import TOKEN_VAR
from pipeline.run.rundir import RunDir
from tests.helpers import cli, wait_for

TOKEN = "r/extract/1/abcd"


def alive(pid: int) -> bool:
    return leftovers.start_ticks(pid) is not None   # (a zombie is not)
SERVER = "EAGLE_PANEL_SERVER_TOKEN"   # (pipeline.vllm.server's: it starts with the attempt's)
LEADER = textwrap.dedent(f"""
    import json, subprocess, sys, time
    kids = [subprocess.Popen(["sleep", "300"], env=env) for env in
            ({{}}, {{"{TOKEN_VAR}": "{TOKEN}"}}, {{"OTHER": "1"}},
             {{"{SERVER}": "{TOKEN}/server0/ff"}}, {{"{SERVER}": "r/extract/2/beef/server0/ff"}})]
    print(json.dumps([k.pid for k in kids]), flush=True)
    time.sleep(300)
""")


@pytest.fixture
def session():
    """(leader Popen, its start ticks, [erased, token, unrelated, server token only,
    another attempt's server] child pids)."""
    leader = subprocess.Popen([sys.executable, "-c", LEADER], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    kids = json.loads(leader.stdout.readline())
    ticks = leftovers.start_ticks(leader.pid)
    # exec has closed Popen's pipe before the kernel has laid out the new
    # environment: on a busy machine /proc/PID/environ still reads empty then
    # (the unrelated child looked "erased" once, in a fresh clone's full suite)
    from pipeline.run.proctree import environ
    try:   # (the children go however the test ends, a failed setup too)
        wait_for(lambda: b"OTHER=1" in environ(kids[2]) and
                 f"{TOKEN_VAR}={TOKEN}".encode() in environ(kids[1]) and
                 f"{SERVER}={TOKEN}/server0/ff".encode() in environ(kids[3]) and
                 f"{SERVER}=r/extract/2/beef/server0/ff".encode() in environ(kids[4]),
                 timeout=30, what="the children's environments")
        yield leader, ticks, kids
    finally:
        for pid in [leader.pid, *kids]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        leader.wait()


def test_a_dead_supervisors_session_is_found_by_identity_not_by_name(session):
    """Found: an erased environment, the attempt's token, and a server's token
    alone (a rename that left only the last variables readable: a killed
    extract's vLLM EngineCore, issue 53); not found: another attempt's server,
    an unrelated process."""
    leader, ticks, (erased, carries, unrelated, server, other) = session
    assert leftovers.env_erased(erased) and not leftovers.env_erased(unrelated)
    # the leader alive with another start time: its session is not ours
    assert leftovers.session_processes(leader.pid, ticks - 1, TOKEN) == []
    assert leftovers.session_processes(leader.pid, None, TOKEN) == []   # unverifiable
    os.kill(leader.pid, signal.SIGKILL)
    leader.wait()
    st = {"token": TOKEN, "supervisor_pid": leader.pid, "supervisor_create_time": ticks}
    assert leftovers.attempt_processes(st) == sorted([erased, carries, server])
    found = leftovers.survivors({"stages": {"extract": {**st, "status": "failed"}}})
    assert sorted(s["pid"] for s in found) == sorted([erased, carries, server])
    said = leftovers.survivor_lines({"stages": {"extract": {**st, "status": "failed"}}})
    assert f"extract pid {erased}" in said[0] and f"kill {min(erased, carries)}" in said[1]
    # a stage still running keeps its processes; a Slurm one is the scheduler's
    assert leftovers.survivors({"stages": {"extract": {**st, "status": "running"}}}) == []
    assert leftovers.survivors({"stages": {"x": {**st, "status": "failed",
                                                 "slurm_job": "7"}}}) == []
    assert leftovers.stop_attempt(st, term_grace=2, kill_grace=2) == []
    assert not alive(erased) and not alive(carries) and not alive(server)
    assert alive(unrelated) and alive(other)   # in the session, not the attempt's: untouched


# -- the real thing ---------------------------------------------------------

def hold_config(tmp_path):
    """Fake stages but extract, which starts a real server and holds
    (tests.fakes.serve_and_hold): the kill comes at a point the test controls."""
    from tests.helpers import stagekit_config
    return stagekit_config(tmp_path, name="leak", extra={"stages": {
        "regenerate": {"enabled": False},
        "extract": {"entry": "tests.fakes.serve_and_hold"}}})


def attempt_vllm(st: dict) -> list[int]:
    """The VLLM:: processes in the attempt's supervisor session."""
    return [p for p in leftovers.vllm_processes()
            if leftovers.session_of(p) == st["supervisor_pid"]]


def extract_with_its_server_up(tmp_path) -> tuple[RunDir, dict]:
    rd = RunDir(tmp_path / "runs" / "leak")
    ready = rd.stage_dir("extract") / "server-ready"
    ready.unlink(missing_ok=True)
    cli("run", "--stage", "extract", cwd=tmp_path, check=0)
    wait_for(ready.exists, timeout=400, poll=0.5, what="the real server answering")
    st = rd.read_state()["stages"]["extract"]
    assert st["status"] == "running" and st["pgid"] and st["supervisor_create_time"]
    assert attempt_vllm(st), "no VLLM:: process in the supervisor's session"
    return rd, st


@pytest.mark.vllm
@pytest.mark.integration
def test_no_vllm_process_outlives_a_killed_stage(tmp_path):
    """Both ways a stage dies without stopping its server: its group
    SIGKILLed (the supervisor sweeps), and supervisor and stage SIGKILLed
    together (the next launcher's sweep: here the run's own driver, which
    reconciles while it waits, and a reconcile of ours)."""
    from pipeline.run.reconcile import reconcile
    from pipeline.vllm.environment import probe
    from tests.test_vllm_real import PY
    if not PY.exists() or probe(str(PY)).unusable([]):
        pytest.skip("no usable real vLLM (scripts/install.sh makes .venv-vllm)")
    hold_config(tmp_path)
    cli("run", "--wait", "--stage", "prepare", cwd=tmp_path, check=0, timeout=300)
    rd, st = extract_with_its_server_up(tmp_path)
    named = attempt_vllm(st)
    # Found by session, not by token: setproctitle overwrites the environ block only when
    # the new title is longer than argv (it was on a short checkout path, it was not under
    # CI's /check/work/main), so no test can count on either. Their cwd (the run directory,
    # what bench/chaos.py counts them by) is theirs either way.
    assert set(named) <= set(leftovers.vllm_processes(under=rd.path.resolve()))
    os.killpg(st["pgid"], signal.SIGKILL)
    wait_for(lambda: rd.read_state()["stages"]["extract"]["status"] != "running",
             timeout=120, what="the supervisor recording the kill")
    # the supervisor swept before it recorded the end: nothing to wait for
    assert not attempt_vllm(st) and not [p for p in named if alive(p)]

    rd, st = extract_with_its_server_up(tmp_path)
    named = attempt_vllm(st)
    os.kill(st["supervisor_pid"], signal.SIGKILL)
    os.killpg(st["pgid"], signal.SIGKILL)
    time.sleep(1.0)
    reconcile(rd)
    # (the sweep's SIGTERM lets the API server shut down: its grace, then SIGKILL)
    wait_for(lambda: not leftovers.survivors(rd.read_state()), timeout=60,
             what="the orphaned server stopped by the next launcher's sweep")
    assert not [p for p in named if alive(p)]
    assert not leftovers.vllm_processes(under=rd.path.resolve())
