"""Nothing outlives its stage: what an attempt started is found by its
supervisor's session even where vLLM's process titles erased the token
from /proc/PID/environ, and nothing else is (pipeline.run.leftovers).

The unit tests build a real session (a leader like a supervisor, children
with an erased, a token-carrying and an unrelated environment) and SIGKILL
its leader; the real-vLLM test SIGKILLs a stage's process group, and then a
supervisor with its stage, while the stage's real `vllm serve` is up, and
asserts no VLLM:: process of that attempt is left.

The parts in other tiers: tests/vllm/test_leftovers.py."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from pipeline.run import leftovers
from pipeline.run.proctree import TOKEN_VAR
from tests.helpers import wait_for

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


