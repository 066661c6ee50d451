"""Test tiers are folders (README "Tests", docs/testing.md): `tests/unit` (no
stage process, no model: the inner loop), `tests/integration` (real stages,
the real panel, real processes), `tests/vllm` (a real vLLM; skipped with the
reason when none is installed), `tests/cluster` (Slurm, namespaces) and
`tests/bench` (every bench/ script at its smallest size). Each test gets its
folder's marker (`fast` for unit), so `pytest -m fast` and `pytest tests/unit`
are the same tests; a test that needs a GPU is marked `gpu` and skipped
without one. pyproject's addopts
run the files on three pytest-xdist workers (`-n 0` runs them in this process):
on 2 cores, two workers left the CPU idle while their tests waited on servers
starting and processes ending; a third fills that (24 min 41 s against 27 min
36 s for the whole suite, the same machine and hour, 2026-12-05)."""

import os
import sys
import tempfile

import pytest

from tests.helpers import ROOT, stagekit_config
from tests.timing import tier_of

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("PYTHONUNBUFFERED", "1")
# Three test workers on 2 cores: OpenMP threads that wait by sleeping, not spinning (seen:
# tiny-kimi built by two tests at once, beside a training, over 12 CPU-minutes each
# instead of ~1.5; spinning pools sharing cores are the usual cause). OpenMP reads it
# when it starts: in every process the tests start too.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The tests' vLLM starts are not the project's history of starts (what a user's next
# start of a target is told to expect: pipeline.vllm.start_history): their own file.
os.environ.setdefault("EAGLE_PANEL_START_HISTORY", os.path.join(
    tempfile.gettempdir(), f"eagle-panel-test-starts-{os.getuid()}.jsonl"))


def pytest_configure(config):
    """Seconds by tier and the slowest tests at the end of the run (tests/timing.py),
    on the controller only: it receives every worker's reports."""
    if not hasattr(config, "workerinput"):
        from tests.timing import Timing
        config.pluginmanager.register(Timing(), "eagle-panel-timing")


@pytest.fixture
def stagekit(tmp_path):
    def make(actions=None, extra="", name="t"):
        return stagekit_config(tmp_path, actions, extra, name)
    return make


# The marker each tier's folder gives its tests (`-m fast` is `tests/unit`).
FOLDER_MARKER = {"unit": pytest.mark.fast, "integration": pytest.mark.integration,
                 "vllm": pytest.mark.vllm, "cluster": pytest.mark.cluster,
                 "bench": pytest.mark.bench}


def pytest_collection_modifyitems(config, items):
    gpu = _has_gpu()
    for item in items:
        if "gpu" in item.keywords and not gpu:
            item.add_marker(pytest.mark.skip(reason="no NVIDIA GPU/driver on this machine"))
        item.add_marker(FOLDER_MARKER[tier_of(item.nodeid)])
    # pytest-xdist hands out whole files (`--dist loadfile`: a module's fixtures, e.g. a
    # whole pipeline run, are made once) in this order (`--no-loadscope-reorder`): the
    # longest first, then the other files with real-vLLM tests, so that short files fill
    # the end instead of one long file running alone. A stable sort: each file keeps its
    # own order; identical on every worker.
    heavy = {item.path for item in items if "vllm" in item.keywords}

    def rank(item) -> tuple[int, int]:
        name = item.path.name
        return (0, LONGEST.index(name)) if name in LONGEST else (1 + (item.path not in heavy), 0)
    items.sort(key=rank)


# The longest files (seconds on one of two busy workers, a fresh clone, 2026-12-02
# afternoon): every bench script ~560, online training ~380, the tiny-llama pipeline ~280,
# Slurm ~260 (~470-560 since it runs on two namespaced nodes, 2026-12-04), the tiny-kimi
# pipeline ~220, the shared server ~160. Only the order depends on it: a stale list costs
# time, never a result.
LONGEST = ["test_bench.py", "test_slurm.py", "test_vllm_online.py", "test_vllm_pipeline.py",
           "test_kimi_pipeline.py", "test_shared_server.py"]


def _has_gpu() -> bool:
    try:
        import pynvml
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:  # noqa: BLE001 - no library, no driver, any NVML error: no GPU
        return False
