"""A disk that fills, for real: the run directory on a size-limited tmpfs
mounted by the test (root can; skipped with the reason where the sandbox
refuses mounts). Each case ends with the space freed and the run resumed to
the end, nothing half-written left where a later step trusts it."""

import json
import os
import subprocess
import sys

import pytest

from pipeline.model import hsfile
from pipeline.run.events import read_events
from pipeline.run.rundir import RunDir
from tests.configs import write
from tests.helpers import ROOT, cli, stagekit_config, wait_for

MiB = 1 << 20


class SmallDisk:
    def __init__(self, path, size_mib: int):
        self.path = path
        path.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(path)],
                           capture_output=True, text=True, check=False)
        if r.returncode:
            pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.strip() or r.returncode}")

    def resize(self, size_mib: int):
        subprocess.run(["mount", "-o", f"remount,size={size_mib}m", str(self.path)], check=True)

    def fill(self) -> int:
        """Fill what is left with a file (the other job that filled the disk)."""
        fd = os.open(self.path / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        total = 0
        try:
            while True:
                total += os.write(fd, b"\0" * 4096)
        except OSError:
            return total
        finally:
            os.close(fd)

    def unmount(self):
        subprocess.run(["umount", "-l", str(self.path)], check=False)


@pytest.fixture
def small_disk(tmp_path):
    disks = []

    def make(size_mib):
        disks.append(SmallDisk(tmp_path / "disk", size_mib))
        return disks[-1]
    yield make
    for d in disks:
        d.unmount()


def test_extract_and_train_stop_cleanly_on_a_full_disk_and_resume(tmp_path, small_disk):
    """3 MiB: extract stops before the disk fills (exit 4, the path, what is
    free), the files it wrote are whole. 6 MiB: extract finishes, train
    refuses a checkpoint that cannot fit instead of leaving half of one.
    64 MiB: resume ends the run."""
    disk = small_disk(3)
    write(tmp_path / "config.toml", {
        "run": {"name": "d", "runs_dir": str(disk.path)},
        "data": {"max_samples": 24},
        "stages": {"extract": {"backend": "hf", "layer_ids": [1, 2, 3], "min_free_gb": 0.0},
                   "vocab": {"draft_vocab_size": 224}, "train": {"epochs": 1},
                   "evaluate": {"enabled": False}}})
    rd = RunDir(disk.path / "d")
    p = cli("run", "--wait", cwd=tmp_path, timeout=600, check=4)
    assert "[extract] ERROR: stopped before the disk fills" in p.stdout
    assert f"free at {rd.out_dir('extract')}" in p.stdout and "resume" in p.stdout
    err = [e for e in read_events(rd.events_path("extract")) if e["type"] == "error"][-1]
    assert err.get("disk_full") is True
    files = sorted((rd.out_dir("extract") / "hidden_states").glob("*"))
    assert all(hsfile.validate_file(f) is None for f in files), files   # whole, or not there

    disk.resize(6)
    p = cli("resume", "--wait", cwd=tmp_path, timeout=600, check=4)
    assert "[extract] succeeded" in p.stdout
    assert "[train] ERROR: no space left on the disk of" in p.stdout
    assert "checkpoint 0 needs about" in p.stdout and "resume" in p.stdout
    ckpts = rd.out_dir("train") / "checkpoints"
    assert not [d for d in ckpts.iterdir() if d.name.isdigit()], "half a checkpoint left"

    disk.resize(64)
    p = cli("resume", "--wait", cwd=tmp_path, timeout=600, check=0)
    assert "[extract] started" not in p.stdout   # finished work kept
    state = json.loads(rd.state_path.read_text())
    assert all(st["status"] in ("succeeded", "skipped") for st in state["stages"].values())
    assert (ckpts / "0" / "training_state.json").exists()


def test_a_full_disk_under_state_and_events(tmp_path, small_disk):
    """The disk fills while a stage runs (another job): its end cannot be
    recorded, the next stage cannot start. No traceback, no corrupt
    state.json: `run --wait` exits 4 saying so, `status` reads the run, and
    once space is freed `resume` finishes it."""
    disk = small_disk(2)
    stagekit_config(tmp_path, {"vocab": "sleep:4"}, {"run": {"runs_dir": str(disk.path)}})
    watcher = subprocess.Popen([sys.executable, "-m", "app.cli", "run", "--wait"], cwd=tmp_path,
                               env=dict(os.environ, PYTHONPATH=str(ROOT)), text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    rd = RunDir(disk.path / "t")
    wait_for(lambda: rd.is_run() and any(e["type"] == "progress" for e in
                                         read_events(rd.events_path("vocab"))),
             timeout=60, what="vocab running")
    disk.fill()
    out, _ = watcher.communicate(timeout=120)
    assert watcher.returncode == 4, out
    assert "no space left on the disk of" in out and "resume" in out and "Traceback" not in out
    # the supervisor could not record the end (it says why in the stage's log
    # when that still fits): no crash dump either way
    assert "Traceback" not in rd.log_path("vocab").read_text()
    p = cli("status", cwd=tmp_path, check=0)
    assert "Traceback" not in p.stdout + p.stderr
    # failed, or (when its own last events still fitted in the file's last
    # page) succeeded by its own word; nothing after it ran
    vocab_row = p.stdout.split("\nvocab", 1)[1].splitlines()[0]
    assert "failed" in vocab_row or "succeeded" in vocab_row, p.stdout
    assert "train      pending" in p.stdout, p.stdout
    json.loads(rd.state_path.read_text())   # whole: the old content or the new
    (disk.path / "filler").unlink()
    p = cli("resume", "--wait", cwd=tmp_path, timeout=120, check=0)
    state = rd.read_state()
    assert all(st["status"] == "succeeded" for st in state["stages"].values()), state
