"""A vLLM server's own temporary folder, removed when the server stops.

vLLM puts its ZMQ IPC sockets (`ipc://$VLLM_RPC_BASE_PATH/<uuid>`) and
torch.distributed's file store (`vllm_dist_<hex>`, vLLM 0.32's executors) in
the temporary directory, and a server whose processes are stopped by signals
leaves them there: measured on the CPU build, ~10 files a server start, ~400 an
hour of this project's test suite, thousands in a user's /tmp after evaluating
many checkpoints. Each server started here gets a folder of its own instead
(TMPDIR and VLLM_RPC_BASE_PATH point into it), removed once its process tree is
gone. A folder whose server died with its starter (a SIGKILL nobody cleaned up
after) is removed by the next server start on the machine, once its owner is
gone.

The folder sits directly in the temporary directory under a short name: a unix
socket's path is limited to 107 bytes, and vLLM's sockets are 37 more.
Torch's compile cache stays where it is by default (it is named from the
temporary directory), so that a server start still finds the kernels the last
one compiled."""

from __future__ import annotations

import getpass
import os
import re
import shutil
import tempfile
from pathlib import Path

from pipeline.run.rundir import proc_start_ticks

PREFIX = "ep-vllm-"
OWNER = "owner"   # "pid start_ticks" of the server's process, written once it is started


def make(name: str) -> Path:
    """A new folder for one server; name: a short unique tag (its token's end)."""
    sweep()
    return Path(tempfile.mkdtemp(prefix=f"{PREFIX}{name[-8:]}-"))


def server_env(folder: Path, env: dict[str, str]) -> dict[str, str]:
    """What the server's environment adds: its temporary files in the folder.
    A user's own VLLM_RPC_BASE_PATH or TORCHINDUCTOR_CACHE_DIR is kept."""
    out = {"TMPDIR": str(folder)}
    if not (env.get("VLLM_RPC_BASE_PATH") or os.environ.get("VLLM_RPC_BASE_PATH")):
        out["VLLM_RPC_BASE_PATH"] = str(folder)
    if not (env.get("TORCHINDUCTOR_CACHE_DIR") or os.environ.get("TORCHINDUCTOR_CACHE_DIR")):
        out["TORCHINDUCTOR_CACHE_DIR"] = inductor_default()
    return out


def inductor_default() -> str:
    """Torch's default compile cache (torch/_inductor/runtime/cache_dir_utils.py,
    default_cache_dir), named from this process's temporary directory: with a
    TMPDIR of the server's own, torch would compile into a folder removed at its
    stop, and every start would compile again."""
    user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
    return os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")


def mark_owner(folder: Path, pid: int) -> None:
    """Record the server's process (pid and start time: a pid is reused)."""
    try:
        (folder / OWNER).write_text(f"{pid} {proc_start_ticks(pid)}\n")
    except OSError:
        pass   # a folder without an owner is left to its own server's stop


def remove(folder: Path | None) -> None:
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def sweep(tmp: str | None = None) -> list[Path]:
    """Remove the folders of servers that are gone; returns them. A folder
    without an owner yet (its server is starting) is left alone."""
    removed = []
    for folder in Path(tmp or tempfile.gettempdir()).glob(f"{PREFIX}*"):
        try:
            pid, ticks = (folder / OWNER).read_text().split()
            gone = ticks == "None" or str(proc_start_ticks(int(pid))) != ticks
        except (OSError, ValueError):
            continue
        if gone:
            remove(folder)
            removed.append(folder)
    return removed
