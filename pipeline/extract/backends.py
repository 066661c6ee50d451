"""Which code runs an extract job: the backend's `run(job) -> Counters`
(pipeline.extract.job), for the stage on one node and for each node
worker across nodes (pipeline.extract.nodes)."""

from __future__ import annotations


def backend_runner(name: str):
    """Imported on use: vLLM's modules are never loaded by an hf run."""
    if name == "vllm-server":
        from pipeline.extract.vllm_server import run
    elif name == "vllm-engine":
        from pipeline.extract.vllm_engine import run
    else:
        from pipeline.extract.hf import run
    return run
