"""What `watch` knows after each read, as one immutable value the screen
draws (and a test reads): the reading loop folds each read into a Watcher,
which keeps the hour's History, the drift rule and its log."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.watch.drift import Drift, append_line
from pipeline.watch.figures import Figures, Reading, between
from pipeline.watch.history import History
from pipeline.watch.measured import Measured


@dataclass(frozen=True)
class WatchState:
    url: str
    model: str | None
    measured: Measured | None
    last: Reading | None               # the last reading that answered
    windows: dict[str, Figures | None]
    since_start: Figures | None
    silent_since: float | None         # the first failed read since the last answer
    silent_why: str
    drift: str                         # the drift rule's line ("" when nothing to say)
    drifting: bool
    restarts: int


class Watcher:
    """Each read folded in: a Reading, or the reason a read failed."""

    def __init__(self, url: str, interval: float, measured: Measured | None,
                 log: Path | None = None, drift: Drift | None = None):
        self.url, self.measured, self.log = url, measured, log
        self.model: str | None = None
        self.history = History(interval)
        self.drift = drift or Drift()
        self.silent_since: float | None = None
        self.silent_why = ""
        self.log_error = ""

    def answered(self, r: Reading) -> None:
        self.silent_since, self.silent_why = None, ""
        self.history.add(r)
        if self.measured is None:
            return
        event = self.drift.update(r.t, self.history.window(60.0), self.measured)
        if event is not None and self.log is not None:
            try:
                append_line(self.log, {**event, "url": self.url})
                self.log_error = ""
            except OSError as e:   # said on screen; the watch goes on
                self.log_error = f"the drift log {self.log} cannot be written: {e}"

    def failed(self, why: str, t: float | None = None) -> None:
        if self.silent_since is None:
            self.silent_since = t if t is not None else time.time()
        self.silent_why = why
        if not self.drift.drifting:   # a silence is no evidence: the hold starts again
            self.drift.below_since = None

    def state(self) -> WatchState:
        last, m = self.history.last, self.measured
        return WatchState(self.url, self.model, m, last, self.history.windows(),
                          between(None, last) if last else None, self.silent_since,
                          self.silent_why,
                          " · ".join(x for x in (self.drift.text(last.t, m) if last and m
                                                 else "", self.log_error) if x),
                          self.drift.drifting, self.history.restarts)
