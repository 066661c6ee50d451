"""The draft algorithms ([stages.train] algorithm; pipeline.train.algorithms):
each one's acceptance estimate from its own metrics, the config's checks,
train's flags, and a real speculators training of each on the built-in
target.

The parts in other tiers: tests/vllm/test_algorithms.py."""

import json

import pytest

from pipeline.config import ConfigError
from pipeline.config import load as load_config
from pipeline.train import algorithms
from pipeline.train.val_metrics import acceptance_length
from tests.configs import write


def test_each_algorithm_estimates_from_its_own_metrics():
    eagle = {"full_acc_0": 0.8, "full_acc_1": 0.6, "full_acc_2": 0.4}
    assert acceptance_length(eagle, 3) == pytest.approx(2.8)
    assert acceptance_length(eagle, 3, "eagle3.1") == pytest.approx(2.8)
    assert acceptance_length({"full_acc_0": 0.5}, 3) is None
    # P-EAGLE: each depth's own accuracy; the chain is their running product
    depths = {"position_0_acc": 0.9, "position_1_acc": 0.5, "position_2_acc": 0.5,
              "full_acc": 0.63}
    assert acceptance_length(depths, 3, "peagle") == pytest.approx(1 + 0.9 + 0.45 + 0.225)
    assert acceptance_length(eagle, 3, "peagle") is None     # not EAGLE-3's keys
    # DFlash: its own eal (bonus token included), over its block
    assert acceptance_length({"eal": 2.7}, 3, "dflash") == pytest.approx(2.7)
    # not capped at 1 + the served tokens: a cap flattens the later epochs (plateau, choice)
    assert acceptance_length({"eal": 6.2}, 3, "dflash") == pytest.approx(6.2)
    assert acceptance_length({"eal": 0.0}, 3, "dflash") is None   # an empty validation set
    assert acceptance_length({"full_acc": 0.5}, 3, "dflash") is None


def config(tmp_path, train: dict, evaluate: dict | None = None):
    return write(tmp_path / "config.toml", {"stages": {"train": train, "evaluate": evaluate or {}}})


@pytest.mark.parametrize("train, evaluate, says", [
    ({"algorithm": "eagle_3"}, {}, "Did you mean 'eagle3'"),
    ({"algorithm": "dspark", "block_size": 4}, {"num_speculative_tokens": 5},
     "DSpark's block of 4: vLLM drafts at most block_size = 4"),
    ({"loss_weights": {"cross_entropy": 1.0}}, {}, "not one of speculators' losses"),
    ({"loss_weights": {"kl_div": 0.0}}, {}, "a weight must be positive"),
    ({"algorithm": "dflash", "loss_weights": {"kl_div": 1.0}}, {}, "DPACE"),
    ({"algorithm": "peagle", "position_decay": 0.8}, {}, "weighs every position alike"),
    ({"algorithm": "dflash2"}, {"num_speculative_tokens": 8}, "at most block_size - 1 = 7"),
    ({"algorithm": "peagle", "draft_layer": "mla"}, {}, "the llama and MLA draft layers"),
    ({"algorithm": "dflash", "draft_layer": "llama"}, {}, "trains its own layers"),
    ({"algorithm": "peagle"}, {"num_speculative_tokens": 9}, "speculators trains 8 depths"),
    ({"block_size": 8}, {}, "`stages.train.block_size` is for the block drafters (dflash, dspark, "
                            "dflash2)"),
    ({"algorithm": "dflash", "block_size": 4}, {"num_speculative_tokens": 5},
     "at most block_size - 1 = 3 tokens"),
    ({"algorithm": "dflash", "block_size": 1}, {}, "a block of 2 or more"),
])
def test_config_refuses_what_an_algorithm_cannot_do(tmp_path, train, evaluate, says):
    with pytest.raises(ConfigError, match="config.toml") as e:
        load_config(config(tmp_path, train, evaluate))
    assert says in str(e.value), str(e.value)


