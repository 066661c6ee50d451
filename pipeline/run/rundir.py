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
import stat
import tempfile
import time
from pathlib import Path

from pipeline.run import state as state_mod
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
    # What readers show, never stored: a running row whose processes cannot be
    # told from unrelated ones (no start time recorded), and a succeeded stage
    # whose out/ folder is gone.
    UNKNOWN = "unknown"
    MISSING = "outputs missing"

    def __str__(self) -> str:
        return self.value


# A stage that needs nothing more: planning skips it, readers show it as done.
DONE = (Status.SUCCEEDED, Status.SKIPPED)

PRIVATE_MODE, SHARED_MODE = 0o700, 0o750
# A shared run: the group reads everything, writes nothing, whatever the
# umask of whoever launches it (umask 002 would make stage folders 775).
SHARED_UMASK = 0o027


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
# Recorded here; whether a recorded process still runs is pipeline.run.executor's.

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


def pid_running(pid: int) -> bool:
    """Whether any process (not a zombie) has this pid: for a pid this
    process started itself and knows to be its own (tests, a child)."""
    return proc_start_ticks(pid) is not None


def identity_recorded(pid, start_ticks) -> bool:
    """A pid recorded without its start time: a reader cannot verify it."""
    return pid is None or isinstance(start_ticks, int)


