"""The train stage through speculators 0.8.1, the release before the one
scripts/install.sh installs, in an environment of its own
(`.venv-speculators-0.8.1`, which `scripts/install.sh --dev` makes: 0.8.1 pins
transformers<5.17) named by `[runtime] python`, as a user's ML environment is.

Its source has every name the contract declares (tests/unit/
test_speculators_contract.py), and reading it once said "ready"; running it
found what a read of names cannot: its `Trainer.train_epoch` takes no
`step_callback`, so train failed at its first epoch. The contract now
declares that parameter, the trainer adapts (trainer.CheckedLoader), and
this test asks 0.8.1 itself: doctor names the adaptation, the run trains,
a cancel between steps saves where it stopped, and the resume goes on from
the next step to a checkpoint 0.8.1 wrote."""

import json
from pathlib import Path

import pytest

from pipeline.run.events import read_events
from pipeline.run.rundir import RunDir
from tests.configs import merged, tiny_pipeline, write
from tests.helpers import ROOT, cli, wait_for
from tests.integration.test_pipeline_e2e import train_attempts

SPECULATORS_081 = ROOT / ".venv-speculators-0.8.1" / "bin" / "python"


def test_speculators_081_trains_stops_between_steps_and_resumes(tmp_path):
    if not SPECULATORS_081.exists():
        pytest.skip(f"no speculators 0.8.1 environment: {SPECULATORS_081.parent.parent} is "
                    "missing (scripts/install.sh --dev makes it)")
    # ~200 steps (8 epochs x ~26 at total_seq_len 256): the cancel comes after the
    # first 5 of them, with the rest still ahead of it however fast the machine is
    write(tmp_path / "config.toml", merged(tiny_pipeline("s081", 48), {
        "run": {"runs_dir": "runs"}, "runtime": {"python": str(SPECULATORS_081)},
        "stages": {"extract": {"backend": "hf"}, "train": {"epochs": 8, "total_seq_len": 256},
                   "evaluate": {"enabled": False}}}))
    doc = cli("doctor", cwd=tmp_path, timeout=300)
    assert doc.returncode == 0, doc.stdout + doc.stderr
    assert "speculators 0.8.1 has all" in doc.stdout and "adapted: Trainer.train_epoch takes " \
        "no step_callback" in doc.stdout, doc.stdout

    rd = RunDir(tmp_path / "runs" / "s081")
    cli("run", cwd=tmp_path, check=0)
    wait_for(lambda: rd.events_path("train").exists() and len(
        a := train_attempts(rd)) == 1 and len(a[0]) >= 5,
        timeout=600, what="training with speculators 0.8.1 to make 5 steps")
    assert rd.read_state()["stages"]["train"]["status"] == "running", "train ended first"
    p = cli("cancel", cwd=tmp_path, check=0)
    assert "sent SIGINT)" in p.stdout, p.stdout
    after = rd.read_state()["stages"]["train"]
    assert after["status"] == "cancelled" and after["exit_code"] == 130, after

    p = cli("resume", "--wait", cwd=tmp_path, timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr
    first, second = train_attempts(rd)
    # stopped between steps and saved there: the resume goes on from the next step
    assert second[0]["step"] == first[-1]["step"] + 1, (first[-1], second[0])
    assert second[-1]["values"]["loss"] < first[0]["values"]["loss"]
    done = [e for e in read_events(rd.events_path("train")) if e["type"] == "stage_finished"]
    assert [e["status"] for e in done] == ["cancelled", "succeeded"], done
    ckpt = Path(done[-1]["summary"]["checkpoint"])
    assert json.loads((ckpt / "config.json").read_text())["speculators_version"] == "0.8.1"
