"""Typed stage summaries (pipeline/run/summaries.py): each key one field of
one type, a summary round-trips through its event's JSON, an older release's
reads as it was meant, a key this release does not know is kept, and a known
key of the wrong type is damage."""

import dataclasses
import typing

import pytest

from pipeline.run import summaries
from pipeline.run.events import valid_event
from pipeline.run.summaries import (
    BY_STAGE,
    KEY_TYPES,
    EvaluateSummary,
    PrepareSummary,
    Summary,
    TrainSummary,
    WorstCategory,
    read,
)

SAMPLE = {int: 7, float: 2.5, str: "s", list[int]: [1, 2], list[float]: [0.5, 0.25],
          list[str]: ["a"], dict[str, float]: {"math": 3.0}}


def filled(cls):
    """Every field of `cls` given a value of its type."""
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if f.name == "extra":
            continue
        tp = next(a for a in typing.get_args(hints[f.name]) if a is not type(None))
        values[f.name] = WorstCategory("math", 2.0) if tp is WorstCategory else SAMPLE[tp]
    return cls(**values)


def test_a_key_means_one_thing_in_every_stage():
    """The same name in two stages has one type (train's and evaluate's
    `acceptance_length` are both a float: the estimate, the measurement)."""
    for cls in (Summary, *BY_STAGE.values()):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name != "extra":
                assert hints[f.name] == KEY_TYPES[f.name], (cls.__name__, f.name)


@pytest.mark.parametrize("stage", sorted(BY_STAGE))
def test_every_summary_round_trips_through_its_event(stage):
    made = filled(BY_STAGE[stage])
    line = made.to_json()
    assert line["version"] == summaries.VERSION
    assert summaries.valid(line)
    assert valid_event({"t": 1.0, "type": "stage_finished", "status": "succeeded",
                        "duration_s": 1.0, "summary": line})
    assert read(stage, line) == made


def test_an_older_summary_reads_as_it_was_meant():
    """Before version 2 prepare's row count was `skipped`, which is now only
    a skipped stage's reason."""
    old = {"rows_in": 830, "samples": 829, "skipped": 1, "tokens": 46938}
    assert summaries.valid(old)
    got = read("prepare", old)
    assert isinstance(got, PrepareSummary) and got.skipped_rows == 1 and got.skipped is None
    assert read("evaluate", {"skipped": "vLLM is not installed"}).skipped == \
        "vLLM is not installed"
    # version 2: a number where a reason goes is no reason (set aside, not a count)
    odd = read("prepare", {"skipped": 1, "version": 2})
    assert odd.skipped is None and odd.skipped_rows is None and odd.extra == {"skipped": 1}


def test_unknown_keys_are_kept_and_shown_as_figures():
    """A user's own stage entry (or a newer release) says what it likes."""
    got = read("other", {"a": 1.23456, "b": 123456, "c": "text"})
    assert type(got) is Summary and got.extra == {"a": 1.23456, "b": 123456, "c": "text"}
    assert got.figures() == {"a": 1.23456, "b": 123456}
    assert got.to_json() == {"a": 1.23456, "b": 123456, "c": "text", "version": 2}
    train = read("train", {"checkpoint": "/c/3", "future_key": [1]})
    assert train.checkpoint == "/c/3" and train.extra == {"future_key": [1]}


@pytest.mark.parametrize("damaged", [
    {"speedup": "fast"}, {"acceptance_length": True}, {"per_position": [0.5, "x"]},
    {"worst_category": {"category": "math", "acceptance_length": "low"}}, {"samples": "3"},
])
def test_a_number_that_is_not_one_is_damage(damaged):
    """What a reader formats as a number (`:.2f`, `:,`): the line is skipped."""
    assert not summaries.valid(damaged)
    assert not valid_event({"t": 1.0, "type": "stage_finished", "status": "succeeded",
                            "duration_s": 1.0, "summary": damaged})


@pytest.mark.parametrize("stage, odd", [
    ("train", {"checkpoint": 5}), ("train", {"trackers": "tensorboard"}),
    ("evaluate", {"per_category": {"math": "high"}}), ("train", {"stopped": True}),
    ("evaluate", {"worst_category": {"acceptance_length": 2.0}}),   # no category
])
def test_any_other_key_of_the_wrong_type_is_set_aside(stage, odd):
    """A user's own stage entry may say odd things: the line stands (as it
    did before the types), the attribute is None and the value kept aside."""
    assert summaries.valid(odd)
    got = read(stage, odd)
    (key, value), = odd.items()
    assert getattr(got, key) is None and got.extra == {key: value}
    assert got.to_json() == {**odd, "version": 2}


def test_a_cancelled_train_from_before_resume_checkpoint_reads_as_one():
    """Before `resume_checkpoint`, a cancelled train's resume point was
    `checkpoint` (which names a trained draft): not taken for one now."""
    old = {"stopped": "on request; resume continues from here", "checkpoint": "/c/1",
           "checkpoint_step": 317}
    got = read("train", old)
    assert got.checkpoint is None and got.resume_checkpoint == "/c/1"


def test_what_json_cannot_tell_apart_is_allowed():
    """3 and 3.0 across writers, NaN written as null, a float where an int
    was meant: numbers all, as before the types."""
    assert summaries.valid({"samples": 3.0, "speedup": 2, "val_loss": None,
                            "per_position": [0.9, None]})


def test_the_stages_build_their_own_type():
    """What a body returns is its stage's class (the supervisor's and the
    protocol's ends are the common one)."""
    assert read("train", TrainSummary(stopped="x").to_json()) == TrainSummary(stopped="x")
    ev = EvaluateSummary(acceptance_length=3.0, worst_category=WorstCategory("code", 2.5))
    assert ev.to_json()["worst_category"] == {"category": "code", "acceptance_length": 2.5}
    assert Summary(exit_code=None, signal="SIGKILL").to_json() == {"signal": "SIGKILL",
                                                                   "version": 2}
