"""Find and stop every process a stage started, wherever it went.

A stage's children usually share its process group, but some leave it
(vLLM's engine core and workers, anything that calls setsid) and outlive a
killed parent while holding GPU memory. Every stage process is started with
EAGLE_PANEL_TOKEN in its environment, which every descendant inherits, so a
scan of /proc finds them all. Standard library only.
"""

from __future__ import annotations

import os
import signal
import time

TOKEN_VAR = "EAGLE_PANEL_TOKEN"
# The supervisor's own mark, a variable of its own: a scan for TOKEN_VAR must find
# the stage's processes, never the supervisor recording them.
SUPERVISOR_VAR = "EAGLE_PANEL_SUPERVISOR"


def _pids():
    for name in os.listdir("/proc"):
        if name.isdigit():
            yield int(name)


def environ(pid: int) -> list[bytes]:
    """A process's environment as NAME=VALUE entries ([] when unreadable)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def carries(pid: int, var: str, token: str | None) -> bool | None:
    """Whether a process was started with `var`=`token` in its environment:
    the proof that a run started it, which a pid and start time copied into
    state.json are not. None when its environment cannot be read: another
    user's process (nothing of ours can signal it anyway), or one that shows
    none (exiting, a zombie, or renamed by setproctitle), which is then taken
    on its pid and start time as before."""
    entries = environ(pid)
    if not any(b"=" in e for e in entries):
        return None
    return bool(token) and f"{var}={token}".encode() in entries


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2:][:1] == b"Z"
    except (OSError, ValueError):
        return True


def live_pids():
    """Every live process but this one (a zombie is not alive)."""
    me = os.getpid()
    for pid in _pids():
        if pid != me and not _is_zombie(pid):
            yield pid


def cmdline(pid: int) -> str:
    """The whole command line, arguments separated by spaces ("" when gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").strip().decode(errors="replace")
    except OSError:
        return ""


def proc_name(pid: int) -> str:
    return cmdline(pid)[:120] or f"pid {pid}"


def pgid_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def stage_processes(token: str | None, pgid: int | None = None,
                    var: str = TOKEN_VAR) -> list[int]:
    """Live processes that carry the token (in env `var`) or sit in the process group."""
    if not token and not pgid:
        return []
    needle = f"{var}={token}".encode() if token else None
    return [pid for pid in live_pids()
            if (pgid and pgid_of(pid) == pgid) or (needle and needle in environ(pid))]


def signal_all(pids, sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def wait_gone(find, timeout: float, poll: float = 0.1) -> list[int]:
    """Poll `find()` until it returns nothing or the timeout passes."""
    deadline = time.monotonic() + timeout
    while True:
        left = find()
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(poll)


def stop_tree(token: str | None, pgid: int | None, term_grace: float = 5.0,
              kill_grace: float = 5.0, var: str = TOKEN_VAR) -> list[int]:
    """SIGTERM then SIGKILL every process of a stage; returns the pids that survived."""
    return stop_found(lambda: stage_processes(token, pgid, var), term_grace, kill_grace)


def stop_found(find, term_grace: float = 5.0, kill_grace: float = 5.0) -> list[int]:
    """SIGTERM then SIGKILL what `find()` lists, finding again after each
    grace (a tree changes while it stops); the pids that survived."""
    left = find()
    if not left:
        return []
    signal_all(left, signal.SIGTERM)
    left = wait_gone(find, term_grace)
    if left:
        signal_all(left, signal.SIGKILL)
        left = wait_gone(find, kill_grace)
    return left
