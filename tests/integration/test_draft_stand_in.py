"""speculators asked before training (pipeline/train/draft_shape.py,
draft_stand_in.py), through this machine's real speculators: the train
stage's flags through its own parser, a flag it does not have refused in its
words (what a renamed flag in a new release looks like), the draft's config
built by its own build_draft_model with no weights, and the answer cached.
(The stand-in equals a trained checkpoint's config.json for every
algorithm: tests/unit/test_algorithms.py.)"""

import json
import sys
from pathlib import Path

from pipeline import config as config_mod
from pipeline.train import draft_stand_in
from pipeline.train.draft_shape import parser_error
from tests.configs import merged, tiny_pipeline, write


def load(tmp_path, train: dict | None = None):
    write(tmp_path / "config.toml", merged(tiny_pipeline(), {
        "stages": {"train": train or {}, "vocab": {"draft_vocab_size": 200}}}))
    return config_mod.load(tmp_path / "config.toml")


def test_a_flag_speculators_lacks_is_refused_in_its_words(tmp_path):
    cfg = load(tmp_path)
    argv = [*draft_stand_in.planned_argv(cfg, [1, 2, 3]), "--no-such-flag", "1"]
    got = draft_stand_in._run(sys.executable, {"argv": argv, "folder": str(tmp_path / "d")}, 300)
    assert not got.ok and not got.failed and got.step == "resolve", got
    assert got.error == "unrecognized arguments: --no-such-flag 1", got.error
    assert not (tmp_path / "d").exists()


def test_the_schedule_flag_is_speculators_own(tmp_path):
    """`[stages.train] lr_schedule` (one field, docs/config.md's row) reaches
    speculators' own parser as --scheduler-type, with the draft's flags that
    doctor asks about: this speculators takes it."""
    cfg = load(tmp_path, {"lr_schedule": "cosine"})
    argv = draft_stand_in.planned_argv(cfg, [1, 2, 3])
    assert argv[argv.index("--scheduler-type") + 1] == "cosine"
    got = draft_stand_in._run(sys.executable, {"argv": argv, "folder": str(tmp_path / "d")}, 300)
    assert got.ok, got


def test_the_stand_in_is_built_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(draft_stand_in, "cache_dir", lambda: tmp_path / "cache")
    cfg = load(tmp_path, {"algorithm": "peagle"})
    first = draft_stand_in.ask(sys.executable, "speculators under test", cfg, [1, 2, 3])
    assert first.ok and not first.cached and first.step == "config", first
    folder = Path(first.folder)
    written = json.loads((folder / "config.json").read_text())
    assert written["speculators_model_type"] == "peagle" and written["draft_vocab_size"] == 200
    assert written["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert not list(folder.glob("*.safetensors")), "a stand-in holds no weights"
    again = draft_stand_in.ask(sys.executable, "speculators under test", cfg, [1, 2, 3])
    assert again.cached and again.folder == first.folder
    # another speculators, or other flags: asked again, into another folder
    other = draft_stand_in.ask(sys.executable, "speculators under test", cfg, [1, 3])
    assert other.ok and not other.cached and other.folder != first.folder
    # a remembered folder that is gone: asked again, not handed out
    import shutil
    shutil.rmtree(folder)
    redo = draft_stand_in.ask(sys.executable, "speculators under test", cfg, [1, 2, 3])
    assert redo.ok and not redo.cached and (Path(redo.folder) / "config.json").exists()


def test_argparse_words_with_the_reason_on_the_next_lines():
    text = ("usage: speculators [-h] ...\n-: error: invalid configuration:\n"
            "  loss.loss_fn: Unknown loss function 'bogus'. Pass a known name.\n")
    assert parser_error(text) == ("invalid configuration: loss.loss_fn: Unknown loss function "
                                  "'bogus'. Pass a known name.")
    assert parser_error("nothing here") == ""
