"""The draft algorithms ([stages.train] algorithm; pipeline.train.algorithms):
each one's acceptance estimate from its own metrics, the config's checks,
train's flags, and a real speculators training of each on the built-in
target.

The vllm tier's part of tests/unit/test_algorithms.py."""

import json
import shlex
import shutil
from pathlib import Path

import pytest

from pipeline.config import load as load_config
from pipeline.train import algorithms
from tests.configs import merged, render


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """prepare, extract (hf) and vocab once on 24 conversations of the built-in target."""
    from pipeline.stages import extract, prepare, vocab
    from tests.helpers import run_body
    tmp = tmp_path_factory.mktemp("algo")
    for name, body in (("prepare", prepare.body), ("extract", extract.body),
                       ("vocab", vocab.body)):
        code, _, _ = run_body(tmp, name, body, render(BASE))
        assert code == 0, name
    return tmp


BASE = {"data": {"max_samples": 24}, "stages": {"extract": {"layer_ids": [1, 2, 3]},
                                                "vocab": {"draft_vocab_size": 200},
                                                "train": {"lr": 0.001}}}


TRAINED: dict[str, tuple] = {}


def train_once(prepared, name: str):
    """`name` trained once for this module, in a run of its own (a copy of
    the prepared one): (exit code, run dir, train's events, its config)."""
    if name not in TRAINED:
        from pipeline.stages import train
        from tests.helpers import run_body
        shutil.copytree(prepared / "r", prepared / name)
        # 4 epochs (~50 steps: a draft vLLM accepts from); DFlash ~1.4 s a step on 2 cores: 3
        # (the block drafters at 1 layer: speculators' 5 take ~4x the time a step)
        extra = {"epochs": 1, "max_steps": 3, "num_layers": 1} if algorithms.get(name).block \
            else {"epochs": 4}
        cfg = render(merged(BASE, {"stages": {"train": {"algorithm": name, **extra},
                                              "evaluate": EVALUATE}}))
        TRAINED[name] = (*run_body(prepared, "train", train.body, cfg, run=name), cfg)
    return TRAINED[name]


EVALUATE = {"max_prompts": 4, "max_tokens": 24, "baseline": False}


def stand_in_config(prepared, name: str) -> dict:
    """The config.json doctor's stand-in for `name`'s draft holds, asked of
    this interpreter's speculators with train_once's config."""
    import sys

    from pipeline import config as config_mod
    from pipeline.train import draft_stand_in
    (prepared / f"{name}.toml").write_text(train_once(prepared, name)[3])
    cfg = config_mod.load(prepared / f"{name}.toml")
    got = draft_stand_in.ask(sys.executable, f"test {name}", cfg, [1, 2, 3])
    assert got.ok, got
    return json.loads((Path(got.folder) / "config.json").read_text())


@pytest.mark.parametrize("name", ["eagle3.1", "peagle", "dflash", "dspark", "dflash2"])
def test_each_algorithm_trains_and_gives_its_estimate(prepared, name):
    """A real speculators training of `name` (4 epochs; DFlash 3 steps),
    on the same hidden states: its flags in the replayable argv, its
    speculator type in the checkpoint, and the estimate from its own
    metrics in the summary and the validation events."""
    from tests.helpers import finished
    code, rd, evs, _ = train_once(prepared, name)
    assert code == 0, [e for e in evs if e["type"] == "error"]
    s = finished(evs)["summary"]
    assert s["algorithm"] == name
    assert " ".join(["--speculator-type", algorithms.get(name).speculator_type,
                     *algorithms.get(name).flags]) in s["train_argv"]
    # DFlash: eal over its block (15 + 1); DSpark: over all 8 of its block (+ 1); DFlash2 7 + 1
    most = {"dflash": 16.0, "dspark": 9.0, "dflash2": 8.0}.get(name, 4.0)
    assert s["acceptance_length"] is not None and 1.0 <= s["acceptance_length"] <= most, s
    written = json.loads((rd.stage_dir("train") / "out/checkpoints/0/config.json").read_text())
    assert written["speculators_model_type"] == algorithms.get(name).speculator_type, written
    # doctor's stand-in for this draft (speculators' own build_draft_model from the same
    # flags, stopped before the weights: pipeline/train/draft_stand_in.py) is the trained
    # checkpoint's config, key for key
    assert stand_in_config(prepared, name) == written
    if algorithms.get(name).full_vocab:   # DFlash2: the target's vocabulary, no mapping
        assert "--d2t-path" not in s["train_argv"] and "--draft-vocab-size" not in s["train_argv"]
        target = load_config(prepared / "config.toml").target_path()
        assert written["draft_vocab_size"] == json.loads(
            (target / "config.json").read_text())["vocab_size"], written
        assert written["architectures"] == list(algorithms.get(name).architectures)
    val = [e for e in evs if e["type"] == "metric" and e.get("split") == "val"]
    assert val and val[-1]["values"].get("acceptance_estimate") == pytest.approx(
        s["acceptance_length"]), val[-1]


