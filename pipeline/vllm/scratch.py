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

The folder sits directly in the server's temporary directory (a TMPDIR the
user gave the stage is kept as the base) under a short name: a unix socket's
path is limited to 107 bytes and vLLM's names are 37 of them; where the folder
would leave too few, the sockets stay where vLLM puts them. Torch's compile
cache stays where it is by default (named from the temporary directory), so a
server start still finds the kernels the last one compiled. What else vLLM
keeps in the temporary directory is off the CPU and default GPU paths and is
per start now: a hub download's file lock, the NCCL allocator's build under
symmetric memory, a weight-cache daemon's socket. Owners are told apart by
pid and start time within a pid namespace and host: a folder another namespace
or host made (containers or a cluster's nodes sharing one /tmp) is left to
that namespace's own sweep."""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import tempfile
from pathlib import Path

from pipeline.run.rundir import proc_start_ticks
from pipeline.vllm.contract import ENV_RPC_BASE_PATH

PREFIX = "ep-vllm-"
OWNER = "owner"        # "pid start_ticks where": the starter's, then its server's once started
SOCKET_PATH_MAX = 107  # sun_path less its NUL
VLLM_SOCKET_NAME = 37  # "/" + a uuid4


def base(env: dict[str, str]) -> str:
    """The server's temporary directory: the stage's TMPDIR, else this process's."""
    return env.get("TMPDIR") or tempfile.gettempdir()


def make(env: dict[str, str]) -> Path:
    """A new folder for one server, owned by its starter until the server runs
    (a starter killed before that leaves it to the next sweep)."""
    where = base(env)
    sweep(where)
    folder = Path(tempfile.mkdtemp(prefix=PREFIX, dir=where))
    mark_owner(folder, os.getpid())
    return folder


def server_env(folder: Path, env: dict[str, str]) -> dict[str, str]:
    """What the server's environment adds: its temporary files in the folder.
    A user's own VLLM_RPC_BASE_PATH or TORCHINDUCTOR_CACHE_DIR is kept."""
    out = {"TMPDIR": str(folder)}
    room = len(str(folder)) + VLLM_SOCKET_NAME <= SOCKET_PATH_MAX
    if room and not (env.get(ENV_RPC_BASE_PATH) or os.environ.get(ENV_RPC_BASE_PATH)):
        out[ENV_RPC_BASE_PATH] = str(folder)
    if not (env.get("TORCHINDUCTOR_CACHE_DIR") or os.environ.get("TORCHINDUCTOR_CACHE_DIR")):
        out["TORCHINDUCTOR_CACHE_DIR"] = inductor_default(base(env))
    return out


def inductor_default(tmp: str) -> str:
    """Torch's default compile cache (torch/_inductor/runtime/cache_dir_utils.py,
    default_cache_dir), named from the temporary directory: with a TMPDIR of the
    server's own, torch would compile into a folder removed at its stop, and
    every start would compile again."""
    try:
        user = getpass.getuser().translate({ord(c): "_" for c in '\\/:*?"<>|'})
    except (KeyError, OSError):   # a uid without a name (docker run -u 1234): torch's fallback
        user = f"uid_{os.getuid()}"
    return os.path.join(tmp, f"torchinductor_{user}")


def where() -> str:
    """This process's pid namespace and host: a pid means something only there
    (the host's init namespace has the same number on every machine)."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = "?"
    return f"{ns}@{socket.gethostname()}".replace(" ", "_")


def mark_owner(folder: Path, pid: int) -> None:
    """Record the folder's owner (pid and start time: a pid is reused; where
    they mean something), whole or not at all: a sweep reads it at any instant."""
    tmp = folder / f"{OWNER}.tmp"
    try:
        tmp.write_text(f"{pid} {proc_start_ticks(pid)} {where()}\n")
        os.replace(tmp, folder / OWNER)
    except OSError:
        pass   # the folder keeps its last owner


def remove(folder: Path | None) -> None:
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def sweep(tmp: str | None = None) -> list[Path]:
    """Remove the folders whose owner is gone; returns them. One without a
    readable owner (another account's, or just being made), or made in another
    pid namespace or on another host, is left alone."""
    removed, here = [], where()
    for folder in Path(tmp or tempfile.gettempdir()).glob(f"{PREFIX}*"):
        try:
            pid, ticks, made = (folder / OWNER).read_text().split()
            if made != here or "?" in here:
                continue
            gone = ticks == "None" or str(proc_start_ticks(int(pid))) != ticks
        except (OSError, ValueError):
            continue
        if gone:
            remove(folder)
            removed.append(folder)
    return removed
