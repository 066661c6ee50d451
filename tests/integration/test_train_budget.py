"""The training budget (pipeline.train.budget): how much the train stage
trains from the data it has, and the plateau stop, on speculators' own
packer, and once on a real short training of the built-in target.

The integration tier's part of tests/unit/test_train_budget.py."""




def test_real_training_stops_at_a_plateau_and_a_resume_keeps_it(tmp_path):
    """prepare, extract (hf), vocab and train on 24 conversations of the
    built-in target, the budget rule on: a plateau no epoch can beat
    (min_delta 10 = +1000%) stops it after patience + 1 epochs."""
    from pipeline.stages import extract, prepare, train, vocab
    from tests.configs import render
    from tests.helpers import finished, run_body
    cfg = render({"data": {"max_samples": 24}, "stages": {
        "extract": {"layer_ids": [1, 2, 3]},
        "vocab": {"draft_vocab_size": 200},
        "train": {"lr": 0.001, "target_steps": 40, "min_steps": 1, "max_epochs": 6,
                  "patience": 1, "min_delta": 10.0}}})
    for name, body in (("prepare", prepare.body), ("extract", extract.body),
                       ("vocab", vocab.body)):
        code, rd, _ = run_body(tmp_path, name, body, cfg)
        assert code == 0, name
    code, rd, evs = run_body(tmp_path, "train", train.body, cfg)
    assert code == 0
    s = finished(evs)["summary"]
    assert s["stopped"].startswith("plateau at epoch 2: estimate "), s
    assert s["epochs_trained"] == 2 and s["epochs_planned"] > 2 and len(s["estimates"]) == 2
    assert "--epochs" in s["train_argv"] and f"--total-seq-len {s['total_seq_len']}" in s["train_argv"]
    assert s["checkpoint_chosen_by"].startswith("highest acceptance estimate")
    steps = [e for e in evs if e["type"] == "progress" and e.get("unit") == "steps"]
    assert len({e["total"] for e in steps}) == 1, steps[-1]   # counted once: it never moves
    assert {e["epochs"] for e in steps} == {s["epochs_planned"]}   # "epoch 2/6": as planned
    # resumed after the stop: no more epochs are trained
    code, rd, evs = run_body(tmp_path, "train", train.body, cfg)
    s2 = finished(evs)["summary"]
    assert code == 0 and s2["epochs_trained"] == 2 and s2["stopped"] == s["stopped"]
