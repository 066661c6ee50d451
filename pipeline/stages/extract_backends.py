"""Which code runs an extract job: the backend's `run(job) -> Counters`
(pipeline.stages.extract_job), for the stage on one node and for each node
worker across nodes (pipeline.stages.extract_nodes)."""

from __future__ import annotations


def backend_runner(name: str):
    """Imported on use: vLLM's modules are never loaded by an hf run."""
    if name == "vllm-server":
        from pipeline.vllm.extract_server import run
    elif name == "vllm-engine":
        from pipeline.vllm.engine import run
    else:
        from pipeline.stages.extract_hf import run
    return run
