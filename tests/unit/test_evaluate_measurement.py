"""evaluate's typed Measurement (pipeline/evaluate/measurement.py): the files
it writes keep the keys every reader of results.json knows, the baseline
without the draft's, and a file from an older release (fewer keys) reads."""

import json

from pipeline.evaluate.measurement import DRAFT, Measurement

LOAD = {"completion_tokens": 480, "requests": 12, "seconds": 9.5,
        "decode_tokens_per_s": 50.5, "vllm_command": "vllm serve t", "prompts": 12,
        "served_by": "a new server"}
DRAFTED = {"drafts": 100, "draft_tokens": 300, "accepted_tokens": 150,
           "acceptance_length": 2.5, "acceptance_rate": 0.5, "per_position": [0.8, 0.5, 0.2],
           "generated_tokens": 480, "per_request": "response",
           "requests_measured": [{"prompt_id": "a", "turn": 0, "steps": 4, "accepted": 2}],
           "per_category": {"held-out": {"acceptance_length": 2.5}}, "worst_prompts": []}
CHECKPOINT = {"served": "/r/train/out/checkpoints/1",
              "checkpoint": {"name": "1", "global_step": 20, "bytes": 1024}, "estimate": None}


def test_a_checkpoints_file_round_trips_with_every_key():
    d = {**LOAD, **DRAFTED, **CHECKPOINT}
    m = Measurement.from_json(json.loads(json.dumps(d)))
    assert m.to_json() == d                     # estimate None is kept: train had none
    assert m.with_draft and m.acceptance_length == 2.5
    assert m.tracker_values() == {"acceptance_length": 2.5, "decode_tokens_per_s": 50.5,
                                  "accept_rate_0": 0.8, "accept_rate_1": 0.5,
                                  "accept_rate_2": 0.2}


def test_the_baseline_has_no_draft_keys():
    m = Measurement(**LOAD)
    assert m.to_json() == LOAD and not m.with_draft
    assert not set(DRAFT) & set(m.to_json())


def test_an_older_file_reads_its_missing_keys_as_none():
    old = {k: v for k, v in {**LOAD, **DRAFTED, **CHECKPOINT}.items()
           if k not in ("per_request", "requests_measured", "worst_prompts", "served")}
    m = Measurement.from_json(old)
    assert m.requests_measured is None and m.served is None and m.drafts == 100