def test_train_flags_per_algorithm(tmp_path):
    from pipeline.train.flags import algorithm_flags
    flags = {name: algorithm_flags(load_config(config(tmp_path, {"algorithm": name}))
                                   .stages.train) for name in algorithms.ALGORITHMS}
    assert flags["eagle3"] == []            # speculators' default: the argv as before
    # EAGLE-3.1's per-layer norm needs the single one off (they are mutually exclusive)
    assert flags["eagle3.1"] == ["--speculator-type", "eagle3", "--fc-norm",
                                 "--no-norm-before-fc", "--norm-output"]
    assert flags["peagle"] == ["--speculator-type", "peagle"]
    dflash = load_config(config(tmp_path, {"algorithm": "dflash", "block_size": 8})).stages.train
    assert algorithm_flags(dflash) == ["--speculator-type", "dflash", "--block-size", "8"]
    assert flags["dspark"] == ["--speculator-type", "dspark"]
    assert flags["dflash2"] == ["--speculator-type", "dflash2"]
    # loss weights: one loss by name, several as speculators' JSON; the decay each one has
    tuned = load_config(config(tmp_path, {"algorithm": "dspark", "position_decay": 2.0,
                                          "loss_weights": {"ce": 0.1, "tv": 0.9}})).stages.train
    assert algorithm_flags(tuned) == ["--speculator-type", "dspark", "--loss-fn",
                                      '{"ce": 0.1, "tv": 0.9}', "--dflash-decay-gamma", "2.0"]
    eagle = load_config(config(tmp_path, {"loss_weights": {"tv": 1.0},
                                           "position_decay": 0.8}))
    assert algorithm_flags(eagle.stages.train) == ["--loss-fn", "tv",
                                                   "--ttt-step-loss-decay", "0.8"]


def test_each_algorithm_has_its_own_layers_and_dflash2_its_whole_vocabulary(tmp_path):
    """num_layers 0 (the default) is speculators' own for the algorithm (5 for
    the DFlash family), and what a fingerprint holds (a run made at the old
    default 1 stays up to date); DFlash2 turns the vocab stage off and trains
    without a vocabulary mapping."""
    dflash = load_config(config(tmp_path, {"algorithm": "dflash"}))
    assert algorithms.num_layers(dflash.stages.train) == 5
    assert dflash.section_dict("train")["num_layers"] == 5
    plain = load_config(config(tmp_path, {"lr": 0.001}))
    assert plain.section_dict("train")["num_layers"] == 1
    assert plain.fingerprint("train", {}) == load_config(
        config(tmp_path, {"lr": 0.001, "num_layers": 1})).fingerprint("train", {})
    two = load_config(config(tmp_path, {"algorithm": "dflash", "num_layers": 2}))
    assert algorithms.num_layers(two.stages.train) == 2
    dflash2 = load_config(config(tmp_path, {"algorithm": "dflash2"}))
    assert "whole vocabulary" in dflash2.off_reason("vocab") and plain.enabled("vocab")


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0"])
def test_which_runner_serves_a_method_is_read_from_vllms_source(version):
    """DSpark: Model Runner V1 refuses it, V2 requires Triton; read from each
    release's VllmConfig, not a table. The other methods pass either way."""
    from pipeline.vllm import compat
    from tests.fakes import vllm_releases
    src = vllm_releases.source(version)
    assert compat.runner_refusals(src, "V1") == {"dspark": "dspark speculative decoding"}
    assert "dspark" not in compat.runner_refusals(src, "V2")
    why = compat.draft_method_unservable(src, "dspark", triton=False, environ={})
    assert "Model Runner V1 does not support: dspark speculative decoding" in why
    # 0.32's V2 refuses to run without Triton; 0.33's only is not chosen without it
    assert ("V2 requires Triton" in why) == (version == "0.32.0"), why
    asked = compat.draft_method_unservable(src, "dspark", False, {"VLLM_USE_V2_MODEL_RUNNER": "1"})
    assert (asked is None) == (version == "0.33.0"), asked
    assert compat.draft_method_unservable(src, "dspark", triton=True, environ={}) is None
    forced = compat.draft_method_unservable(src, "dspark", True, {"VLLM_USE_V2_MODEL_RUNNER": "0"})
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in forced
    for method in ("eagle3", "dflash"):
        assert compat.draft_method_unservable(src, method, triton=False, environ={}) is None
    # DFlash2: method dflash, refused by its architecture (a candidate-head draft) on V1
    refused = compat.runner_arch_refusals(src, "V1")
    assert any(m == "dflash" and "DFlash2DraftModel" in archs for m, archs in refused), refused
    arch = compat.draft_method_unservable(src, "dflash", False, {}, ("DFlash2DraftModel",))
    assert "Model Runner V1 does not support: DFlash candidate-head drafts" in arch, arch
    assert compat.draft_method_unservable(src, "dflash", True, {}, ("DFlash2DraftModel",)) is None
    assert compat.draft_method_unservable(src, "dspark", True,
                                          {"VLLM_USE_V2_MODEL_RUNNER": "00"}) is not None
    # a release that does not know the method (0.22 has DFlash, not DSpark)
    old = vllm_releases.source("0.22.0")
    assert "has no speculative method 'dspark'" in compat.draft_method_unservable(
        old, "dspark", True, {})
    assert compat.draft_method_unservable(old, "dflash", False, {}) is None
    assert "no model class for DFlash2DraftModel" in compat.draft_method_unservable(
        old, "dflash", True, {}, ("DFlash2DraftModel",))
    # nothing to read it from (no config/speculative.py, before 0.10): no refusal made up
    from pipeline.vllm.source import VllmSource
    assert compat.draft_method_unservable(VllmSource("0.8.5", lambda rel: None), "dspark",
                                          False, {}) is None


