"""The MLA EAGLE-3 draft (pipeline.train.mla_draft, pipeline.train.mla_layer):
`[stages.train] draft_layer`, the draft decoder config derived from an MLA
target, training with speculators' own trainer, the checkpoint reloaded by
speculators, and the vLLM export checked against vLLM's math. That export
served by the real vLLM (CPU build) beside an MLA target, speculative
decoding running: tests/vllm/test_kimi_pipeline.py, on builtin:tiny-kimi.

The vllm tier's part of tests/unit/test_mla_draft.py."""

from __future__ import annotations

import json

import pytest

from pipeline.paths import VLLM_VENV
from tests.unit.test_mla_draft import TARGET


def test_auto_on_this_machine_with_its_vllm(tmp_path):
    """The train stage's own resolution, with the real probe of .venv-vllm."""
    from types import SimpleNamespace

    from pipeline.stages.train import resolve_draft_layer
    from pipeline.vllm.environment import probe
    py = VLLM_VENV / "bin" / "python"
    env = probe(str(py)) if py.exists() else None
    if env is None or not env.dist:
        pytest.skip(f"no vLLM in {VLLM_VENV}")
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **TARGET}))
    ctx = SimpleNamespace(section=SimpleNamespace(draft_layer="auto", algorithm="eagle3"),
                          cfg=SimpleNamespace(target_path=lambda: tmp_path,
                                              vllm_python=lambda: str(py)))
    choice = resolve_draft_layer(ctx)
    assert choice.layer == ("mla" if env.cpu_build else "llama"), choice
