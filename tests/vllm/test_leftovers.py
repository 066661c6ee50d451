"""Nothing outlives its stage: what an attempt started is found by its
supervisor's session even where vLLM's process titles erased the token
from /proc/PID/environ, and nothing else is (pipeline.run.leftovers).

The vllm tier's part of tests/unit/test_leftovers.py."""

import os
import signal
import time

import pytest

from pipeline.run import leftovers
from pipeline.run.rundir import RunDir
from tests.helpers import cli, wait_for
from tests.unit.test_leftovers import alive


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


def test_no_vllm_process_outlives_a_killed_stage(tmp_path):
    """Both ways a stage dies without stopping its server: its group
    SIGKILLed (the supervisor sweeps), and supervisor and stage SIGKILLed
    together (the next launcher's sweep: here the run's own driver, which
    reconciles while it waits, and a reconcile of ours)."""
    from pipeline.run.reconcile import reconcile
    from pipeline.vllm.environment import probe
    from tests.vllm.test_vllm_real import PY
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
