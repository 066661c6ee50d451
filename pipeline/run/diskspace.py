"""Disk space: free bytes, sizes for people, and the one error for a full disk.

A full disk is neither bad input nor a bug: wherever it is met (a stage's
own outputs, a checkpoint, the run directory's state and events) it is
named as such, with the path, what is free and, where known, what is
needed, so that the user frees space and resumes. Nothing a later step
trusts can be left half-written by it: outputs are written to a temporary
name and renamed (rundir.atomic_write_bytes, hsfile), checkpoints are
complete only with their marker (pipeline.train.checkpoints), and resume redoes only what
is missing.

Libraries do not always say ENOSPC (torch's zip writer raises a
RuntimeError "unexpected pos"): a failure with (almost) nothing left free
on the run's disk is taken for a full disk too.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
EXIT_DISK_FULL = 4      # the CLI's and the launcher's exit status for it
NEARLY_FULL = 1 << 20   # less free than this after a failure: the disk was the cause
HINT = ("free space on that disk (or move [run] runs_dir to a bigger one), then "
        "`eagle-panel resume`: finished work is kept")


def fmt_bytes(n: float) -> str:
    """A size for people (pipeline.fmt.nbytes calls it)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _existing(path: Path) -> Path:
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path) -> int:
    """Free bytes (for this user) on the filesystem holding `path`."""
    return shutil.disk_usage(_existing(path)).free


def mount_point(path) -> Path:
    p = _existing(Path(path)).resolve()
    while not os.path.ismount(p):
        p = p.parent
    return p


class DiskFull(Exception):
    """No room on the disk of `path`; `needed` bytes if known."""

    def __init__(self, path, needed: int | None = None, what: str = "", message: str = ""):
        self.path, self.needed = Path(path), needed
        self.free = free_bytes(self.path)
        need = f"; {what or 'it'} needs about {fmt_bytes(needed)}" if needed else ""
        super().__init__(message or f"no space left on the disk of {self.path} "
                         f"({fmt_bytes(self.free)} free on {mount_point(self.path)}{need})")
        self.hint = HINT


def is_full_errno(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in FULL_ERRNOS


def explain(exc: BaseException, where) -> DiskFull | None:
    """The DiskFull behind a failure, or None if the disk was not the cause."""
    if isinstance(exc, DiskFull):
        return exc
    if is_full_errno(exc):
        return DiskFull(getattr(exc, "filename", None) or where)
    if not isinstance(exc, (OSError, RuntimeError)):
        return None   # a bug is a bug, however full the disk
    try:
        if free_bytes(where) < NEARLY_FULL:
            return DiskFull(where)
    except OSError:
        pass
    return None


def ensure_room(path, needed: int, what: str, keep_free: int = 0) -> None:
    """Refuse to start a write that cannot fit: better than a half-written file."""
    if free_bytes(path) - keep_free < needed:
        raise DiskFull(path, needed, what)
