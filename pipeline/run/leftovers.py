"""What a stage attempt left running, found by an identity vLLM cannot erase.

Every stage process carries the attempt's token (EAGLE_PANEL_TOKEN) in its
environment, but vLLM renames its processes (VLLM::EngineCore,
VLLM::Worker) with setproctitle, which overwrites the memory that
/proc/PID/environ reads: the token is still in their os.environ, yet no
scan can see it (measured: the whole environ reads back as NUL bytes). What
survives a rename is the session. The driver starts every supervisor as a
session leader; the stage and everything it starts stay in that session (a
vLLM server gets a process group of its own, not a session, so a cancel's
SIGINT to the stage's group does not reach it). Linux never reuses a pid
while it is still some process's session id, so the members of a recorded
supervisor's session are the attempt's: while the supervisor lives (same
start time), and after it died (nothing can have taken its pid while its
session has members). Guards for the case where the whole session ended and
an unrelated process later got the pid and made a session of its own: a
member must be ours (same uid), started after the supervisor, and carry
the token or have its environment erased by a rename; and a live leader
must carry the supervisor's mark of the attempt (EAGLE_PANEL_SUPERVISOR),
so that a row naming someone else's session leader with its real start
time proves nothing.

`survivors(state)` is the pure finder for readers (`status`, doctor, the
chaos bench): nothing is signalled. Standard library only.
"""

from __future__ import annotations

import os

from pipeline.run.proctree import (
    SUPERVISOR_VAR,
    TOKEN_VAR,
    carries,
    cmdline,
    environ,
    live_pids,
    stop_found,
)

VLLM_PREFIX = "VLLM::"   # vLLM's process titles: VLLM::EngineCore, VLLM::Worker, ...


def _stat(pid: int) -> list[bytes] | None:
    """The fixed fields of /proc/PID/stat after the command name (state first)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2:].split()
    except (OSError, ValueError):
        return None


def session_of(pid: int) -> int | None:
    f = _stat(pid)
    return int(f[3]) if f else None


def start_ticks(pid: int) -> int | None:
    f = _stat(pid)
    return int(f[19]) if f and f[0] != b"Z" else None


def _ours(pid: int) -> bool:
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:
        return False


def env_erased(pid: int) -> bool:
    """Its environment reads back with no NAME=VALUE at all (setproctitle)."""
    return not any(b"=" in e for e in environ(pid))


class Snapshot:
    """The live processes as one scan of /proc sees them; each environment
    read once (a reader checking six stages must not scan six times)."""

    def __init__(self):
        self.me = os.getpid()
        self.stat = {pid: f for pid in live_pids() if (f := _stat(pid)) is not None}
        self._env: dict[int, bytes] = {}

    def env(self, pid: int) -> bytes:
        if pid not in self._env:
            self._env[pid] = b"\0".join(environ(pid))
        return self._env[pid]

    def sid(self, pid: int) -> int | None:
        f = self.stat.get(pid)
        return int(f[3]) if f else None

    def pgid(self, pid: int) -> int | None:
        f = self.stat.get(pid)
        return int(f[2]) if f else None

    def ticks(self, pid: int) -> int | None:
        f = self.stat.get(pid)
        return int(f[19]) if f and f[0] != b"Z" else None


def session_processes(sid: int | None, leader_ticks: int | None, token: str | None,
                      snap: Snapshot | None = None) -> list[int]:
    """Live processes (not the leader) of supervisor `sid`'s session that
    belong to the attempt; [] when the session's identity cannot be verified."""
    if not sid or leader_ticks is None:
        return []
    snap = snap or Snapshot()
    leader = start_ticks(sid)
    if leader is not None and leader != leader_ticks:
        return []   # the pid is someone else's now: so is any session it leads
    if leader is not None and carries(sid, SUPERVISOR_VAR, token) is False:
        return []   # a live leader this run did not start (its numbers copied into a row)
    # The token's value anywhere in the environment: EAGLE_PANEL_TOKEN's, or a
    # server's EAGLE_PANEL_SERVER_TOKEN, which starts with it (pipeline.vllm.server),
    # whichever a rename (setproctitle) left readable; or none at all, erased.
    needle = f"={token}".encode() if token else None
    out = []
    for pid in snap.stat:
        if pid == sid or snap.sid(pid) != sid or not _ours(pid):
            continue
        ticks = snap.ticks(pid)
        if ticks is None or ticks < leader_ticks:
            continue
        env = snap.env(pid)
        if (needle and needle in env) or b"=" not in env:
            out.append(pid)
    return out