def check_run_id(name, where: str = "--run") -> str:
    """A run id is a plain folder name under runs_dir, checked exactly like
    `[run] name`, before anything is created: `..`, `/abs`, `a/../../b` or
    `.hidden` would put (or hide) a run outside the runs folder. Returns the
    name, or raises RunDirError naming `where`."""
    if not isinstance(name, str) or not name or "/" in name or "\\" in name \
            or name.startswith(".") or any(ord(c) < 32 for c in name) \
            or len(name.encode(errors="surrogateescape")) > 255:
        raise RunDirError(f"{where} {name!r}: a run id must be a plain folder name (no "
                          "slashes, not starting with a dot, at most 255 bytes). Choose "
                          "another name.")
    return name


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
        # A run directory is a real folder in its runs folder: one that is a link
        # would put the run, its locks and every write somewhere else.
        if os.path.islink(path):
            raise RunDirError(f"{path}: a link (to {os.readlink(path)}), not a run folder; a "
                              "run directory is never followed through a link. Move the run "
                              "into the runs folder, or set [run] runs_dir to where it is.")
        self.path = Path(path).resolve()
        self._scheduler: tuple | None = None

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

    # what readers may open ------------------------------------------------
    def inside(self, path: Path, what: str = "file") -> Path:
        """`path` with its links resolved, if that is inside the run directory;
        RunDirError otherwise. On a shared run a `stage.log` linked to
        another user's file must not be printed by `logs`."""
        real = Path(os.path.realpath(path))
        if real != self.path and self.path not in real.parents:
            raise RunDirError(f"{path}: corrupt run directory ({what} is a link to {real}, "
                              f"outside {self.path}); it was not read. Remove the link.")
        return real

    def readable(self, path: Path, what: str = "file") -> Path | None:
        """A file a reader may open: inside the run and a plain file; None when
        it does not exist (yet); RunDirError when it is damaged."""
        try:
            st = os.stat(self.inside(path, what))
        except FileNotFoundError:
            return None
        except OSError as e:
            raise RunDirError(f"{path}: corrupt run directory ({what}: {e.strerror}); "
                              "it was left untouched.") from None
        if not stat.S_ISREG(st.st_mode):
            raise RunDirError(f"{path}: corrupt run directory ({what} is "
                              f"{_kind(st.st_mode)}, not a file); it was left untouched. "
                              "Move it aside.")
        return path

    def check_readable(self) -> None:
        """Every file a reader of the whole run opens (`status`, the panel):
        refused at once, naming it, rather than a traceback half-way."""
        self.readable(self.config_path, "the frozen config")
        for name, what in (("lock", "the launcher lock"), (".state.lock", "the state lock"),
                           ("driver.log", "the driver's log")):
            self.readable(self.path / name, what)
        for stage in STAGE_NAMES:
            here = self.stage_dir(stage)
            for folder, what in ((here, "a stage folder"), (self.out_dir(stage), "outputs")):
                if os.path.lexists(folder):
                    self._folder(folder, what)
            for path, what in ((self.log_path(stage), "a stage log"),
                               (self.events_path(stage), "an events file"),
                               (here / "provenance.json", "a provenance file")):
                self.readable(path, what)
            for _, path in self.server_logs(stage):
                self.readable(path, "a vLLM server log")

    def _folder(self, path: Path, what: str) -> None:
        # A folder may be a link out of the run (extract/out on a scratch disk
        # holds terabytes): readers list it, they never print what is in it.
        try:
            mode = os.stat(path).st_mode
        except OSError as e:
            raise RunDirError(f"{path}: corrupt run directory ({what}: {e.strerror}); "
                              "it was left untouched.") from None
        if not stat.S_ISDIR(mode):
            raise RunDirError(f"{path}: corrupt run directory ({what} is {_kind(mode)}, "
                              "not a folder); it was left untouched. Move it aside.")

    def outputs_missing(self, stage: str) -> str | None:
        """Why a succeeded stage's outputs are gone (its out/ folder deleted),
        or None. Cheap on purpose (one stat): a reader cannot validate a
        terabyte of hidden states; the stage itself does when it resumes."""
        out = self.out_dir(stage)
        try:
            mode = os.stat(out).st_mode
        except OSError:
            return f"{out.relative_to(self.path)} is missing"
        return None if stat.S_ISDIR(mode) else f"{out.relative_to(self.path)} is not a folder"

    def scheduler(self) -> str:
        """The frozen config's [cluster] scheduler, read without loading the
        config (readers must not need the target's files): Slurm fields in
        state.json mean something only on a Slurm run."""
        try:
            st = os.stat(self.config_path)
            sig = (st.st_mtime_ns, st.st_size)
            if self._scheduler and self._scheduler[0] == sig:
                return self._scheduler[1]
            text = self.readable(self.config_path, "the frozen config").read_text()
            value = _toml_loads(text).get("cluster", {}).get("scheduler", "local")
        except (OSError, ValueError, AttributeError, ImportError, RunDirError):
            return "local"
        value = value if isinstance(value, str) else "local"
        self._scheduler = (sig, value)
        return value

    # creation
    def create(self, config_text: str, base_dir: Path, shared: bool = False) -> None:
        """Make the folders and the first state; an existing run is left as is.
        The run directory itself is the fence around its data: 0700 (0750
        when shared with the group), whatever the files inside say."""
        new = not self.path.exists()
        old_umask = os.umask(SHARED_UMASK) if shared else None
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            if new:
                os.chmod(self.path, PRIVATE_MODE if not shared else SHARED_MODE)
            for stage in STAGE_NAMES:
                self.out_dir(stage).mkdir(parents=True, exist_ok=True)
                if shared:   # made under another umask by an older version
                    for d in (self.stage_dir(stage), self.out_dir(stage)):
                        os.chmod(d, SHARED_MODE)
        finally:
            if old_umask is not None:
                os.umask(old_umask)
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
        """state.json, every field type-checked (pipeline.run.state): a
        damaged one is a RunDirError naming the key, the file untouched."""
        try:
            if self.readable(self.state_path, "the state file") is None:
                raise FileNotFoundError
            raw = self.state_path.read_bytes()
        except FileNotFoundError:
            raise RunDirError(f"{self.state_path}: missing; this is not a run directory.") from None
        except OSError as e:
            raise RunDirError(f"{self.state_path}: unreadable ({e.strerror}).") from None
        try:
            return state_mod.validate(json.loads(raw), STAGE_NAMES, new_stage_state)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise RunDirError(
                f"{self.state_path}: corrupt state file ({e}). It was left untouched; "
                "inspect it, restore it, or start a new run with --run NEW_NAME."
            ) from None

    @contextlib.contextmanager
    def _state_mutex(self):
        # A short lock around read-modify-write: the driver, the supervisors and
        # `cancel` all update state.json. Readers need no lock (atomic replace).
        fd = self._open_lock(self.path / ".state.lock")
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
        fd = self._open_lock(self.lock_path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        return fd

    def adopt_lock(self, fd: int) -> int:
        """The launcher lock a launcher took and handed to the driver it
        started (an inherited fd: the same lock, never released in between,
        so no second launch can start in the gap); this process's pid in it."""
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # (already ours: a no-op)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    @staticmethod
    def _open_lock(path: Path) -> int:
        """A lock file, never through a link (O_NOFOLLOW) and only a file."""
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            if is_full_errno(e):
                raise DiskFull(path, 0) from None
            raise RunDirError(f"{path}: corrupt run directory (a lock file: {e.strerror}); "
                              "move it aside.") from None

    def lock_holder(self) -> int | None:
        """The pid of the launcher holding the lock, if one does: a look that
        writes nothing (a shared lock tried and let go; no file, no holder)."""
        try:
            fd = os.open(self.lock_path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise RunDirError(f"{self.lock_path}: corrupt run directory (a lock file: "
                              f"{e.strerror}); move it aside.") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return None
        except BlockingIOError:
            try:
                return int(os.pread(fd, 64, 0).split()[0])
            except (OSError, ValueError, IndexError):
                return -1
        finally:
            os.close(fd)


def check_runs_dir(runs_dir: Path, where: str = "[run] runs_dir") -> Path:
    """A runs folder that exists must be a folder (one that does not exist
    yet is fine: the first run makes it)."""
    if os.path.lexists(runs_dir) and not runs_dir.is_dir():
        raise RunDirError(f"{where} {runs_dir}: not a folder (it is "
                          f"{_kind(os.lstat(runs_dir).st_mode)}). Point {where} at a folder.")
    return runs_dir


def list_runs(runs_dir: Path) -> list[RunDir]:
    """Runs under runs_dir, newest first."""
    if not check_runs_dir(runs_dir).is_dir():
        return []
    try:
        runs = [RunDir(p) for p in runs_dir.iterdir() if not p.name.startswith(".")
                and not p.is_symlink() and (p / "state.json").is_file()]
    except OSError as e:
        raise RunDirError(f"{runs_dir}: cannot list the runs ({e.strerror}).") from None

    def created(r: RunDir) -> float:
        try:
            return float(r.read_state().get("created_at") or 0)
        except RunDirError:  # listed (and reported by the caller), last
            return 0.0
    return sorted(runs, key=created, reverse=True)


def _kind(mode: int) -> str:
    return ("a folder" if stat.S_ISDIR(mode) else "a file" if stat.S_ISREG(mode)
            else "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a file")


def _toml_loads(text: str) -> dict:
    try:
        import tomllib
    except ImportError:   # Python 3.10
        import tomli as tomllib
    return tomllib.loads(text)