def test_doctor_says_evaluate_skips_a_draft_this_vllm_cannot_serve(tmp_path):
    """The doctor line for DSpark against 0.32's source: a warning with the
    runner's reason on a vLLM without Triton, OK with it."""
    from pipeline import doctor
    from tests.fakes import vllm_releases
    cfg = load_config(config(tmp_path, {"algorithm": "dspark"}))
    env = {"python": "3.12.3", "executable": "/opt/env/bin/python", "vllm_dir": None,
           "packages": {"torch": "2.11.0", "speculators": "0.9.0", "vllm": "0.32.0"}}
    for triton, level, says in ((None, doctor.WARN, "evaluate will be skipped"),
                                ("3.5.0", doctor.OK, "serves DSpark drafts")):
        env["packages"]["triton"] = triton
        x = doctor.Inputs(cfg, env, doctor.vllm_env_from(env), None,
                          source=vllm_releases.source("0.32.0"))
        (f,) = doctor.check_draft_method(x)
        assert f.level == level and says in f.message, f
    # DFlash2: refused by its architecture (a candidate-head draft), read the same way
    env["packages"]["triton"] = None
    x = doctor.Inputs(load_config(config(tmp_path, {"algorithm": "dflash2"})), env,
                      doctor.vllm_env_from(env), None, source=vllm_releases.source("0.32.0"))
    (f,) = doctor.check_draft_method(x)
    assert f.level == doctor.WARN and "DFlash candidate-head drafts" in f.message, f
    assert "dflash2" not in f.fix.split("serves (")[-1], f.fix   # not among those it serves


def test_doctor_reads_that_034_refuses_peagle(tmp_path):
    """P-EAGLE is EAGLE-3 drafting in parallel (method eagle3 + parallel_drafting):
    0.32 serves it; 0.34's SpeculativeConfig refuses parallel_drafting except for
    dflash and dspark. Doctor says so in vLLM's words, from 0.34's source, and
    names what that vLLM still serves; DFlash (parallel by nature) is unaffected."""
    from pipeline import doctor
    from tests.fakes import vllm_releases
    env = {"python": "3.12.3", "executable": "/opt/env/bin/python", "vllm_dir": None,
           "packages": {"torch": "2.11.0", "speculators": "0.9.0", "vllm": "0.34.0",
                        "triton": "3.5.0"}}
    found = {}
    for version in ("0.32.0", "0.34.0"):
        env["packages"]["vllm"] = version
        x = doctor.Inputs(load_config(config(tmp_path, {"algorithm": "peagle"})), env,
                          doctor.vllm_env_from(env), None, source=vllm_releases.source(version))
        (found[version],) = doctor.check_draft_method(x)
    assert found["0.32.0"].level == doctor.OK, found["0.32.0"]
    f = found["0.34.0"]
    assert f.level == doctor.WARN and "evaluate will be skipped" in f.message, f
    assert "vLLM 0.34.0 refuses parallel_drafting for method 'eagle3': \"parallel_drafting is " \
           "only supported by the dflash and dspark methods, not 'eagle3'.\"" in f.message, f
    served = f.fix.split("serves (")[-1]
    assert "eagle3" in served and "dflash" in served and "peagle" not in served, f.fix