def token_processes(token: str | None, pgid: int | None = None,
                    snap: Snapshot | None = None) -> list[int]:
    """Live processes carrying the token, or in the process group `pgid`."""
    if not token and not pgid:
        return []
    snap = snap or Snapshot()
    needle = f"{TOKEN_VAR}={token}".encode() if token else None
    return [pid for pid in snap.stat
            if (pgid and snap.pgid(pid) == pgid) or (needle and needle in snap.env(pid))]


def attempt_processes(st: dict, pgid: int | None = None,
                      snap: Snapshot | None = None) -> list[int]:
    """Every live process of a stage attempt (its state.json entry): by
    token, by the group `pgid` (only where the caller knows it is still the
    stage's: its supervisor), and by its supervisor's session."""
    snap = snap or Snapshot()
    found = set(token_processes(st.get("token"), pgid, snap))
    found.update(session_processes(st.get("supervisor_pid"), st.get("supervisor_create_time"),
                                   st.get("token"), snap))
    return sorted(found)


def stop_attempt(st: dict, pgid: int | None = None, term_grace: float = 5.0,
                 kill_grace: float = 5.0) -> list[int]:
    """SIGTERM then SIGKILL every process of the attempt; the pids that survived."""
    return stop_found(lambda: attempt_processes(st, pgid), term_grace, kill_grace)


def survivors(state: dict, alive=None) -> list[dict]:
    """Processes of stage attempts that have ended (or whose supervisor and
    stage are gone): [{stage, pid, name}]. `alive(st)` says whether a stage
    marked running is still running (default: marked running = alive).
    Nothing is signalled or written: readers call it."""
    out, snap = [], None
    # the run's shared vLLM server (pipeline.extract.shared_server) is an attempt
    # of the driver's: its supervisor is the driver, alive while the driver is
    owned = list((state.get("stages") or {}).items())
    if isinstance(state.get("shared_server"), dict):
        owned.append(("shared server", state["shared_server"]))
    for stage, st in owned:
        if not isinstance(st, dict) or not st.get("token") or st.get("slurm_job"):
            continue   # (a Slurm job's processes are on its node: the scheduler's)
        if st.get("status") == "running" and (alive is None or alive(st)):
            continue
        snap = snap or Snapshot()
        for pid in attempt_processes(st, snap=snap):
            out.append({"stage": stage, "pid": pid, "name": cmdline(pid)[:80] or f"pid {pid}"})
    return out


def vllm_processes(under: str | os.PathLike | None = None) -> list[int]:
    """Every live process of ours that vLLM named (VLLM::...); with `under`,
    only those working in that folder (a stage's processes keep its run
    directory as their cwd, which no process title erases)."""
    out = []
    for pid in live_pids():
        if not cmdline(pid).startswith(VLLM_PREFIX) or not _ours(pid):
            continue
        if under is not None:
            try:
                cwd = os.readlink(f"/proc/{pid}/cwd")
            except OSError:
                continue
            if not (cwd + "/").startswith(str(under).rstrip("/") + "/"):
                continue
        out.append(pid)
    return out


def describe(found: list[dict]) -> str:
    return ", ".join(f"{s['stage']} pid {s['pid']} ({s['name']})" for s in found)


def survivor_lines(state: dict, alive=None) -> list[str]:
    """What `status` and doctor say about survivors: each with its pid, and the fix."""
    found = survivors(state, alive)
    if not found:
        return []
    pids = " ".join(str(s["pid"]) for s in found)
    return [f"left running by ended stages: {describe(found)}",
            f"they hold memory (on a GPU server, GPU memory): `kill {pids}`; the next "
            "`eagle-panel run` or `resume` of this run stops them too"]


def stop_survivors(state: dict, alive=None) -> list[int]:
    """What a launcher does before it plans: every ended attempt's survivors
    stopped (the supervisor's sweep missed them, or it was killed first);
    returns the pids that outlived SIGKILL."""
    left = []
    for stage in {s["stage"] for s in survivors(state, alive)}:
        st = state["shared_server"] if stage == "shared server" else state["stages"][stage]
        left += stop_attempt(st, term_grace=2.0, kill_grace=2.0)
    return left

