"""The read model of a long run: bounded metric series that keep their spikes,
and the checkpoint a reader starts from instead of replaying every event
(pipeline.run.series, stage_fold, read_checkpoint).

The integration tier's part of tests/unit/test_read_model.py."""

from __future__ import annotations

import json

from pipeline.run import read_checkpoint
from pipeline.run.rundir import RunDir
from tests.helpers import cli


def test_a_stage_run_by_its_supervisor_leaves_a_checkpoint_of_all_its_events(tmp_path, stagekit):
    stagekit({"train": "events:20000"})
    cli("run", "--wait", cwd=tmp_path, check=0)
    rd = RunDir(tmp_path / "runs" / "t")
    body = json.loads(read_checkpoint.path_of(rd, "train").read_text())
    assert body["offset"] == rd.events_path("train").stat().st_size   # up to stage_finished
    with_ck = json.loads(cli("status", "--json", cwd=tmp_path, check=0).stdout)
    read_checkpoint.path_of(rd, "train").unlink()
    without = json.loads(cli("status", "--json", cwd=tmp_path, check=0).stdout)
    assert with_ck == without and with_ck["stages"][4]["status"] == "succeeded"
