"""`eagle-panel watch URL` as a user runs it, against a LABELLED STAND-IN
/metrics (tests/fakes/metrics_standin.py) for what a real vLLM cannot show
on cue: a restart between two reads, a read that fails mid-watch, a server
that is not vLLM, one without speculative decoding, one that wants a key.
The figures against a real vLLM's counters: tests/vllm/test_vllm_pipeline.py."""

import json
import os
import select
import signal
import subprocess
import sys

from tests.fakes.metrics_standin import MetricsStandIn
from tests.helpers import ROOT, cli
from tests.unit.test_watch import metrics_text

BEFORE = metrics_text(1000, 2000, [900, 700, 400], 3500)
AFTER_RESTART = metrics_text(20, 30, [15, 10, 5], 60)


def test_once_json_counts_a_restart_from_the_restart(tmp_path):
    with MetricsStandIn([BEFORE, AFTER_RESTART], model="tiny") as s:
        p = cli("watch", s.url, "--once", "--json", "--interval", "0.5", cwd=tmp_path, check=0)
    out = json.loads(p.stdout)
    assert out["model"] == "tiny" and out["window"]["restarted"], out
    assert out["window"]["drafts"] == 20 and out["window"]["acceptance_length"] == 2.5
    assert out["since_start"]["drafts"] == 20 and out["measured"] is None


def test_a_key_from_the_environment_and_the_refusals(tmp_path):
    with MetricsStandIn([BEFORE], key="s3cret") as s:
        p = cli("watch", s.url, "--once", cwd=tmp_path, check=1)
        assert "HTTP 401" in p.stderr and "--api-key-env VAR" in p.stderr
        env = dict(os.environ, VLLM_KEY="s3cret")
        p = cli("watch", s.url, "--once", "--interval", "0.5", "--api-key-env", "VLLM_KEY",
                cwd=tmp_path, check=0, env=env)
        assert "since the server started: acceptance length 3.00 over 1,000 drafts" in p.stdout
        assert "acceptance length - (no draft verified in this interval)" in p.stdout
    with MetricsStandIn(["# HELP go_goroutines x\ngo_goroutines 12\n"]) as s:
        p = cli("watch", s.url, "--once", cwd=tmp_path, check=2)
        assert "is this a vLLM server?" in p.stderr
    with MetricsStandIn(['vllm:num_requests_running{engine="0"} 1\n']) as s:
        p = cli("watch", s.url, "--once", "--interval", "0.5", cwd=tmp_path, check=0)
        assert "no speculative decoding on this server" in p.stdout
    p = cli("watch", "http://127.0.0.1:1", "--draft", tmp_path, cwd=tmp_path, check=2)
    assert f"{tmp_path / 'measured.json'} is missing" in p.stderr and "export again" in p.stderr
    p = cli("watch", "http://127.0.0.1:1", "--run", "nope", cwd=tmp_path, check=2)
    assert "nope" in p.stderr
    p = cli("watch", "http://127.0.0.1:1", "--log", tmp_path / "no-such-dir" / "d.jsonl",
            cwd=tmp_path, check=2)
    assert "--log" in p.stderr and "No such file or directory" in p.stderr
    assert not (tmp_path / "no-such-dir").exists()
    p = cli("watch", "localhost:8000", cwd=tmp_path, check=2)
    assert "watch reads an http(s) URL" in p.stderr
    p = cli("watch", "http://127.0.0.1:1/v1/chat", cwd=tmp_path, check=2)
    assert "without a path" in p.stderr


def line_of(pipe, timeout: float = 120.0) -> str:
    """The next line the watch prints ("" when none comes: a failure, not a hang)."""
    ready, _, _ = select.select([pipe], [], [], timeout)
    return pipe.readline() if ready else ""


def test_a_failed_read_mid_watch_keeps_the_last_figures_and_goes_on(tmp_path):
    """Lines until Ctrl-C: a read that fails is said on stderr (the last
    figures stand), the next answer is a line again, SIGINT ends it with 0."""
    later = metrics_text(1050, 2090, [945, 730, 415], 3650)
    with MetricsStandIn([BEFORE, None, later]) as s:
        proc = subprocess.Popen([sys.executable, "-m", "app.cli", "watch", s.url, "--interval",
                                 "0.5", "--json"], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            said = line_of(proc.stderr)
            assert said.startswith("no answer since ") and "HTTP 503" in said, said
            line = json.loads(line_of(proc.stdout))   # the read after the failed one
            assert line["window"]["drafts"] == 50 and not line["window"]["restarted"], line
        finally:
            proc.send_signal(signal.SIGINT)
            rc = proc.wait(timeout=60)
    assert rc == 0
