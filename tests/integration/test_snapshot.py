"""pipeline.run.snapshot: the one read model under `status`, `status --json`,
`run --wait` and the panel. Every attempt's time is counted, each server keeps
its own KV-cache report, and `status --json` has the outcome the text prints.

The integration tier's part of tests/unit/test_snapshot.py."""

from __future__ import annotations

import json
import time

from pipeline.run.rundir import RunDir
from tests.helpers import cli, wait_for


def test_status_counts_every_attempt_and_json_has_the_outcome(tmp_path, stagekit):
    """train cancelled 2 s into its first attempt, then resumed: its time in
    `status --json` is both attempts', each listed; the outcome is there."""
    stagekit({"train": "sleep_once:30"})
    cli("run", cwd=tmp_path, check=0)
    rd = RunDir(tmp_path / "runs/t")
    wait_for(lambda: rd.events_path("train").exists() and "stage_started" in
             rd.events_path("train").read_text(), timeout=60, what="train to start")
    time.sleep(2.0)
    cli("cancel", "t", cwd=tmp_path, check=0)
    cli("resume", "t", "--wait", cwd=tmp_path, check=0, timeout=120)
    out = json.loads(cli("status", "t", "--json", cwd=tmp_path, check=0).stdout)
    train = next(r for r in out["stages"] if r["stage"] == "train")
    first, second = train["attempts"]
    assert first["status"] == "cancelled" and first["duration_s"] >= 2.0
    assert second["status"] == "succeeded" and train["attempt"] == 2
    assert train["duration_s"] >= first["duration_s"] + second["duration_s"] - 0.5
    assert set(out["outcome"]) >= {"draft", "acceptance_length", "acceptance_estimate",
                                   "speedup"}
    text = cli("status", "t", cwd=tmp_path, check=0).stdout
    line = next(ln for ln in text.splitlines() if ln.startswith("train "))
    assert "succeeded" in line and " 2 " in line
