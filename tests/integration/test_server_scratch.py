"""A vLLM server's temporary files in a folder of its own (pipeline.vllm.scratch):
vLLM leaves its IPC sockets and torch.distributed's file store in the
temporary directory when its processes are signalled. Here a stand-in command
started the way VllmServer starts vLLM; that the real vLLM puts its sockets
there: tests/vllm/test_vllm_real.py."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from pipeline.vllm import scratch
from pipeline.vllm.server import VllmServer
from tests.helpers import wait_for

# what vLLM does with its temporary directory: a socket at VLLM_RPC_BASE_PATH (here a
# plain file: a test's folder is deeper than a socket's path allows), a file store in
# TMPDIR (vllm/utils/network_utils.py), then it serves
STAND_IN = textwrap.dedent("""\
    import json, os, sys, tempfile, time
    open(os.path.join(os.environ["VLLM_RPC_BASE_PATH"], "0c49f3d0-ipc"), "w").close()
    tempfile.mkstemp(prefix="vllm_dist_")
    keys = ("TMPDIR", "VLLM_RPC_BASE_PATH", "TORCHINDUCTOR_CACHE_DIR")
    with open(sys.argv[1] + ".tmp", "w") as f:
        json.dump({k: os.environ.get(k) for k in keys}, f)
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(600)
    """)


def stand_in(tmp_path, out):
    return VllmServer(0, [sys.executable, "-c", STAND_IN, str(out)], 1, "k", [],
                      tmp_path / "server.log", {})


@pytest.fixture
def short_tmp(monkeypatch):
    """A temporary directory short enough for a socket path (a test's own folder
    is too deep: the folder would leave vLLM's sockets where vLLM puts them)."""
    short = Path(tempfile.mkdtemp(prefix="ep-t-", dir="/tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(short))
    yield short
    shutil.rmtree(short, ignore_errors=True)


def test_a_server_keeps_its_temporary_files_in_a_folder_removed_at_its_stop(short_tmp,
                                                                             monkeypatch):
    tmp_path = short_tmp
    for var in ("VLLM_RPC_BASE_PATH", "TORCHINDUCTOR_CACHE_DIR", "TMPDIR"):
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / "env.json"
    server = stand_in(tmp_path, out)
    server.start()
    try:
        wait_for(lambda: out.exists() or server.proc.poll() is not None, timeout=60,
                 what="the stand-in server's environment")
        assert out.exists(), (tmp_path / "server.log").read_text()
        seen = json.loads(out.read_text())
        folder = server.scratch
        assert folder.parent == tmp_path and folder.name.startswith(scratch.PREFIX)
        assert seen["TMPDIR"] == seen["VLLM_RPC_BASE_PATH"] == str(folder)
        # torch's compile cache stays where every start finds it
        assert seen["TORCHINDUCTOR_CACHE_DIR"] == scratch.inductor_default(str(tmp_path))
        assert seen["TORCHINDUCTOR_CACHE_DIR"].startswith(str(tmp_path / "torchinductor_"))
        names = sorted(p.name for p in folder.iterdir())
        assert names[0] == "0c49f3d0-ipc" and names[1] == scratch.OWNER, names
        assert names[2].startswith("vllm_dist_"), names
    finally:
        assert server.stop(grace=5) == []
    assert not folder.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["env.json", "server.log"]


def test_a_users_own_settings_are_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", "/run/user/ipc")
    env = scratch.server_env(tmp_path, {"TORCHINDUCTOR_CACHE_DIR": "/cache/inductor"})
    assert env == {"TMPDIR": str(tmp_path)}
    # a TMPDIR the stage was given (a small or noexec /tmp) is where the folder and
    # torch's cache go, not this process's temporary directory
    monkeypatch.delenv("VLLM_RPC_BASE_PATH")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    mine = tmp_path / "big-disk"
    mine.mkdir()
    folder = scratch.make({"TMPDIR": str(mine)})
    assert folder.parent == mine and (folder / scratch.OWNER).read_text().split()[0] == \
        str(os.getpid())   # its starter's until the server runs
    env = scratch.server_env(folder, {"TMPDIR": str(mine)})
    assert env["TORCHINDUCTOR_CACHE_DIR"].startswith(str(mine / "torchinductor_"))
    # where vLLM's socket names would not fit in the folder, vLLM keeps its own place
    assert ("VLLM_RPC_BASE_PATH" in env) == \
        (len(str(folder)) + scratch.VLLM_SOCKET_NAME <= scratch.SOCKET_PATH_MAX)
    assert "VLLM_RPC_BASE_PATH" not in scratch.server_env(Path("/" + "d" * 80), {})
    assert scratch.server_env(Path("/tmp/ep-vllm-x"), {})["VLLM_RPC_BASE_PATH"] == \
        "/tmp/ep-vllm-x"


def test_a_folder_is_swept_once_its_server_is_gone(tmp_path):
    """A server SIGKILLed with its starter leaves its folder: the next start
    here removes it. One whose server runs, or is still starting (no owner
    recorded yet), stays."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        folders = {}
        for name, pid in (("gone", gone.pid), ("running", running.pid), ("starting", None)):
            folders[name] = tmp_path / f"{scratch.PREFIX}{name}"
            folders[name].mkdir()
            (folders[name] / "socket").touch()
            if pid is not None:
                scratch.mark_owner(folders[name], pid)
        (tmp_path / "someone-else").mkdir()
        # a gone owner in another pid namespace or on another host (a cluster's
        # nodes, containers sharing /tmp): its pid means nothing here
        for name, made in (("other-ns", "pid:[1]@" + scratch.where().split("@")[1]),
                           ("other-host", scratch.where().split("@")[0] + "@elsewhere")):
            (tmp_path / f"{scratch.PREFIX}{name}").mkdir()
            (tmp_path / f"{scratch.PREFIX}{name}" / scratch.OWNER).write_text(
                f"{gone.pid} None {made}\n")
        assert scratch.sweep(str(tmp_path)) == [folders["gone"]]
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            [f"{scratch.PREFIX}{n}" for n in ("running", "starting", "other-ns", "other-host")]
            + ["someone-else"])
    finally:
        running.kill()
        running.wait()
    assert scratch.sweep(str(tmp_path)) == [folders["running"]]
