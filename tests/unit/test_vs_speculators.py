"""bench/vs_speculators.py's arithmetic on recorded run folders, the branches a
default-size run takes that its smallest size in the bench tier may not (issue
56): ours' draft is the checkpoint evaluate measured, not the last epoch's (a
plateau stop chose an earlier one), and the steps-matched rerun matches steps
per epoch, or says why it cannot within config's rules."""

import importlib.util
import json

import pytest

from tests.helpers import ROOT


@pytest.fixture(scope="module")
def vs():
    spec = importlib.util.spec_from_file_location("vs_speculators",
                                                  ROOT / "bench" / "vs_speculators.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_folder(tmp_path, chosen: str | None):
    """A run whose train saved epochs 0-10 and whose evaluate measured `chosen`."""
    rd = tmp_path / "run"
    for epoch in range(11):
        (rd / "train/out/checkpoints" / str(epoch)).mkdir(parents=True)
    (rd / "evaluate").mkdir(parents=True)
    summary = {"acceptance_length": 3.2}
    if chosen is not None:
        summary["checkpoint_path"] = str(rd / "train/out/checkpoints" / chosen)
    (rd / "evaluate/events.jsonl").write_text(
        json.dumps({"type": "progress"}) + "\n" +
        json.dumps({"type": "stage_finished", "summary": summary}) + "\n")
    return rd


def test_ours_is_the_checkpoint_evaluate_measured(vs, tmp_path):
    assert vs.measured_checkpoint(run_folder(tmp_path, "8")).name == "8"   # plateau: not 10
    assert vs.measured_checkpoint(run_folder(tmp_path / "old", None)).name == "10"


def test_steps_matched_per_epoch_or_why_not(vs):
    # the case the issue met: ours stopped at 11 epochs (1554 steps), theirs trained
    # 14 (4105): per run it asked for total_seq_len 97; per epoch it is 216 at 448
    ours = {"optimizer_steps": 1554, "epochs": 11, "total_seq_len": 448}
    theirs = {"optimizer_steps": 4105, "epochs": 14}
    seq, why = vs.matched_total_seq_len(ours, theirs, seq_length=192)
    assert seq == round(448 * (1554 / 11) / (4105 / 14)) == 216 and why == ""
    seq, why = vs.matched_total_seq_len(ours, theirs, seq_length=256)
    assert seq is None and "needs total_seq_len 216, below seq_length 256" in why
    assert vs.matched_total_seq_len({**ours, "epochs": None}, theirs, 192)[0] is None
    # the measured checkpoint (epoch 8 of 11 trained): its steps over its 9 epochs
    at8 = {"optimizer_steps": 1272, "epochs": 11, "epochs_measured": 9, "total_seq_len": 448}
    assert vs.matched_total_seq_len(at8, theirs, 192)[0] == round(448 * (1272 / 9) / (4105 / 14))


def test_theirs_best_is_the_epoch_speculators_marks(vs, tmp_path):
    """Theirs is compared at its last epoch and at `checkpoint_best` (a link
    speculators' checkpointer points at its lowest validation loss): read as
    the epoch folder it names, or None where it marked none."""
    save = tmp_path / "ckpt"
    for epoch in range(14):
        (save / str(epoch)).mkdir(parents=True)
    assert vs.best_checkpoint(save) is None
    (save / "checkpoint_best").symlink_to("9")
    assert vs.best_checkpoint(save) == save / "9"      # named as last_checkpoint names it
    assert vs.last_checkpoint(save).name == "13"
