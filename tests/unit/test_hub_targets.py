"""Targets named by a Hugging Face hub id ("ORG/NAME", [model] revision),
resolved through huggingface_hub's own cache, offline, with no network:

- a cache laid out as huggingface_hub lays it out (models--ORG--NAME/{refs/main,
  snapshots/<sha>/..., blobs/...}) holding the built-in target, pointed at by
  HF_HUB_CACHE with HF_HUB_OFFLINE=1: the real pipeline through
  `eagle-panel run --wait` (hf backend; regenerate and evaluate off);
- a resume after `main` moved to a new snapshot keeps the commit the run
  started with; a removed snapshot is a clear error with the `hf download`
  that restores it;
- a missing id, a missing revision, a snapshot with no weights: refused with
  exit 2 before a run directory exists;
- [model] download = true against a local stand-in for the Hub
  (tests/fakes/fake_hub.py): the download runs in the first stage, with
  progress events in bytes and files; without it nothing is ever downloaded;
- the real vLLM server on a hub id (marked vllm).

The parts in other tiers: tests/integration/test_hub_targets.py."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from tests.configs import tiny_pipeline, write
from tests.helpers import cli

REPO = "tiny-org/tiny-llama"
SHA_A = hashlib.sha1(b"snapshot A").hexdigest()
SHA_B = hashlib.sha1(b"snapshot B").hexdigest()


def target_files() -> dict[str, bytes]:
    from pipeline.builtin.tiny_model import ensure_built
    folder = ensure_built()
    return {str(p.relative_to(folder)): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def lay_out(cache: Path, repo_id: str, commit: str, files: dict[str, bytes],
            ref: str | None = "main") -> Path:
    """A snapshot as huggingface_hub stores it: content-addressed blobs,
    the snapshot's files as relative links to them, refs/<ref> = commit."""
    folder = cache / ("models--" + repo_id.replace("/", "--"))
    for name, data in files.items():
        blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            blob.write_bytes(data)
        link = folder / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if ref:
        (folder / "refs").mkdir(parents=True, exist_ok=True)
        (folder / "refs" / ref).write_text(commit)
    return folder / "snapshots" / commit


def hub_env(cache: Path, offline: bool = True, endpoint: str | None = None) -> dict:
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_DISABLE_TELEMETRY="1",
               NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    for key in ("HF_HUB_OFFLINE", "HF_ENDPOINT", "HF_TOKEN"):
        env.pop(key, None)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    if endpoint:
        env["HF_ENDPOINT"] = endpoint
    return env


def config(tmp: Path, name: str, **model) -> Path:
    tables = tiny_pipeline(name, samples=16, model={"target": REPO, **model}, stages={
        "extract": {"backend": "hf"}, "train": {"epochs": 1},
        "evaluate": {"enabled": False}})
    return write(tmp / "config.toml", tables)


@pytest.fixture
def in_cache(monkeypatch):
    """This process's huggingface_hub pointed at a cache (as HF_HUB_CACHE
    does for a new process), offline."""
    from huggingface_hub import constants

    def point(cache: Path):
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return point


# -- the pipeline on a hub id, offline ---------------------------------------


# -- refused before a run directory exists ----------------------------------

def refused(tmp: Path, cache: Path, name: str, **model):
    config(tmp, name, **model)
    p = cli("run", cwd=tmp, env=hub_env(cache))
    assert p.returncode == 2, p.stdout + p.stderr
    assert not (tmp / "runs" / name).exists()
    return p.stderr


def test_a_missing_id_is_refused_with_the_download_command(tmp_path):
    cache = tmp_path / "hf-cache"
    lay_out(cache, REPO, SHA_A, {"config.json": b"{}"})
    err = refused(tmp_path, cache, "missing", target="nobody/nothing")
    assert "has no snapshot of nobody/nothing" in err and str(cache) in err
    assert "`hf download nobody/nothing --revision main`" in err, err


def test_a_missing_revision_is_refused_naming_what_is_cached(tmp_path):
    cache = tmp_path / "hf-cache"
    lay_out(cache, REPO, SHA_A, target_files())
    err = refused(tmp_path, cache, "norev", revision="v2.0")
    assert "not revision 'v2.0'" in err and "cached: main" in err, err
    assert f"`hf download {REPO} --revision v2.0`" in err


def test_a_snapshot_without_weights_is_refused_by_the_launch_checks(tmp_path):
    cache = tmp_path / "hf-cache"
    files = {k: v for k, v in target_files().items() if not k.endswith(".safetensors")}
    lay_out(cache, REPO, SHA_A, files)
    err = refused(tmp_path, cache, "noweights")
    assert "missing what vLLM needs: weights (no *.safetensors)" in err, err
    assert f"hf download {REPO} --revision {SHA_A}" in err


