"""The run directory: layout, atomic file writes and the per-stage state file.

Standard library only: the stage supervisor and the stages import this with
whatever interpreter `[runtime] python` names.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import json
import os
import signal
import tempfile
import time
from pathlib import Path

from pipeline.run.diskspace import DiskFull, is_full_errno
from pipeline.stage_graph import STAGE_NAMES


class Status(str, enum.Enum):
    """A stage's status in state.json (stored as the plain string)."""
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    SKIPPED = "skipped"      # turned off, or nothing to run it with (it says why)

    def __str__(self) -> str:
        return self.value


PRIVATE_MODE, SHARED_MODE = 0o700, 0o750


class RunDirError(Exception):
    """A run directory that is missing, not a run, or has a corrupt state file."""


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write a file so that a reader (or a crash) sees the old or the new
    content, never a mix: temp file in the same folder, fsync, rename."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp makes 0600 files; outputs are meant to be shared like any other.
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if is_full_errno(e):   # the old content stays; say what happened
            raise DiskFull(path, len(data)) from None
        raise


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


# -- process identity ------------------------------------------------------
# A pid alone can be reused by an unrelated process after the stage ends; the
# kernel's start time of the process (in clock ticks since boot) tells them apart.

def proc_start_ticks(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # comm may hold spaces and parentheses: fields after the last ')' are fixed.
    fields = stat[stat.rindex(b")") + 2:].split()
    if fields[0] == b"Z":  # a zombie has finished running
        return None
    return int(fields[19])


def proc_alive(pid: int | None, start_ticks: int | None) -> bool:
    if not pid:
        return False
    now = proc_start_ticks(pid)
    return now is not None and (start_ticks is None or now == start_ticks)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


# -- the run directory -----------------------------------------------------

def new_stage_state() -> dict:
    return {
        "status": Status.PENDING, "attempt": 0, "pid": None, "pgid": None,
        "create_time": None, "supervisor_pid": None, "supervisor_create_time": None,
        "started_at": None, "ended_at": None, "exit_code": None, "signal": None,
        "fingerprint": None, "devices": [], "token": None, "cancel_requested": False,
        "reason": None,
    }


class RunDir:
    """runs/<run-id>/: config.toml, state.json, lock, <stage>/{stage.log,events.jsonl,out/}."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).resolve()

    # paths
    @property
    def id(self) -> str:
        return self.path.name

    @property
    def state_path(self) -> Path:
        return self.path / "state.json"

    @property
    def config_path(self) -> Path:
        return self.path / "config.toml"

    @property
    def lock_path(self) -> Path:
        return self.path / "lock"

    def stage_dir(self, stage: str) -> Path:
        return self.path / stage

    def log_path(self, stage: str) -> Path:
        return self.path / stage / "stage.log"

    def events_path(self, stage: str) -> Path:
        return self.path / stage / "events.jsonl"

    def server_logs(self, stage: str) -> list[tuple[str, Path]]:
        """The logs of the vLLM servers a stage started, (name, path) in
        order: `vllm-<k>.log` is server k (pipeline.vllm.server.server_log),
        and a node worker's server k is "<node>/<k>"."""
        def number(p: Path) -> int:
            tail = p.stem.removeprefix("vllm-")
            return int(tail) if tail.isdigit() else 1 << 30
        here = self.stage_dir(stage)
        out = [(p.stem.removeprefix("vllm-"), p)
               for p in sorted(here.glob("vllm-*.log"), key=number)]
        for node in sorted((here / "nodes").glob("*")) if (here / "nodes").is_dir() else []:
            out += [(f"{node.name}/{p.stem.removeprefix('vllm-')}", p)
                    for p in sorted(node.glob("vllm-*.log"), key=number)]
        return out

    def out_dir(self, stage: str) -> Path:
        return self.path / stage / "out"

    def is_run(self) -> bool:
        return self.state_path.is_file()

    # creation
    def create(self, config_text: str, base_dir: Path, shared: bool = False) -> None:
        """Make the folders and the first state; an existing run is left as is.
        The run directory itself is the fence around its data: 0700 (0750
        when shared with the group), whatever the files inside say."""
        new = not self.path.exists()
        self.path.mkdir(parents=True, exist_ok=True)
        if new:
            os.chmod(self.path, PRIVATE_MODE if not shared else SHARED_MODE)
        for stage in STAGE_NAMES:
            self.out_dir(stage).mkdir(parents=True, exist_ok=True)
        with self._state_mutex():
            if not self.state_path.exists():
                atomic_write_json(self.state_path, {
                    "run_id": self.id, "created_at": time.time(),
                    "base_dir": str(base_dir), "driver": None,
                    "stages": {s: new_stage_state() for s in STAGE_NAMES},
                })
        atomic_write_bytes(self.config_path, config_text.encode())

    def require(self) -> "RunDir":
        if not self.path.is_dir():
            raise RunDirError(f"{self.path}: no such run directory. `eagle-panel runs` lists the runs.")
        if not self.is_run():
            raise RunDirError(
                f"{self.path}: not an eagle-panel run directory (it has no state.json). "
                "`eagle-panel runs` lists the runs."
            )
        return self

    # state
    def read_state(self) -> dict:
        try:
            raw = self.state_path.read_bytes()
        except FileNotFoundError:
            raise RunDirError(f"{self.state_path}: missing; this is not a run directory.") from None
        try:
            state = json.loads(raw)
            if not isinstance(state, dict) or not isinstance(state.get("stages"), dict):
                raise ValueError("no `stages` table")
        except (ValueError, UnicodeDecodeError) as e:
            raise RunDirError(
                f"{self.state_path}: corrupt state file ({e}). It was left untouched; "
                "inspect it, restore it, or start a new run with --run NEW_NAME."
            ) from None
        for stage in STAGE_NAMES:   # a run made before a stage existed
            state["stages"].setdefault(stage, new_stage_state())
        return state

    @contextlib.contextmanager
    def _state_mutex(self):
        # A short lock around read-modify-write: the driver, the supervisors and
        # `cancel` all update state.json. Readers need no lock (atomic replace).
        fd = os.open(self.path / ".state.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def mutate_state(self):
        """Yield the state for changes; it is written back atomically on exit."""
        with self._state_mutex():
            state = self.read_state()
            yield state
            atomic_write_json(self.state_path, state)

    def update_stage(self, stage: str, **fields) -> dict:
        with self.mutate_state() as state:
            state["stages"].setdefault(stage, new_stage_state()).update(fields)
            return dict(state["stages"][stage])

    # the launcher lock
    def try_lock(self):
        """The launcher lock: returns an open fd holding an exclusive flock,
        or None when another live launcher holds it. The kernel releases it
        when the holder dies, however it dies."""
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        return fd

    def lock_holder(self) -> int | None:
        """The pid of the launcher holding the lock, if one does."""
        fd = self.try_lock()
        if fd is not None:
            os.close(fd)
            return None
        try:
            return int(self.lock_path.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return -1


def list_runs(runs_dir: Path) -> list[RunDir]:
    """Runs under runs_dir, newest first."""
    if not runs_dir.is_dir():
        return []
    runs = [RunDir(p) for p in runs_dir.iterdir() if (p / "state.json").is_file()]

    def created(r: RunDir) -> float:
        try:
            return float(r.read_state().get("created_at") or 0)
        except RunDirError:  # listed (and reported by the caller), last
            return 0.0
    return sorted(runs, key=created, reverse=True)
