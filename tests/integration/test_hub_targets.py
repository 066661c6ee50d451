"""Targets named by a Hugging Face hub id ("ORG/NAME", [model] revision),
resolved through huggingface_hub's own cache, offline, with no network:

The integration tier's part of tests/unit/test_hub_targets.py."""

from __future__ import annotations

import shutil

import pytest

from pipeline.run.events import read_events
from pipeline.run.rundir import RunDir
from tests.helpers import cli
from tests.unit.test_hub_targets import (  # noqa: F401 - fixtures, used by name
    REPO,
    SHA_A,
    SHA_B,
    config,
    fake_hub,
    hub_calls,
    hub_env,
    in_cache,
    lay_out,
    target_files,
)


@pytest.fixture(scope="module")
def hub_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hub")
    cache = tmp / "hf-cache"
    snap_a = lay_out(cache, REPO, SHA_A, target_files())
    cfg = config(tmp, "hub")
    p = cli("run", "--wait", cwd=tmp, env=hub_env(cache), timeout=900)
    return {"tmp": tmp, "cache": cache, "cfg": cfg, "snap_a": snap_a, "run": p,
            "rd": RunDir(tmp / "runs" / "hub")}


def test_the_pipeline_runs_on_a_hub_id_from_the_cache_offline(hub_run):
    p, rd = hub_run["run"], hub_run["rd"]
    assert p.returncode == 0, p.stdout + p.stderr
    state = rd.read_state()
    assert state["target"] == {"repo_id": REPO, "revision": "main", "commit": SHA_A,
                               "path": str(hub_run["snap_a"])}
    statuses = {s: st["status"] for s, st in state["stages"].items()}
    assert statuses == {"regenerate": "skipped", "prepare": "succeeded",
                        "extract": "succeeded", "vocab": "succeeded", "train": "succeeded",
                        "evaluate": "skipped"}, statuses
    # speculators was given the snapshot's folder as its verifier
    command = (rd.out_dir("train") / "checkpoints" / "train_command.txt").read_text()
    assert f"--verifier-name-or-path {hub_run['snap_a']} " in command, command


def test_a_resume_after_main_moved_keeps_the_commit_the_run_started_with(hub_run, in_cache):  # noqa: F811 - the fixture imported above
    from pipeline import control
    from pipeline.drive import driver
    from pipeline.drive.stage_context import load_context
    assert hub_run["run"].returncode == 0
    tmp, cache, rd = hub_run["tmp"], hub_run["cache"], hub_run["rd"]
    files = target_files()
    files["generation_config.json"] = b'{"do_sample": false, "moved": "on"}\n'
    snap_b = lay_out(cache, REPO, SHA_B, files)   # `main` is B now

    p = cli("resume", "hub", cwd=tmp, env=hub_env(cache))
    assert p.returncode == 0 and "everything is up to date" in p.stdout, p.stdout + p.stderr

    in_cache(cache)
    frozen = driver.load_run_config(rd)
    assert frozen.target_path() == hub_run["snap_a"]
    ctx = load_context("vocab", ["--run-dir", str(rd.path)])   # what a stage process gets
    assert ctx.cfg.target_path() == hub_run["snap_a"]
    ctx.events.close()
    # a new `run` is the config as it is now: B, and what reads the target runs again
    now = control.load_config(str(hub_run["cfg"]))
    assert now.target_path() == snap_b
    steps = {s.stage: s for s in driver.plan(now, rd.read_state())}
    assert steps["prepare"].action == "run" and "fingerprint" in steps["prepare"].why
    assert all(steps[s].action == "run" for s in ("extract", "vocab", "train"))


def test_a_removed_snapshot_is_a_clear_error(hub_run):
    assert hub_run["run"].returncode == 0
    tmp, cache, rd = hub_run["tmp"], hub_run["cache"], hub_run["rd"]
    before = rd.state_path.read_bytes()
    shutil.rmtree(hub_run["snap_a"])
    p = cli("resume", "hub", cwd=tmp, env=hub_env(cache))
    assert p.returncode == 2, p.stdout + p.stderr
    assert "is gone from the Hugging Face cache" in p.stderr
    assert f"hf download {REPO} --revision {SHA_A}" in p.stderr, p.stderr
    assert rd.state_path.read_bytes() == before   # nothing was started


def test_download_true_downloads_in_the_first_stage_with_progress(tmp_path, fake_hub):  # noqa: F811 - the fixture imported above
    cache = tmp_path / "hf-cache"
    config(tmp_path, "dl", download=True)
    env = hub_env(cache, offline=False, endpoint=fake_hub.url)
    p = cli("run", "--wait", "--stage", "prepare", cwd=tmp_path, env=env, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    rd = RunDir(tmp_path / "runs" / "dl")
    snap = cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / SHA_A
    assert rd.read_state()["target"]["commit"] == SHA_A
    assert (snap / "model.safetensors").read_bytes() == target_files()["model.safetensors"]
    assert (snap.parent.parent / "refs" / "main").read_text() == SHA_A
    events = read_events(rd.events_path("prepare"))
    got = [e for e in events if e["type"] == "progress" and e.get("what") == "download"]
    units = {e["unit"] for e in got}
    assert units == {"bytes", "files"}, got
    total = sum(len(v) for v in target_files().values())
    assert {"done": total, "total": total} == {k: got[-2][k] for k in ("done", "total")}
    assert got[-1]["done"] == got[-1]["total"] == len(target_files())
    # the download came before the stage's own work
    first_other = next(i for i, e in enumerate(events)
                       if e["type"] == "progress" and e.get("what") != "download")
    assert max(events.index(e) for e in got) < first_other
    assert any(path.endswith("/model.safetensors") for _, path in hub_calls(fake_hub))
