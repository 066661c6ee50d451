"""`eagle-panel doctor` on the tiny model and on the config.json of real
large models (Llama-3.1-8B, Qwen3-30B-A3B, Kimi-K2.5 with its MLA decoder
under text_config), with KV-cache and disk figures computed by hand.

The integration tier's part of tests/unit/test_doctor.py."""

import json
import os
import subprocess
import sys

from tests.configs import write
from tests.helpers import ROOT


def test_doctor_cli_on_the_tiny_model(tmp_path):
    write(tmp_path / "config.toml", {"stages": {"extract": {"layer_ids": [1, 2, 3]},
                                                "vocab": {"draft_vocab_size": 256}}})
    r = subprocess.run([sys.executable, "-m", "app.cli", "--config", str(tmp_path / "config.toml"),
                        "doctor", "--json"], capture_output=True, text=True, cwd=tmp_path,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["ok"] is True
    msgs = {f["area"]: f["message"] for f in report["findings"]}
    assert "4 layers, hidden 128" in msgs["model"]
    assert "2.0 KiB/token" in msgs["disk"]            # 4 layers x 128 x 4 B (fp32 on CPU) + 8
    # the plan's figures beside its sentence (pipeline.run.plans.DiskPlan)
    disk = report["plans"]["disk"]
    assert (disk["layers"], disk["bytes_per_token"], disk["stored"]) == (4, 4 * 128 * 4 + 8,
                                                                         "float32")
    assert f"{disk['tokens']:,} tokens" in msgs["disk"] and disk["need_bytes"] < disk["room_bytes"]
    assert "usable extract backends: hf" in msgs["backends"]
    r = subprocess.run([sys.executable, "-m", "app.cli", "--config", str(tmp_path / "config.toml"),
                        "doctor"], capture_output=True, text=True, cwd=tmp_path,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300, check=False)
    assert "ready to launch" in r.stdout


def test_doctor_reads_installed_vllm_without_importing_it(tmp_path):
    """A stand-in installed vLLM whose import would leave a marker file: doctor
    must take its version from the metadata and EAGLE-3 support from the source."""
    site = tmp_path / "site"
    pkg = site / "vllm"
    (pkg / "model_executor/models").mkdir(parents=True)
    marker = tmp_path / "imported"
    (pkg / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (pkg / "model_executor/models/registry.py").write_text(
        '_TEXT_GENERATION_MODELS = {"LlamaForCausalLM": ("llama", "LlamaForCausalLM")}\n')
    (pkg / "model_executor/models/llama.py").write_text(
        "class LlamaForCausalLM(nn.Module, SupportsLoRA, SupportsPP, SupportsEagle3):\n"
        "    pass\n")
    dist = site / "vllm-0.22.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.22.0\n")
    write(tmp_path / "config.toml",
          {"stages": {"extract": {"layer_ids": [1, 2, 3], "backend": "vllm-server"}}})
    r = subprocess.run([sys.executable, "-m", "app.cli", "--config", str(tmp_path / "config.toml"),
                        "doctor", "--json"], capture_output=True, text=True, cwd=tmp_path,
                       env=dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{site}"), timeout=300,
                       check=False)
    report = json.loads(r.stdout)
    msgs = {f["area"]: f for f in report["findings"]}
    assert "vLLM 0.22.0" in msgs["environment"]["message"]
    assert msgs["eagle3"]["level"] == "ok" and "implements SupportsEagle3" in msgs["eagle3"]["message"]
    # A GPU build of vLLM and no GPU on this machine: blocking, with the way out.
    assert msgs["backends"]["level"] == "blocking" and r.returncode == 1
    assert "GPU build" in msgs["backends"]["message"] and "vllm-server" in msgs["backends"]["message"]
    assert not marker.exists()