@pytest.mark.parametrize("version", ["0.32.0", "0.34.0"])
def test_the_speculators_types_each_vllm_reads(version):
    """vLLM reads a draft's config.json by its speculators type, through the
    registry in transformers_utils/configs/speculators/algos.py: read from
    the release, every algorithm's type is registered; 0.34 registers
    `peagle` only to raise, said in its words; a type it has no entry for
    (speculators' MTP) is named with what it does read."""
    from pipeline.vllm import compat
    from tests.fakes import vllm_releases
    src = vllm_releases.source(version)
    types = compat.speculators_types(src)
    assert {a.speculator_type for a in algorithms.ALGORITHMS.values()} <= set(types), types
    why = {a.speculator_type: compat.speculators_type_refusal(src, a.speculator_type)
           for a in algorithms.ALGORITHMS.values()}
    if version == "0.32.0":
        assert not any(why.values()), why
    else:
        assert why.pop("peagle") == (
            "vLLM 0.34.0 refuses speculators type 'peagle': \"P-EAGLE (parallel drafting "
            "EAGLE-3) is not supported.\" (vllm/transformers_utils/configs/speculators/algos.py)")
        assert not any(why.values()), why
    mtp = compat.speculators_type_refusal(src, "mtp")
    assert mtp.startswith(f"vLLM {version} reads no speculators config of type 'mtp' (") and \
        "eagle3" in mtp


def test_the_default_algorithm_keeps_older_runs_fingerprints(tmp_path):
    """`algorithm` and `block_size` at their defaults are left out of train's
    fingerprint (a run made before they existed stays up to date); set, they decide."""
    default = load_config(config(tmp_path, {"lr": 0.001}))
    assert "algorithm" not in default.section_dict("train")
    assert "block_size" not in default.section_dict("train")
    peagle = load_config(config(tmp_path, {"lr": 0.001, "algorithm": "peagle"}))
    assert peagle.section_dict("train")["algorithm"] == "peagle"
    assert default.fingerprint("train", {}) != peagle.fingerprint("train", {})


def test_evaluate_checks_the_tokens_against_what_the_checkpoint_records(tmp_path):
    """A block drafter's checkpoint that drafts fewer tokens than evaluate asks
    (trained with a smaller block than today's config says) is an error before
    any server; EAGLE-3 past its TTT steps a warning."""
    from types import SimpleNamespace

    from pipeline.evaluate.choice import check_drafted_tokens, recorded_tokens
    from pipeline.stage_error import StageError
    ckpt = tmp_path / "0"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"speculators_config": {
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}]}}))
    assert recorded_tokens(ckpt) == 3 and recorded_tokens(tmp_path) is None
    said = []
    ctx = SimpleNamespace(section=SimpleNamespace(num_speculative_tokens=5),
                          events=SimpleNamespace(warning=lambda m, hint=None: said.append(m)))
    with pytest.raises(StageError, match="drafts at most 3 tokens"):
        check_drafted_tokens(ctx, algorithms.get("dflash"), [ckpt])
    check_drafted_tokens(ctx, algorithms.get("eagle3"), [ckpt])
    assert said and "trained for 3" in said[0]
    ctx.section.num_speculative_tokens = 3
    check_drafted_tokens(ctx, algorithms.get("dflash"), [ckpt])   # within: nothing said
    assert len(said) == 1
