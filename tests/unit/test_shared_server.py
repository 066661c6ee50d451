"""Regenerate and extract on one vLLM server ([stages.regenerate] share_server;
pipeline.extract.shared_server): when the driver starts it, what stops it
(extract's end, the driver's end however it ends), what the stages send
it; and through the real vLLM of this machine, the same answers and the same
hidden states as two servers, with one target load instead of two.

The parts in other tiers: tests/vllm/test_shared_server.py."""

import os
import subprocess
import sys
import textwrap

import pytest

from pipeline.config import load as load_config
from pipeline.extract import shared_server
from pipeline.run.rundir import proc_start_ticks
from tests.configs import merged, write
from tests.helpers import ROOT, wait_for


def config(tmp_path, extra: dict | None = None):
    """Regenerate sharing its server, and `extra` (default: extract's backend auto)."""
    shared = {"stages": {"regenerate": {"enabled": True, "share_server": True}}}
    write(tmp_path / "config.toml",
          merged(shared, extra or {"stages": {"extract": {"backend": "auto"}}}))
    return load_config(tmp_path / "config.toml")


def test_what_shares_and_what_does_not(tmp_path):
    hf = {"stages": {"extract": {"backend": "hf"}}}
    assert shared_server.why_not(config(tmp_path)) is None
    assert shared_server.why_not(config(tmp_path, hf)) == "extract's backend is 'hf'"
    assert shared_server.why_not(config(tmp_path, {"pipeline": {"mode": "online"}})) == \
        "extract is off"
    assert "server_args" in shared_server.why_not(config(tmp_path, {"stages": {"extract": {
        "backend": "auto", "server_args": ["--max-num-seqs", "4"]}}}))
    assert "env differ" in shared_server.why_not(config(tmp_path, {"stages": {"extract": {
        "backend": "auto", "env": {"HF_HOME": "/x"}}}}))
    write(tmp_path / "config.toml", {"stages": {"regenerate": {"enabled": True}}})
    off = load_config(tmp_path / "config.toml")
    assert shared_server.why_not(off) == "[stages.regenerate] share_server = false"
    # how, not what: no part of regenerate's fingerprint (toggling it reruns nothing)
    assert off.fingerprint("regenerate", {}) == config(tmp_path, hf).fingerprint("regenerate", {})


def test_a_shared_server_a_stage_cannot_use_is_an_error_on_gpus(tmp_path):
    """On the CPU a stage that declines the shared server starts its own (said);
    on GPUs that would load the target a second time on the same GPUs: an
    error with the fix. A damaged record is an error naming it."""
    from types import SimpleNamespace

    from pipeline.stage_error import StageError
    alive = SimpleNamespace(died=lambda: None, flags=["--a"], max_model_len=100)
    cpu, gpus = SimpleNamespace(**vars(alive), devices=[]), SimpleNamespace(**vars(alive),
                                                                             devices=[0, 1])
    assert "flags differ" in shared_server.check_adoptable(cpu, ["--b"])
    assert shared_server.check_adoptable(cpu, ["--a"], 100) is None
    with pytest.raises(StageError, match="load the target again on the same GPUs") as e:
        shared_server.check_adoptable(gpus, ["--a"], 200)
    assert "share_server = false" in e.value.hint
    (tmp_path / "endpoint.json").write_text("{not json")
    os.environ[shared_server.ENV] = str(tmp_path / "endpoint.json")
    try:
        with pytest.raises(StageError, match="record .* is unreadable"):
            shared_server.adopt("x")
    finally:
        del os.environ[shared_server.ENV]


def test_doctor_counts_one_load_for_both(tmp_path):
    from pipeline import doctor
    from tests.fakes import vllm_releases
    for share, says in ((True, ("3 target loads: ", "regenerate + extract (one server: "
                                                    "share_server) 1")),
                        (False, ("4 target loads: ", "regenerate 1", "; extract 1"))):
        write(tmp_path / "config.toml", {"stages": {
            "regenerate": {"enabled": True, "share_server": share},
            "extract": {"backend": "vllm-server"}}})
        x = doctor.Inputs(load_config(tmp_path / "config.toml"), env={},
                          vllm=None, gpus=None, source=vllm_releases.source("0.32.0"),
                          backend="vllm-server")
        (f,) = doctor.check_target_loads(x)
        assert f.message.startswith(says[0]) and all(p in f.message for p in says), f.message


def test_a_server_the_driver_owns_dies_with_the_driver(tmp_path):
    """PR_SET_PDEATHSIG: a SIGKILLed driver takes its shared server along
    (here a stand-in command in VllmServer's own way of starting one), and
    a server that outlived it anyway is the next launch's to stop: the
    record names the driver as its supervisor."""
    from pipeline.run.leftovers import stop_survivors, survivors
    out = tmp_path / "server.pid"
    script = textwrap.dedent(f"""\
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from pathlib import Path
        from pipeline.vllm.server import VllmServer
        s = VllmServer(0, ["sleep", "600"], 1, "k", [], Path({str(tmp_path / 'log')!r}), {{}},
                       die_with_parent=True)
        s.start()
        Path({str(out)!r}).write_text(str(s.proc.pid))
        time.sleep(600)
        """)
    driver = subprocess.Popen([sys.executable, "-c", script])
    pid = int(wait_for(lambda: out.exists() and out.read_text(), timeout=30,
                       what="the stand-in server started"))
    driver.kill()
    driver.wait()
    wait_for(lambda: proc_start_ticks(pid) is None, timeout=10,
             what="the server ended with its driver")
    # the record: an ended driver's server is a survivor, found by its token
    token = "t/shared-server/abcd"
    stray = subprocess.Popen(["sleep", "600"], env={**os.environ, "EAGLE_PANEL_TOKEN": token})
    try:
        state = {"stages": {}, "shared_server": {
            "token": token, "status": "running", "supervisor_pid": driver.pid,
            "supervisor_create_time": 1}}
        found = survivors(state, alive=lambda st: False)
        assert [s["stage"] for s in found] == ["shared server"], found
        stop_survivors(state, alive=lambda st: False)
        stray.wait(timeout=10)
    finally:
        if stray.poll() is None:
            stray.kill()


# ---- through the real vLLM ---------------------------------------------------------------


