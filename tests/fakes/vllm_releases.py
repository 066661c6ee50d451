"""vLLM source releases for the tests: pipeline/vllm/releases.py's, one
VllmSource per version for the whole test session (parsing a release's big
modules is most of these tests' time), and a test that cannot fetch one is
skipped with the reason."""

from __future__ import annotations

import pytest

from pipeline.vllm.releases import KEEP, Unreachable, newest, release_source, versions

__all__ = ["KEEP", "Unreachable", "newest", "source", "versions"]

_sources: dict = {}


def source(version: str):
    """The release read as a VllmSource, once per session."""
    if version not in _sources:
        try:
            _sources[version] = release_source(version)
        except Unreachable as e:
            pytest.skip(f"vLLM source release {version} unavailable: {e}")
    return _sources[version]
