"""The messages between the panel's app and its screens (Posting's pattern).

The app reads (the run's files, NVML) and acts (run, cancel, force); the main
screen draws and owns the keys that change only what is shown. They talk in
these messages only: the screen posts a request when a key asks for an action,
the app posts what it read. No screen reads the app's attributes and the app
calls no screen method, so either can change without the other.
"""

from __future__ import annotations

from dataclasses import dataclass

from textual.message import Message

from pipeline.run.rundir import RunDir
from pipeline.run.snapshot import RunSnapshot

# -- screen -> app: what a key asked for ---------------------------------------------


class ScreenReady(Message):
    """The main screen is mounted: the app takes its first look at the run."""


class RunRequested(Message):
    """r: start a run from the config, or resume the one shown."""


class CancelRequested(Message):
    """c: cancel the running pipeline (after a confirmation)."""


class ForceRequested(Message):
    """F: re-run the selected stage from scratch (after a confirmation)."""

    def __init__(self, stage: str):
        super().__init__()
        self.stage = stage


class DoctorRequested(Message):
    """d: the doctor report for the run's config (or the config file)."""


class CompareRequested(Message):
    """C: the runs of the runs folder side by side."""


# -- app -> screen: what was read ----------------------------------------------------


@dataclass(frozen=True)
class Transitions:
    """What changed since the last snapshot the screen was sent."""
    started: tuple[str, ...] = ()     # stages that began running
    failed: tuple[str, ...] = ()      # stages that failed
    focus: str | None = None          # the first look: the stage to select


class RunRead(Message):
    """The run as just read: its snapshot (immutable: the screen keeps it),
    its directory (a new one after `r` started the first run), the backend
    extract runs, and what changed."""

    def __init__(self, view: RunSnapshot, rundir: RunDir, backend: str | None,
                 changes: Transitions):
        super().__init__()
        self.view, self.rundir, self.backend, self.changes = view, rundir, backend, changes


class TelemetryRead(Message):
    """A GPU/host sample (pipeline.telemetry), cluster nodes' GPUs included."""

    def __init__(self, sample):
        super().__init__()
        self.sample = sample


# -- the watch app -> its screen ---------------------------------------------------------


class WatchRead(Message):
    """What `eagle-panel watch` knows after a read of the server (the
    windows, the gauges, the drift line): a pipeline.watch.state.WatchState."""

    def __init__(self, state):
        super().__init__()
        self.state = state

