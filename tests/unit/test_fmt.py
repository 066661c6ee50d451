"""Stage summaries as a person reads them (pipeline.fmt.summary_text), in the
panel's detail line and `run --wait`."""

from tests.helpers import outcome_words as outcome
from tests.helpers import summary_words as text


def test_summaries_read_like_sentences():
    assert text("evaluate", {
        "acceptance_length": 3.02135231316726, "acceptance_estimate": 2.9978991596638656,
        "speedup": 0.958, "prompts": 48}) == \
        "acceptance 3.02 measured, 3.00 estimated · speedup 0.96x · 48 prompts"
    # (a summary from before version 2: prepare's row count was `skipped`)
    assert text("prepare", {"rows_in": 830, "samples": 829, "skipped": 1,
                            "tokens": 46938, "supervised_tokens": 20298}) == \
        "829 rows from 830 (1 skipped) · 46,938 tokens, 20,298 supervised"
    assert text("evaluate", {"skipped": "vLLM is not installed"}) == \
        "skipped: vLLM is not installed"
    assert text("train", {"checkpoint": "/r/train/out/checkpoints/5", "val_loss": 1.2345,
                          "acceptance_length": 2.99, "draft_layer": "mla"}) == \
        "validation loss 1.234 · acceptance 2.99 estimated · mla draft · checkpoint 5"
    for algo, layer, says in (("eagle3.1", "mla", "eagle3.1 mla draft"),
                              ("peagle", "own", "peagle draft")):   # the algorithm named
        assert text("train", {
            "checkpoint": "/c/0", "algorithm": algo, "draft_layer": layer}) == f"{says} · checkpoint 0"
    # a stage it does not know: its figures, rounded
    assert text("other", {"a": 1.23456, "b": 123456, "c": "text"}) == "a 1.23 · b 123,456"
    # a stage that wrote no summary: the supervisor's exit code
    assert text("train", {"exit_code": 1, "signal": None}) == "exit_code 1"


def test_progress_has_its_unit_and_no_eta_once_done_or_stopped():
    from pipeline.fmt import progress_text
    ev = {"done": 340, "total": 510, "unit": "steps", "rate": 1.58, "eta_s": 107.0}
    assert progress_text(ev) == "340/510 steps  1.6 steps/s  ETA 1m47s"
    assert progress_text(ev, running=False) == "340/510 steps"
    done = {"done": 2, "total": 2, "unit": "prompts", "rate": 0.04, "eta_s": 0.0}
    assert progress_text(done) == "2/2 prompts  25s per prompt"   # no "ETA 0.0s", no "0.0/s"
    slow = {"done": 1, "total": 3, "unit": "measurements", "rate": 1 / 80, "eta_s": 160.0}
    assert progress_text(slow) == "1/3 measurements  1m20s per measurement  ETA 2m40s"
    assert progress_text({"done": 7, "rate": 2.0}) == "7  2.0 items/s"
    assert progress_text(None) == "-"


def test_a_cancelled_training_says_where_it_resumes():
    s = {"stopped": "on request; resume continues from here", "checkpoint_step": 317,
         "resume_checkpoint": "/runs/r/train/out/checkpoints/1", "resume": "eagle-panel resume"}
    assert text("train", s) == ("stopped at step 317 · checkpoint 1 · "
                                "resume: r (eagle-panel resume)")
    assert "no checkpoint yet" in text("train", {**s, "resume_checkpoint": None})
    # a cancelled training names no trained draft in the outcome
    assert not any("trained draft" in ln for ln in outcome(s, {}, {}))


def test_epochs_are_counted_from_one_as_everywhere_else():
    from pipeline.fmt import epoch_text
    assert epoch_text(0, 4) == "epoch 1/4"     # speculators' epoch 0 of 4 planned
    assert epoch_text(1, None) == "epoch 2" and epoch_text(None, 4) == ""


def test_the_stage_tables_rate_never_reads_zero_per_second():
    from pipeline.run.rundir import Status
    from widgets.stage_table import StageTable
    slow = {"done": 1, "total": 3, "unit": "measurements", "rate": 1 / 80, "eta_s": 160.0}
    assert StageTable._rate(slow, Status.RUNNING) == "1m20s each ETA 2m40s"
    assert StageTable._rate({**slow, "rate": 1.58}, Status.RUNNING) == "1.6/s ETA 2m40s"


def test_a_finished_run_says_where_its_trackers_are_and_how_to_ship_it():
    train = {"checkpoint": "2", "trackers": ["tensorboard --logdir /r/tb"]}
    measured = {"acceptance_length": 2.9, "checkpoint": "2", "checkpoint_path": "/r/2",
                "prompts": 12, "trackers": ["tensorboard --logdir /r/tb", "mlflow ui x"]}
    lines = outcome(train, measured, {}, "r1")
    assert lines[-2] == "trackers: tensorboard --logdir /r/tb; mlflow ui x"
    assert lines[-1].startswith("to ship it: eagle-panel export r1 ")
    # not measured: nothing to export; no trackers configured: no line
    lines = outcome({"checkpoint": "2", "acceptance_length": 2.5}, {}, {}, "r1")
    assert not any("export" in ln or "trackers" in ln for ln in lines)
    assert outcome(train, {}, {}, "r1")[-1] == "trackers: tensorboard --logdir /r/tb"


def test_a_long_runs_counts_fit_the_progress_column_and_never_round_up_to_done():
    from widgets.bars import count
    from widgets.stage_table import StageTable
    assert [count(n) for n in (0, 9999, 10_000, 19_999, 1_234_567, 9_999_999, 10**7)] == \
        ["0", "9999", "10k", "19k", "1.2M", "9.9M", "10M"]
    assert count(None) == "None" and count(2.5) == "2.5"
    cell = StageTable._progress({"done": 9_999_999, "total": 10**7}).plain
    assert cell.endswith(" 9.9M/10M") and len(cell) <= 18   # the column is 18 cells
