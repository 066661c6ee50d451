"""A hybrid target (linear attention on half its layers) through extract on
the real vLLM of this machine: a tiny Qwen3-Next (tests/fakes/tiny_qwen3_next.py)
served by vLLM 0.32's CPU build, whose gated-delta-net path runs in bf16 only.

What this shows that the doctor tests cannot: the server eagle-panel starts
for such a target comes up (prefix caching off: vLLM's CPU build cannot cache
prefixes of recurrent state), the connector captures the aux layers of a model
whose layers are not all attention, and the files hold the same hidden states
as transformers' forward on the same weights (bf16 on both sides, other
kernels: a few percent, where a wrong layer or position is off by tens)."""

import json

import pytest
import torch

from pipeline.vllm import contract_strings as vs
from tests.configs import render
from tests.helpers import finished, hs_files, prepared_once, run_body

N = 8
LAYERS = [1, 2, 3]


@pytest.fixture(scope="module")
def hybrid(vllm_env, tmp_path_factory):   # vllm_env: tests/vllm/conftest.py
    from pipeline.stages import extract
    from tests.fakes.tiny_qwen3_next import build
    target = build(tmp_path_factory.mktemp("qwen3_next") / "model")
    config = render({
        "model": {"target": str(target), "dtype": "bfloat16"},
        "data": {"max_samples": N},
        "stages": {"prepare": {"seq_length": 256},
                   "extract": {"backend": "vllm-server", "layer_ids": LAYERS}}})
    tmp, rd = prepared_once(tmp_path_factory, "hybrid", config)
    code, rd, events = run_body(tmp, "extract", extract.body, config)
    return {"target": target, "rd": rd, "code": code, "events": events}


def test_a_hybrid_target_extracts_through_the_real_vllm(hybrid):
    from datasets import load_from_disk
    from safetensors.torch import load_file

    from pipeline.extract.hf import HFBackend
    rd = hybrid["rd"]
    assert hybrid["code"] == 0, [e for e in hybrid["events"] if e["type"] in ("error", "warning")]
    summary = finished(hybrid["events"])["summary"]
    assert summary["backend"] == "vllm-server" and len(hs_files(rd)) == N
    servers = json.loads((rd.stage_dir("extract") / "provenance.json").read_text())["servers"]
    assert servers and all(vs.FLAG_NO_PREFIX_CACHING in s["command"] for s in servers), servers
    ds = load_from_disk(str(rd.out_dir("prepare") / "data")).with_format(None)
    from tests.fakes.tiny_qwen3_next import LAYER_TYPES
    # the aux layers and the last one's output, as vLLM's extraction adds it
    ref = HFBackend.load(hybrid["target"], [*LAYERS, len(LAYER_TYPES)], "cpu", torch.bfloat16)
    worst, shifted = [0.0] * (len(LAYERS) + 1), float("inf")
    for i in range(N):
        got = load_file(str(hs_files(rd)[i]))
        ids = ds[i]["input_ids"]
        assert got["token_ids"].tolist() == ids
        have, want = got["hidden_states"].float(), ref.forward([ids])[0].float()
        assert have.shape == want.shape, (have.shape, want.shape)
        for k in range(have.shape[1]):
            err = ((have[:, k] - want[:, k]).norm() / want[:, k].norm()).item()
            worst[k] = max(worst[k], err)
        # the same comparison one layer off: what a wrong layer index would give
        shifted = min(shifted, ((have[:, 0] - want[:, 1]).norm() / want[:, 1].norm()).item())
    print("hybrid target, real vLLM vs hf, relative error per layer:",
          " ".join(f"{e:.2%}" for e in worst), f"(one layer off: {shifted:.0%})")
    assert max(worst) < 0.05 and shifted > 0.2, (worst, shifted)
