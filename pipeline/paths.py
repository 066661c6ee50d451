"""Where eagle-panel's own files are: the project folder, its cache, the
environment vLLM gets on a CPU machine. Standard library only, imported by
everything (config, the built-in model, stages in any interpreter)."""

from __future__ import annotations

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
# The environment scripts/install.sh gives vLLM's CPU build: its pins
# (an exact torch) must not fight the panel's or speculators'.
VLLM_VENV = PROJECT_ROOT / ".venv-vllm"


def cache_dir() -> Path:
    """Built things that can be rebuilt (the built-in model, vLLM sources
    for the tests): EAGLE_PANEL_CACHE, else .cache/ in the project."""
    return Path(os.environ.get("EAGLE_PANEL_CACHE") or (PROJECT_ROOT / ".cache"))


def pythonpath_with_project(current: str | None) -> str:
    """PYTHONPATH for a child process (a stage, a vLLM server) that must
    import `pipeline` whatever its interpreter."""
    return os.pathsep.join(p for p in (str(PROJECT_ROOT), current) if p)
