"""The training budget (pipeline.train.budget): how much the train stage
trains from the data it has, and the plateau stop, on speculators' own
packer, and once on a real short training of the built-in target.

The parts in other tiers: tests/integration/test_train_budget.py."""

import json
import random
from pathlib import Path

import pytest

from pipeline.train import budget
from pipeline.train.budget import PlateauWatch, packed_steps, plan, plateau_reason
from tests.helpers import outcome_words as outcome
from tests.helpers import summary_words as text


def lengths(n: int, seed: int = 0, low: int = 30, high: int = 256) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(n)]


def test_less_data_gets_more_steps_per_token_never_below_the_floor(monkeypatch):
    monkeypatch.setattr(budget, "EXACT_ROWS", 4000)   # the biggest estimated: seconds saved
    plans = {}
    for n in (16, 60, 324, 3000, 30000):
        data = lengths(n)
        b = plan(data, target_steps=600, min_steps=300, max_epochs=20)
        assert b.auto and b.steps >= 300, (n, b)
        assert b.total_seq_len >= max(data) and b.total_seq_len % budget.SEQ_STEP == 0
        # the plan is what speculators' packer makes of it
        assert b.steps_per_epoch == packed_steps(data, b.total_seq_len)
        plans[n] = (b, b.steps / sum(data))
    per_token = [plans[n][1] for n in (16, 60, 324, 3000, 30000)]
    assert per_token == sorted(per_token, reverse=True), plans
    # the bundled data's size: smaller steps than the old hand-tuned 512, the target reached
    b = plans[324][0]
    assert b.total_seq_len < 512 and b.steps >= 600 and b.epochs <= budget.PLANNED_PASSES
    # tiny data: the floor outranks max_epochs, and says so
    tiny = plans[16][0]
    assert tiny.epochs > 20 and "floor of 300" in tiny.why
    # more data: bigger steps; more than the target needs: the biggest, fewer passes
    assert plans[3000][0].total_seq_len > b.total_seq_len
    big = plans[30000][0]
    assert big.total_seq_len == budget.SEQ_MAX and big.epochs <= 2


def test_big_data_is_estimated_and_explicit_values_are_kept():
    data = lengths(budget.EXACT_ROWS + 1, high=2048)
    b = plan(data)
    assert (b.epochs, b.total_seq_len) == (1, budget.SEQ_MAX) and b.steps > 600
    assert b.steps_per_epoch == budget.estimated_steps(data, budget.SEQ_MAX)
    small = lengths(324)
    fixed = plan(small, epochs=4, total_seq_len=512)
    assert (fixed.epochs, fixed.total_seq_len, fixed.auto) == (4, 512, False)
    assert "epochs = 4 set" in fixed.why
    # total_seq_len given, epochs chosen for it; max_epochs caps the target
    capped = plan(small, total_seq_len=4096, target_steps=600, min_steps=10, max_epochs=5)
    assert capped.epochs == 5 and "max_epochs 5 caps" in capped.why
    with pytest.raises(ValueError, match="no training samples"):
        plan([])


def test_plateau_reason_on_recorded_estimates():
    rising = [(0, 1.9), (1, 2.5), (2, 2.9), (3, 3.05), (4, 3.07), (5, 3.08)]
    assert plateau_reason(rising[:2], 2, 0.005) is None          # too few epochs to judge
    assert plateau_reason(rising[:5], 2, 0.005) is None          # +5.9% over the last 2
    assert plateau_reason(rising, 2, 0.005) is None              # +1.0%: still improving
    assert plateau_reason(rising, 2, 0.02) == "plateau at epoch 6: estimate 3.08, +1.0% over 2 epochs"
    flat = [(0, 3.0), (1, 3.004), (2, 3.002)]
    assert plateau_reason(flat, 2, 0.005) == "plateau at epoch 3: estimate 3.00, +0.1% over 2 epochs"
    # a drop is no gain (the best so far counts); patience 0 never stops
    assert plateau_reason([(0, 3.0), (1, 2.9)], 1, 0.005) == \
        "plateau at epoch 2: estimate 2.90, +0.0% over 1 epoch"
    assert plateau_reason(flat, 0, 0.005) is None


def test_plateau_watch_survives_a_resume(tmp_path):
    path = tmp_path / "plateau.json"
    w = PlateauWatch(path, 1, 0.01)
    assert w.update(0, 2.0) is None and w.update(1, 2.5) is None
    # killed during epoch 2 and resumed: epoch 2 redone, its first figure replaced
    assert w.update(2, 2.4) is not None
    w = PlateauWatch(path, 1, 0.01)
    assert w.stopped_before(3) and not w.stopped_before(2)
    assert w.update(2, 2.9) is None and not w.stopped_before(3)
    saved = json.loads(path.read_text())
    assert saved["history"] == [[0, 2.0], [1, 2.5], [2, 2.9]] and saved["stopped"] is None
    assert PlateauWatch(path, 1, 0.01).best_epoch() == 2
    # on a plateau: the latest epoch within min_delta of the highest (more steps, and the
    # rule's own tolerance cannot tell them apart); outside it, the highest
    flat = PlateauWatch(tmp_path / "flat.json", 2, 0.005)
    for e, v in enumerate([3.30, 3.441, 3.430, 3.440, 3.41]):
        flat.update(e, v)
    assert flat.top_epoch() == 1 and flat.best_epoch() == 3     # 3.440 * 1.005 >= 3.441
    assert PlateauWatch(tmp_path / "flat.json", 2, 0.0).best_epoch() == 1   # no tolerance
    # a rank other than 0 decides the same but writes nothing
    other = tmp_path / "other.json"
    PlateauWatch(other, 1, 0.01, writer=False).update(0, 1.0)
    assert not other.exists()


