"""The panel in a real terminal (tmux), used as a person would: start the
pipeline, cancel a stage, resume, see it succeed."""

import os
import shutil
import subprocess
import sys
import time

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


def tmux(*args):
    return subprocess.run(["tmux", *args], capture_output=True, text=True, check=False)


def screen(session):
    return tmux("capture-pane", "-p", "-t", session).stdout


def wait_screen(session, pred, timeout=40, what=""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = screen(session)
        if pred(s):
            return s
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}; screen:\n{screen(session)}")


def row(s, stage):
    return next((line for line in s.splitlines() if line.strip().startswith(stage + " ")), "")


def test_start_cancel_resume_in_tmux(tmp_path, stagekit):
    stagekit({"extract": "sleep_once:60"})
    session = f"eagle-test-{os.getpid()}"
    cmd = (f"cd {tmp_path} && PYTHONPATH={ROOT} TERM=xterm-256color "
           f"{sys.executable} -m app.cli ui --simulate-gpus 2")
    tmux("new-session", "-d", "-s", session, "-x", "80", "-y", "24", cmd)
    try:
        wait_screen(session, lambda s: "Press r to start one" in s, what="the empty panel")
        tmux("send-keys", "-t", session, "r")
        s = wait_screen(session, lambda s: "running" in row(s, "extract"), what="extract running")
        assert "succeeded" in row(s, "prepare")
        tmux("send-keys", "-t", session, "c")
        wait_screen(session, lambda s: "Cancel the pipeline" in s, what="the confirmation")
        tmux("send-keys", "-t", session, "y")
        s = wait_screen(session, lambda s: "cancelled" in row(s, "extract"), what="cancelled")
        assert "pending" in row(s, "vocab")
        tmux("send-keys", "-t", session, "r")
        s = wait_screen(session, lambda s: "succeeded" in row(s, "train"), what="resumed run")
        assert "2" in row(s, "extract").split()  # the second attempt
        # The screen is what a person reads: the keys are in the footer.
        assert "Run/resume" in s and "Cancel" in s
        tmux("send-keys", "-t", session, "q")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and tmux("has-session", "-t", session).returncode == 0:
            time.sleep(0.2)
        assert tmux("has-session", "-t", session).returncode != 0  # q quit the panel
    finally:
        tmux("kill-session", "-t", session)
