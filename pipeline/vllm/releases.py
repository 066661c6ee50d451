"""vLLM source releases, fetched once from the package index pip uses and
cached (never installed; read with ast through pipeline.vllm.source): for
the tests (tests/fakes/vllm_releases.py) and for
scripts/check_vllm_release.py, which judges a new release the day it lands.

Cache: per release, a zip of only the parts eagle-panel reads (KEEP: the
modules pipeline/vllm/contract.py declares, the model registry and model
code) — about a sixth of the sdist, and a zip reads any member at once where
a .tar.gz re-decompresses from its start (measured: 21 s for one release's
plan read from the tarball). The tarball is deleted once the zip is made.

`pip download --no-deps --no-binary :all: vllm==X` cannot fetch them here:
pip then builds the sdist's metadata, which needs vLLM's CUDA build
requirements (measured: it fails after 12-100 s). So this asks the index pip
is configured with for the release's .tar.gz through the same simple API
(PEP 691 JSON), checks the sha256 the index gives, and keeps the file in
.cache/vllm-src/.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import urllib.request
import zipfile
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


def index_files(project: str) -> list[dict]:
    """The files the index lists for `project` (its simple API, PEP 691 JSON)."""
    req = urllib.request.Request(f"{index_url()}/{project}/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.load(r)["files"]
    except OSError as e:
        raise Unreachable(f"the package index cannot be reached ({e})") from None


_listing: dict | None = None


def listing() -> dict[str, dict]:
    """{version: file entry} of vLLM's sdists on the index."""
    global _listing
    if _listing is None:
        _listing = {f["filename"][len("vllm-"):-len(".tar.gz")]: f for f in index_files("vllm")
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


# What the zip keeps, under vllm/ (tests/unit/test_vllm_contract.py checks that
# every declared module is inside).
KEEP = ("v1/", "config", "model_executor/models/", "models/", "engine/arg_utils.py", "envs.py",
        "compilation/decorators.py", "distributed/kv_transfer/kv_connector/v1/",
        "entrypoints/cli/main.py", "sampling_params.py", "worker/worker_base.py", "platforms/",
        "model_executor/layers/mamba/ops/cpu/", "model_executor/model_loader/reload/",
        "entrypoints/serve/dev/", "entrypoints/openai/api_server.py",
        "distributed/parallel_state.py", "model_executor/model_loader/utils.py",
        "utils/torch_utils.py", "transformers_utils/configs/speculators/",
        "model_executor/layers/rotary_embedding/base.py")


def kept(version: str) -> Path:
    """The release's zip of KEEP (made once from its sdist, which is then
    deleted; named by KEEP's digest: a zip of another KEEP is replaced)."""
    digest = hashlib.sha256(repr(KEEP).encode()).hexdigest()[:8]
    path = CACHE / f"vllm-{version}.{digest}.zip"
    if path.exists():
        return path
    # pytest-xdist's workers may want the same release at once on a cold cache:
    # one makes it, the others wait and take it (their fixed temp names and the
    # tarball one deletes would collide)
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f".vllm-{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return path if path.exists() else _make_kept(version, path)


def _make_kept(version: str, path: Path) -> Path:
    """kept()'s zip made from the sdist, under kept()'s lock."""
    tarball = sdist(version)
    prefix = f"vllm-{version}/vllm/"
    tmp = path.with_suffix(".zip.part")
    with tarfile.open(tarball) as tf, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zf:
        for member in tf:   # one sequential pass
            rel = member.name[len(prefix):] if member.name.startswith(prefix) else None
            if member.isfile() and rel and rel.endswith(".py") and rel.startswith(KEEP):
                zf.writestr(rel, tf.extractfile(member).read())
    os.replace(tmp, path)
    tarball.unlink()
    for stale in CACHE.glob(f"vllm-{version}.*.zip"):
        if stale != path:
            stale.unlink()
    return path


def from_zip(path: Path, version: str):
    from pipeline.vllm.source import VllmSource
    zf = zipfile.ZipFile(path)
    names = set(zf.namelist())

    def read(rel: str):
        return zf.read(rel).decode("utf-8", errors="replace") if rel in names else None
    return VllmSource(version, read)


def versions(project: str) -> list[str]:
    """Every version of `project` on the index (any file kind), oldest first."""
    from packaging.utils import parse_sdist_filename, parse_wheel_filename
    out = set()
    for f in index_files(project):
        name = f["filename"]
        try:
            v = parse_wheel_filename(name)[1] if name.endswith(".whl") else \
                parse_sdist_filename(name)[1]
        except ValueError:
            continue
        if not v.is_prerelease and not f.get("yanked"):
            out.add(v)
    return [str(v) for v in sorted(out)]


def release_source(version: str):
    """The release read as a VllmSource (raises Unreachable where it cannot be fetched)."""
    return from_zip(kept(version), version)
