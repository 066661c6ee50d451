"""vLLM source releases for the tests, fetched once and cached (never
installed; read with ast through pipeline.vllm_source).

`pip download --no-deps --no-binary :all: vllm==X` cannot fetch them here:
pip then builds the sdist's metadata, which needs vLLM's CUDA build
requirements (measured: it fails after 12-100 s). So this asks the index pip
is configured with for the release's .tar.gz through the same simple API
(PEP 691 JSON), checks the sha256 the index gives, and keeps the file in
.cache/vllm-src/.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

from pipeline.paths import cache_dir

CACHE = cache_dir() / "vllm-src"


class Unreachable(Exception):
    pass


def index_url() -> str:
    url = os.environ.get("PIP_INDEX_URL")
    if not url:
        r = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"],
                           capture_output=True, text=True, check=False)
        url = r.stdout.strip() if r.returncode == 0 else ""
    if not url:
        from pip._internal.models.index import PyPI
        url = PyPI.simple_url
    return url.rstrip("/")


_listing: dict | None = None


def listing() -> dict[str, dict]:
    """{version: file entry} of vLLM's sdists on the index."""
    global _listing
    if _listing is None:
        req = urllib.request.Request(index_url() + "/vllm/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                data = json.load(r)
        except OSError as e:
            raise Unreachable(f"the package index cannot be reached ({e})") from None
        _listing = {f["filename"][len("vllm-"):-len(".tar.gz")]: f for f in data["files"]
                    if f["filename"].startswith("vllm-") and f["filename"].endswith(".tar.gz")
                    and not f.get("yanked")}
    return _listing


def newest() -> str:
    from packaging.version import InvalidVersion, Version

    def key(v):
        try:
            return Version(v)
        except InvalidVersion:
            return Version("0")
    return max((v for v in listing() if not key(v).is_prerelease), key=key)


def sdist(version: str) -> Path:
    path = CACHE / f"vllm-{version}.tar.gz"
    if path.exists():
        return path
    entry = listing().get(version)
    if entry is None:
        raise Unreachable(f"vllm {version} has no source release on the index")
    try:
        with urllib.request.urlopen(entry["url"], timeout=300) as r:
            blob = r.read()
    except OSError as e:
        raise Unreachable(f"downloading vllm-{version}.tar.gz failed ({e})") from None
    want = entry.get("hashes", {}).get("sha256")
    if want and hashlib.sha256(blob).hexdigest() != want:
        raise AssertionError(f"vllm-{version}.tar.gz: sha256 differs from the index's")
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    tmp.write_bytes(blob)
    os.replace(tmp, path)
    return path


_sources: dict = {}


def source(version: str):
    """The release read as a VllmSource (one per version for the whole test
    session: parsing its big modules is most of these tests' time); the
    calling test is skipped, with the reason, when it cannot be fetched."""
    import pytest

    from pipeline.vllm.source import VllmSource
    if version not in _sources:
        try:
            _sources[version] = VllmSource.from_sdist(sdist(version))
        except Unreachable as e:
            pytest.skip(f"vLLM source release {version} unavailable: {e}")
    return _sources[version]
