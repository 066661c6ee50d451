"""`eagle-panel watch URL`: the panel attached to a serving vLLM, read-only.
A worker thread reads /metrics every `interval` seconds, one request at a
time (a slow server is never sent a second), folds each read into the
Watcher (the hour's history, the drift rule, its log) and sends the screen
the state; another samples the local GPUs as the main panel does. A read
in flight when `q` is pressed is waited for (its timeout: the interval, 1 to
10 s)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from textual import work
from textual.app import App

from app.messages import TelemetryRead, WatchRead
from app.screens.watch import WatchScreen
from pipeline.telemetry import Telemetry
from pipeline.watch.figures import NotVllm, read
from pipeline.watch.measured import Measured
from pipeline.watch.scrape import NoAnswer, Target
from pipeline.watch.state import Watcher


class WatchApp(App):
    TITLE = "eagle-panel watch"

    def __init__(self, target: Target, interval: float, measured: Measured | None,
                 log: Path | None = None, telemetry: Telemetry | None = None,
                 source=None, clock=time.time, stop_after: int | None = None):
        super().__init__()
        self.target, self.interval, self.clock = target, interval, clock
        self.timeout = max(1.0, min(interval, 10.0))
        self.source = source or (lambda: target.metrics(self.timeout))
        self.watcher = Watcher(target.url, interval, measured, log)
        self.telemetry = telemetry or Telemetry()
        self._stop = threading.Event()
        self.reads = 0          # reads folded in (a test waits on it)
        self.stop_after = stop_after   # a test's: the reads it scripted, then no more

    def on_mount(self) -> None:
        self.screen_ = WatchScreen()
        self.push_screen(self.screen_)
        self._read_loop()
        self._sample_gpus()

    @work(thread=True, exclusive=True, group="metrics")
    def _read_loop(self) -> None:
        """The Watcher is this thread's alone; the screen gets an immutable
        WatchState (post_message is thread-safe)."""
        self.watcher.model = self.target.served_model(self.timeout)
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                self.watcher.answered(read(self.source(), self.clock()))
            except (NoAnswer, NotVllm) as e:
                self.watcher.failed(str(e), self.clock())
            except Exception as e:  # noqa: BLE001 - an answer we did not foresee is said on
                self.watcher.failed(f"{type(e).__name__}: {e}", self.clock())   # screen, not a crash
            self.reads += 1
            if self._stop.is_set():
                return   # (quitting: the screen is going)
            self.screen_.post_message(WatchRead(self.watcher.state()))
            if self.stop_after is not None and self.reads >= self.stop_after:
                return
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - t0)))

    @work(thread=True, exclusive=True, group="telemetry")
    def _sample_gpus(self) -> None:
        while not self._stop.is_set():
            snap = self.telemetry.sample()
            if not self._stop.is_set():
                self.screen_.post_message(TelemetryRead(snap))
            self._stop.wait(max(Telemetry.MIN_INTERVAL, 2.0))

    def action_quit(self) -> None:
        self._stop.set()   # the read loop ends at its next look, not at unmount
        self.exit()

    def on_unmount(self) -> None:
        self._stop.set()
        self.telemetry.close()


def run_watch(target: Target, interval: float, measured: Measured | None,
              log: Path | None) -> int:
    """The panel until q; 1 when the server never answered."""
    app = WatchApp(target, interval, measured, log)
    app.run()
    return 0 if app.watcher.history.last is not None else 1

