"""A launch refuses what cannot work: `run`, `resume` and the panel's `r`
apply doctor's launch checks first (pipeline.doctor.launch_checks()) and refuse
with exit 2 and doctor's own lines, before a run directory exists (or leaving
an existing one byte-identical); `--skip-checks` launches anyway and says so
in the run's driver.log."""

import shutil

import pytest

from app.panel import PanelApp
from pipeline.telemetry import Telemetry
from tests.helpers import cli, until
from tests.integration.test_reads_never_write import tree
from tests.unit.test_doctor import CONFIGS

# each: (tables laid over the stagekit config, what doctor's line says)
REFUSED = {
    "layer ids repeated and out of range": (
        {"stages": {"extract": {"layer_ids": [1, 1, 99]}}},
        ["layer id 99 is out of range", "lists layer 1 twice"]),
    "layer ids out of order": ({"stages": {"extract": {"layer_ids": [3, 1, 2]}}},
                               ["not in increasing order", "e.g. [1, 2, 3]"]),
    "tensor parallel against 4 heads / 2 KV heads": (
        {"stages": {"extract": {"backend": "vllm-server", "tensor_parallel": 3}}},
        ["tensor-parallel size 3 does not fit the target's 4 attention heads / 2 KV heads",
         "use a size in [1, 2, 4]"]),
    "requests longer than the target's positions": (
        {"stages": {"prepare": {"seq_length": 4000}}},
        ["4,008 tokens per request, more than the target's max_position_embeddings 2,048"]),
    "evaluate's answers past the positions": (
        {"stages": {"prepare": {"seq_length": 1900}, "evaluate": {"max_tokens": 400}}},
        ["seq_length + [stages.evaluate] max_tokens (+8) = 2,308"]),
    "a stage interpreter that does not run": (
        {"runtime": {"python": "/bin/false"}},
        ["[runtime] python = '/bin/false' is not a working Python 3.10+ (exit 1)"]),
    "a draft vocabulary larger than the target's": (
        {"stages": {"vocab": {"draft_vocab_size": 32000}}},
        ["draft_vocab_size 32,000 is larger than the target's vocabulary (1,024 tokens)"]),
    # (parsing the config never asks NVML; this check does: "no NVIDIA driver / GPU
    # found, but [gpus] devices = [99]" here, "names GPU [99] but this machine has N"
    # on a GPU server)
    "a GPU this machine does not have": ({"gpus": {"devices": [99]}}, ["[gpus] devices", "[99]"]),
}


def kimi_folder(tmp_path):
    """Kimi-K2.5's config.json (auto_map: custom code) as a target folder."""
    d = tmp_path / "kimi"
    d.mkdir()
    shutil.copy(CONFIGS / "kimi-k2.5.json", d / "config.json")
    return d


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_run_refuses_before_creating_anything(tmp_path, stagekit, case):
    extra, said = REFUSED[case]
    stagekit(extra=extra)
    p = cli("run", cwd=tmp_path, check=2)
    for words in said:
        assert words in p.stderr
    assert "[ BLOCK ]" in p.stderr and "nothing was started" in p.stderr
    assert not (tmp_path / "runs").exists()


def test_data_that_holds_nothing_is_refused(tmp_path, stagekit):
    """[data] path naming a folder with no saved dataset, or an empty file: refused
    at the launch, with what a dataset folder holds (it used to launch, and fail in
    prepare)."""
    (tmp_path / "empty-folder").mkdir()
    (tmp_path / "empty.jsonl").write_text("")
    for path, said in (("empty-folder", "is a folder with no dataset in it"),
                       ("empty.jsonl", "is an empty file")):
        stagekit(extra={"data": {"path": path}})
        p = cli("run", cwd=tmp_path, check=2)
        assert said in p.stderr and "save_to_disk" in p.stderr, p.stderr
        assert not (tmp_path / "runs").exists()


def test_a_remote_code_target_with_the_flag_off(tmp_path, stagekit):
    stagekit(extra={"model": {"target": str(kimi_folder(tmp_path))},
                    "stages": {"extract": {"layer_ids": [2, 30, 58]},
                               "vocab": {"draft_vocab_size": 32000}}})
    p = cli("run", cwd=tmp_path, check=2)
    assert "auto_map (custom code) and [model] trust_remote_code = false" in p.stderr
    assert "set [model] trust_remote_code = true" in p.stderr
    assert not (tmp_path / "runs").exists()


def test_a_warning_does_not_block(tmp_path, stagekit):
    stagekit(extra={"stages": {"evaluate": {"num_speculative_tokens": 5}}})
    cli("run", "--wait", cwd=tmp_path, check=0)


def test_an_existing_run_is_left_untouched_and_skip_checks_is_logged(tmp_path, stagekit):
    stagekit()
    cli("run", "--wait", cwd=tmp_path, check=0)
    run = tmp_path / "runs" / "t"
    before = tree(run)
    # the same run with a config that cannot work: refused, the run as it was
    stagekit(extra={"stages": {"extract": {"layer_ids": [1, 1, 99]}}})
    cli("run", "--force", cwd=tmp_path, check=2)
    assert tree(run) == before
    # an expert launches anyway: said in the run's log; then resume (the frozen
    # config is the bad one) is refused without touching the run
    p = cli("run", "--force", "--skip-checks", "--wait", cwd=tmp_path, check=0)
    assert "prepare" in p.stdout
    log = (run / "driver.log").read_text()
    assert "launched with --skip-checks over doctor's blocking findings: layers:" in log
    before = tree(run)
    p = cli("resume", cwd=tmp_path, check=2)
    assert "lists layer 1 twice" in p.stderr
    assert tree(run) == before


async def test_the_panels_r_shows_the_blocking_lines(tmp_path, stagekit):
    stagekit(extra={"stages": {"extract": {"backend": "vllm-server", "tensor_parallel": 3}}})
    app = PanelApp(None, tmp_path / "config.toml", runs_dir=tmp_path / "runs",
                   telemetry=Telemetry(simulate=0))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("r")
        await until(pilot, lambda: hasattr(app.screen, "report_text"), what="the doctor's report")
        report = app.screen.report_text()
        assert "nothing was started" in report
        assert "tensor-parallel size 3 does not fit" in report and "BLOCK" in report
        await pilot.press("escape")
        assert not (tmp_path / "runs").exists()


def test_owned_server_flags_only_on_purpose_and_then_doctor_warns(tmp_path, stagekit):
    """`--host 0.0.0.0` in server_args is refused (the config names the key
    and the way to mean it); with override_server_flags = true it launches,
    and doctor's launch checks warn about it."""
    from pipeline import config as config_mod
    from pipeline import doctor
    args = {"server_args": ["--host", "0.0.0.0", "--port=8000"]}
    stagekit(extra={"stages": {"evaluate": args}})
    p = cli("run", cwd=tmp_path, check=2)
    assert "stages.evaluate.server_args" in p.stderr and "override_server_flags" in p.stderr
    assert not (tmp_path / "runs").exists()
    cfg_path = stagekit(extra={"stages": {"evaluate": {**args, "override_server_flags": True}}})
    cfg = config_mod.load(cfg_path)
    warned = [f for f in doctor.launch_findings(cfg) if f.area == "privacy"]
    assert [f.level for f in warned] == [doctor.WARN, doctor.WARN], warned
    assert "--host" in warned[0].message and "--port=8000" in warned[1].message

