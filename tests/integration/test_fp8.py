"""FP8 hidden states ([stages.extract] hidden_states_dtype = "fp8"):
speculators' own layout (hs_connectors 0.9: float8_e4m3fn with a float32
scale per token), written by our path bit for bit as speculators' quantizer
writes it, validated on resume, read by the train stage through speculators'
FP8 loader, and about half of bf16 on disk.

The integration tier's part of tests/unit/test_fp8.py."""

import json

from tests.configs import render
from tests.helpers import finished, hs_files, prepared_once, run_body

CONFIG = render({
    "data": {"max_samples": 24},
    "stages": {
        "prepare": {"seq_length": 128},
        "extract": {"backend": "hf", "layer_ids": [1, 2, 3], "hidden_states_dtype": "fp8"},
        "vocab": {"draft_vocab_size": 256},
        "train": {"epochs": 1, "max_steps": 4, "total_seq_len": 512},
    },
})


def test_hf_backend_writes_fp8_and_train_reads_it(tmp_path_factory):
    from pipeline.stages import extract, train, vocab
    tmp, rd = prepared_once(tmp_path_factory, "fp8", CONFIG)
    code, rd, events = run_body(tmp, "extract", extract.body, CONFIG)
    s = finished(events)["summary"]
    assert code == 0 and s["stored"] == "fp8" and s["samples"] == 24
    meta = json.loads((rd.out_dir("extract") / "meta.json").read_text())
    # 4 layers x 128 x 1 B + a float32 scale + the int64 id: 524 B vs 2,056 in float32
    assert meta["stored"] == "fp8" and meta["bytes_per_token"] == 4 * 128 + 4 + 8
    files = hs_files(rd)
    assert len(files) == 24
    # the stage's own check on resume: every file validates; a damaged one is redone
    files[3].write_bytes(files[3].read_bytes()[:100])
    code, rd, events = run_body(tmp, "extract", extract.body, CONFIG)
    s = finished(events)["summary"]
    assert code == 0 and s["reused"] == 23 and s["computed"] == 1
    code, rd, _ = run_body(tmp, "vocab", vocab.body, CONFIG)
    assert code == 0
    code, rd, events = run_body(tmp, "train", train.body, CONFIG)
    s = finished(events)["summary"]
    assert code == 0, s
    assert "--hidden-states-backend fp8" in s["train_argv"]