@pytest.mark.parametrize("name", ["eagle3.1", "peagle", "dflash"])
def test_each_algorithm_is_measured_by_the_real_vllm(prepared, name):
    """The trained draft served by this machine's vLLM (the CPU build) the
    way it expects (`eagle3`; `eagle3` with `parallel_drafting`): the
    acceptance length from vLLM's own counters, and the algorithm named in
    the results."""
    from pipeline.paths import VLLM_VENV
    from pipeline.stages import evaluate
    from pipeline.vllm.environment import probe
    from tests.helpers import finished, run_body
    py = VLLM_VENV / "bin" / "python"
    if not py.exists() or probe(str(py)).unusable([]):
        pytest.skip(f"no usable real vLLM in {VLLM_VENV} (scripts/install.sh makes it)")
    code, rd, _, cfg = train_once(prepared, name)
    assert code == 0
    code, rd, evs = run_body(prepared, "evaluate", evaluate.body, cfg, run=name)
    assert code == 0, [e for e in evs if e["type"] in ("error", "warning")]
    s = finished(evs)["summary"]
    results = json.loads((rd.stage_dir("evaluate") / "out/results.json").read_text())
    measured = next(iter(results["checkpoints"].values()))
    # 4 epochs on 21 conversations: short of good, but vLLM accepts some of its drafts
    # (measured here: EAGLE-3.1 1.114, P-EAGLE 1.195; seeded, greedy)
    assert s["prompts"] >= 1 and measured["drafts"] > 0, s
    assert s["acceptance_length"] > 1.0 or name == "dflash", s   # (DFlash: 3 steps)
    assert results["algorithm"] == name
    argv = shlex.split(measured["vllm_command"])
    served = json.loads(argv[argv.index("--speculative-config") + 1])
    algo = algorithms.get(name)
    assert served["method"] == algo.vllm_method and all(
        served.get(k) == v for k, v in algo.vllm_extra.items()), served
    print(f"{name}: acceptance {s['acceptance_length']:.3f} measured, "
          f"{s['acceptance_estimate']} estimated, per position {s['per_position']}")


@pytest.mark.parametrize("name, says", [
    ("dspark", "Model Runner V1 does not support: dspark speculative decoding"),
    ("dflash2", "Model Runner V1 does not support: DFlash candidate-head drafts")])
def test_a_draft_this_vllm_cannot_serve_skips_evaluate_with_its_reason(prepared, name, says):
    """DSpark and DFlash2 on this machine's vLLM (the CPU build, no Triton):
    evaluate is skipped, not failed, with the reason read from that vLLM's
    source (DSpark's method, DFlash2's architecture), before any server
    starts; the run keeps train's estimate."""
    from pipeline.paths import VLLM_VENV
    from pipeline.stages import evaluate
    from pipeline.vllm.environment import probe
    from tests.helpers import finished, run_body
    py = VLLM_VENV / "bin" / "python"
    env = probe(str(py)) if py.exists() else None
    if env is None or env.unusable([]) or env.triton:
        pytest.skip(f"no real vLLM without Triton in {VLLM_VENV}")
    code, rd, _, cfg = train_once(prepared, name)
    assert code == 0
    code, rd, evs = run_body(prepared, "evaluate", evaluate.body, cfg, run=name)
    assert code == 0
    fin = finished(evs)
    assert fin["status"] == "skipped", fin
    assert says in fin["summary"]["skipped"], fin
    assert not (rd.stage_dir("evaluate") / "out/results.json").exists()


def test_compare_puts_the_runs_side_by_side(prepared, tmp_path):
    """`eagle-panel compare` over two algorithms' runs of the same data: a
    row each from their records (the draft's size from its safetensors
    header), as text at 80 columns and as JSON; a run that is not one is
    exit 2."""
    from tests.helpers import cli
    runs = [str(train_once(prepared, name)[1].path) for name in ("eagle3.1", "peagle")]
    p = cli("compare", *runs, "--json", cwd=tmp_path, check=0)
    rows = {r["algorithm"]: r for r in json.loads(p.stdout)}
    assert set(rows) == {"eagle3.1", "peagle"}
    assert rows["eagle3.1"]["draft"] == "llama" and rows["peagle"]["draft"] == "own"
    assert all((r["parameters"] or 0) > 0 and (r["estimate"] or 0) > 1.0 and
               (r["train_s"] or 0) > 0 for r in rows.values()), rows
    text = cli("compare", *runs, cwd=tmp_path, check=0).stdout
    assert "note:" not in text   # the same target and data
    lines = text.splitlines()
    assert all(len(ln) <= 80 for ln in lines), text
    assert any(ln.split()[:2] == ["peagle", "peagle"] for ln in lines), text
    bad = cli("compare", str(tmp_path / "nothing"), cwd=tmp_path, check=2)
    assert "no such run directory" in bad.stderr