def test_an_index_naming_absent_shards_and_no_tokenizer_are_named(tmp_path, in_cache):
    from pipeline import config as config_mod
    from pipeline import doctor
    cache = tmp_path / "hf-cache"
    files = {k: v for k, v in target_files().items() if not k.startswith("tokenizer")}
    files["model.safetensors.index.json"] = json.dumps({"weight_map": {
        "a": "model.safetensors", "b": "model-2.safetensors"}}).encode()
    lay_out(cache, REPO, SHA_A, files)
    in_cache(cache)
    cfg = config_mod.load(config(tmp_path, "idx"))
    lines = [f for f in doctor.launch_findings(cfg) if f.area == "model"]
    assert lines[0].level == doctor.BLOCK, lines
    assert "weight shards the index names: model-2.safetensors (1 of 2)" in lines[0].message
    assert "tokenizer files" in lines[0].message


def test_a_local_folder_and_a_path_that_exists_win_over_an_id(tmp_path, in_cache):
    from pipeline import config as config_mod
    in_cache(tmp_path / "empty-cache")
    folder = tmp_path / REPO   # a folder spelled like the id, next to the config
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    cfg = config_mod.load(config(tmp_path, "local"))
    assert cfg.target_path() == folder
    with pytest.raises(config_mod.ConfigError, match="applies to a Hugging Face id only"):
        config_mod.load(config(tmp_path, "local", revision="main"))


def test_without_huggingface_hub_the_cache_is_read_the_same_way(tmp_path, monkeypatch):
    """A panel-only environment (no huggingface_hub): the layout is read
    directly, HF_HUB_CACHE honoured."""
    import sys

    from pipeline.model import hub
    cache = tmp_path / "hf-cache"
    snap = lay_out(cache, REPO, SHA_A, target_files())
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert hub.resolve_cached(REPO, "main").path == snap
    assert hub.resolve_cached(REPO, SHA_A).commit == SHA_A
    with pytest.raises(hub.HubError, match="not revision 'v1'"):
        hub.resolve_cached(REPO, "v1")


def test_doctor_shows_the_id_revision_snapshot_size_and_files(tmp_path, in_cache):
    from pipeline import config as config_mod
    from pipeline import doctor
    cache = tmp_path / "hf-cache"
    snap = lay_out(cache, REPO, SHA_A, target_files())
    in_cache(cache)
    cfg = config_mod.load(config(tmp_path, "doc"))
    first = [f for f in doctor.launch_findings(cfg) if f.area == "model"][0]
    assert first.level == doctor.OK
    size = sum(len(v) for v in target_files().values()) / (1 << 20)
    assert f"{REPO} revision 'main' = commit {SHA_A[:12]}: {snap}, {size:,.1f} MiB on disk" \
        in first.message, first.message
    assert "every file vLLM needs is there (config.json, 1 weight file(s), tokenizer)" \
        in first.message
    # the fingerprint follows the commit, not the spelling of the revision
    pinned = config_mod.load(config(tmp_path, "doc", revision=SHA_A))
    assert pinned.fingerprint("prepare", {}) == cfg.fingerprint("prepare", {})


# -- [model] download = true, against a stand-in for the Hub ------------------

@pytest.fixture
def fake_hub():
    from tests.fakes.fake_hub import FakeHub, Repo
    files = target_files()
    repos = {REPO: Repo(files, SHA_A, {"main": SHA_A}),
             "gated-org/tiny-llama": Repo(files, SHA_B, {"main": SHA_B}, gated=True)}
    with FakeHub(repos) as hub:
        yield hub


def hub_calls(hub) -> list[tuple[str, str]]:
    return [r for r in hub.requests if r[1].startswith("/api/models") or "/resolve/" in r[1]]


def test_without_download_nothing_is_downloaded(tmp_path, fake_hub):
    cache = tmp_path / "hf-cache"
    config(tmp_path, "nodl")
    p = cli("run", cwd=tmp_path, env=hub_env(cache, offline=False, endpoint=fake_hub.url))
    assert p.returncode == 2 and f"`hf download {REPO} --revision main`" in p.stderr, p.stderr
    assert hub_calls(fake_hub) == [] and not (cache / f"models--{REPO.replace('/', '--')}").exists()


def test_download_true_names_a_gated_repository_before_any_stage(tmp_path, fake_hub):
    cache = tmp_path / "hf-cache"
    config(tmp_path, "gated", target="gated-org/tiny-llama", download=True)
    p = cli("run", cwd=tmp_path, env=hub_env(cache, offline=False, endpoint=fake_hub.url))
    assert p.returncode == 2, p.stdout + p.stderr
    assert "gated-org/tiny-llama is gated on the Hub" in p.stderr and "hf auth login" in p.stderr
    assert not (tmp_path / "runs" / "gated").exists()


# -- what a hub id gives vLLM -----------------------------------------------------

def test_a_hub_id_resolves_to_its_cached_snapshot(tmp_path, in_cache):
    """What vLLM is then given (tests/vllm/test_vllm_real.py serves such a snapshot)."""
    from pipeline import config as config_mod
    cache = tmp_path / "hf-cache"
    snap = lay_out(cache, REPO, SHA_A, target_files())
    in_cache(cache)
    cfg = config_mod.load(config(tmp_path, "served"))
    assert cfg.target_path() == snap and (snap / "model.safetensors").is_symlink()