def test_evaluate_names_the_draft_vllm_measured_best(tmp_path):
    """best-K measures the K checkpoints train estimates highest; of those
    measured, the summary names the longest measured acceptance."""
    from pipeline.evaluate.choice import best_measured, checkpoints
    save = tmp_path / "out" / "checkpoints"
    for e in range(5):
        d = save / str(e)
        d.mkdir(parents=True)
        (d / "training_state.json").write_text(json.dumps({"epoch": e, "global_step": 10 * e}))
        (d / "model.safetensors").write_bytes(b"x")
        (d / "optimizer_state_dict.pt").write_bytes(b"x")
    (save / "5").mkdir()                                   # incomplete: never measured
    watch = PlateauWatch(tmp_path / "out" / "plateau.json", 0, 0.005)
    for e, v in enumerate([2.0, 2.9, 3.1, 3.0, 3.05]):
        watch.update(e, v)
    assert [d.name for d in checkpoints(save, "best-3")] == ["2", "3", "4"]
    assert [d.name for d in checkpoints(save, "all")] == ["0", "1", "2", "3", "4"]
    # chosen: the one train's summary names (a symlink to it too), else the last
    assert [d.name for d in checkpoints(save, "chosen", save / "2")] == ["2"]
    (save / "checkpoint_best").symlink_to("3")
    assert [d.name for d in checkpoints(save, "chosen", save / "checkpoint_best")] == ["3"]
    assert [d.name for d in checkpoints(save, "chosen", None)] == ["4"]
    assert [d.name for d in checkpoints(save, "chosen", save / "5")] == ["4"]   # incomplete
    # a run folder moved since train wrote its summary: found by the folder's name
    assert [d.name for d in checkpoints(save, "chosen", Path("/elsewhere/checkpoints/2"))] == ["2"]
    from pipeline.evaluate.choice import chosen_by
    assert chosen_by("chosen", save / "2", [save / "2"]) == "the checkpoint train chose"
    assert chosen_by("chosen", None, [save / "4"]) == "last checkpoint (train named none)"
    assert chosen_by("last", None, [save / "4"]) == "last checkpoint"
    (tmp_path / "out" / "plateau.json").unlink()            # no estimates: the last K
    assert [d.name for d in checkpoints(save, "best-2")] == ["3", "4"]
    measured = {"2": 2.8, "3": 2.95, "4": 2.95}
    assert best_measured(measured) == "4"                  # a tie: the later one
    measured["2"] = 3.2                                     # not the estimate's favourite
    assert best_measured(measured) == "2"


def test_config_accepts_the_rule_and_best_k(tmp_path):
    from pipeline import config as config_mod
    from tests.configs import write
    from tests.helpers import ROOT
    cfg = config_mod.load(ROOT / "config.toml")
    assert cfg.stages.train.epochs == 0 and cfg.stages.train.total_seq_len == 0
    path = tmp_path / "c.toml"
    write(path, {"stages": {"evaluate": {"checkpoints": "best-4"}}})
    assert config_mod.load(path).stages.evaluate.checkpoints == "best-4"
    write(path, {"stages": {"evaluate": {"checkpoints": "best-x"}}})
    with pytest.raises(config_mod.ConfigError, match="best-3"):
        config_mod.load(path)
    write(path, {"stages": {"train": {"max_epochs": 0}}})
    with pytest.raises(config_mod.ConfigError, match="max_epochs"):
        config_mod.load(path)


def test_the_summary_says_why_training_stopped_and_which_draft():
    train = {"checkpoint": "/r/train/out/checkpoints/5", "val_loss": 0.64,
             "acceptance_length": 3.08, "checkpoint_chosen_by": "highest acceptance estimate, "
             "epoch 6", "stopped": "plateau at epoch 7: estimate 3.08, +0.2% over 2 epochs",
             "epochs_trained": 7, "total_seq_len": 384}
    assert text("train", train) == (
        "validation loss 0.640 · acceptance 3.08 estimated · checkpoint 5 · "
        "stopped: plateau at epoch 7: estimate 3.08, +0.2% over 2 epochs")
    lines = outcome(train, {}, {})
    assert lines[1] == "trained draft (highest acceptance estimate, epoch 6): " \
                       "/r/train/out/checkpoints/5"
    assert lines[2] == "training stopped: plateau at epoch 7: estimate 3.08, +0.2% over 2 " \
                       "epochs (7 epochs, total_seq_len 384)"
    evaluate = {"checkpoint": "4", "checkpoint_path": "/r/train/out/checkpoints/4",
                "checkpoint_chosen_by": "highest measured acceptance of 3",
                "acceptance_length": 3.2, "prompts": 48}
    assert outcome(train, evaluate, {})[1] == \
        "trained draft (highest measured acceptance of 3): /r/train/out/checkpoints/4"
    # one measured (checkpoints = "last") while train's best estimate was another:
    # the draft named is the one whose acceptance is printed
    last = {"checkpoint": "7", "checkpoint_path": "/r/train/out/checkpoints/7",
            "checkpoint_chosen_by": "last checkpoint", "acceptance_length": 3.1, "prompts": 48}
    lines = outcome(train, last, {})
    assert lines[1] == "trained draft (last checkpoint): /r/train/out/checkpoints/7"
    assert "checkpoint 7" in lines[3]
