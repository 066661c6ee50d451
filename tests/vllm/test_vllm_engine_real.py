"""The vllm-engine backend against a real vLLM 0.16 (its CPU build, in
.venv-vllm016: `scripts/install.sh --vllm016`, 8 GB, so not in CI; skipped
with the reason without it). The stage runs in that interpreter, drives
vLLM's own scheduler and workers with the capture extension, and its files
are compared with the hf backend's; the adaptations that fired are the ones
doctor predicts from the same vLLM's source."""

import os
import subprocess
import sys

import pytest
import torch

from pipeline.paths import PROJECT_ROOT
from pipeline.run.events import read_events
from tests.configs import render
from tests.helpers import ROOT, finished, hs_files, prepared_once

pytestmark = pytest.mark.vllm016
PY = PROJECT_ROOT / ".venv-vllm016" / "bin" / "python"
N = 16


@pytest.fixture(scope="module")
def extracted(tmp_path_factory):
    if not PY.exists():
        pytest.skip("no vLLM 0.16 here: `scripts/install.sh --vllm016` makes .venv-vllm016")
    config = render({
        "runtime": {"python": str(PY), "vllm_python": str(PY),
                    "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}},
        "data": {"max_samples": N},
        "stages": {"extract": {"backend": "vllm-engine", "layer_ids": [0, 2, 3],
                               "batch_tokens": 256, "max_num_seqs": 4}}})
    tmp, rd = prepared_once(tmp_path_factory, "engine016", config)
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_CPU_KVCACHE_SPACE="1")
    p = subprocess.run([str(PY), "-m", "pipeline.stages.extract", "--run-dir", str(rd.path),
                        "--config", str(tmp / "config.toml")], env=env, capture_output=True,
                       text=True, timeout=900)
    return tmp, rd, p


def test_engine_route_on_real_vllm_016_writes_the_hf_numbers(extracted):
    from datasets import load_from_disk
    from safetensors.torch import load_file

    from pipeline.builtin.tiny_model import ensure_built
    from pipeline.extract.hf import HFBackend
    tmp, rd, p = extracted
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert len(hs_files(rd)) == N
    ds = load_from_disk(str(rd.out_dir("prepare") / "data")).with_format(None)
    ref = HFBackend.load(ensure_built(), [0, 2, 3, 4], "cpu", torch.float32)
    worst = 0.0
    for i in range(N):
        got = load_file(str(rd.out_dir("extract") / f"hidden_states/hs_{i}.safetensors"))
        assert got["token_ids"].tolist() == ds[i]["input_ids"]
        worst = max(worst, (got["hidden_states"] - ref.forward([ds[i]["input_ids"]])[0])
                    .abs().max().item())
    print(f"vLLM 0.16 engine route vs hf: max abs difference {worst:.2e}")
    assert worst < 1e-4


def test_engine_adaptations_that_fired_are_the_predicted_ones(extracted):
    from pipeline import config as config_mod
    from pipeline import doctor
    tmp, rd, _ = extracted
    summary = finished(read_events(rd.events_path("extract")))["summary"]
    cfg = config_mod.load(tmp / "config.toml")
    findings = doctor.diagnose(cfg, gpus=None)
    predicted = {f.key for f in findings if f.area == "compat" and f.key}
    assert summary["backend"] == "vllm-engine"
    assert set(summary["adaptations"]) == predicted, (summary["adaptations"], predicted)
    assert sys.executable   # the panel's interpreter ran doctor; the stage ran in vLLM's
