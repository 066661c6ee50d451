"""`eagle-panel watch`'s panel (app/watch_app.py) under Pilot, on scripted
reads of a server (each read the next /metrics body, at the next time, on a
fake clock: an hour of serving in a second): the windows and the measured
draft beside them, the drift rule's line and log, a read that fails (the last
figures kept, greyed, "no answer since"), a restart; snapshots at 80x24 and
120x40. The reads of a real vLLM: tests/vllm/test_vllm_pipeline.py."""

import json
import threading
import time

import pytest

from app.watch_app import WatchApp
from pipeline.telemetry import Telemetry
from pipeline.watch.drift import Drift
from pipeline.watch.measured import Measured
from pipeline.watch.scrape import NoAnswer, Target
from tests.helpers import screen_text, until
from tests.unit.test_watch import metrics_text

T0 = 1_790_000_000.0
MEASURED = Measured(3.0, [0.9, 0.7, 0.4], 3, "run demo, checkpoint 7")


class Scripted:
    """The reads a test scripts: (seconds after T0, /metrics body or None for
    no answer). Past the script, reading stops (the app's stop_after)."""

    def __init__(self, minutes_rates: list, hold_before: int | None = None):
        self.hold_before, self.go = hold_before, threading.Event()   # a read held for a test
        self.steps, drafts, per = [], 0, [0.0, 0.0, 0.0]
        for minute, rates in minutes_rates:
            if rates is None:
                self.steps.append((60.0 * minute, None))
                continue
            drafts += 100
            per = [p + 100 * r for p, r in zip(per, rates, strict=True)]
            self.steps.append((60.0 * minute, metrics_text(drafts, sum(per), per, 4 * drafts)))
        self.i = -1

    def source(self) -> str:
        self.i += 1
        if self.i == self.hold_before:
            self.go.wait(60)
        body = self.steps[self.i][1]
        if body is None:
            raise NoAnswer("HTTP 503 from http://127.0.0.1:9/metrics")
        return body

    def clock(self) -> float:
        return T0 + self.steps[max(self.i, 0)][0]


class OneSample(Telemetry):
    """The simulated GPUs' first sample, every time (a picture that does not
    depend on how many samples the loop took)."""

    def sample(self):
        self._first = getattr(self, "_first", None) or super().sample()
        return self._first


GOOD, LOW = (0.9, 0.7, 0.4), (0.9, 0.4, 0.2)
DRIFTING = [(m, GOOD) for m in range(3)] + [(m, LOW) for m in range(3, 10)]


@pytest.fixture(autouse=True)
def utc(monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def app_for(script: Scripted, log=None) -> WatchApp:
    return WatchApp(Target("http://127.0.0.1:9"), 0.01, MEASURED, log,
                    telemetry=OneSample(simulate=2, host=False), source=script.source,
                    clock=script.clock, stop_after=len(script.steps))


def text_of(app, widget_id: str) -> str:
    return str(app.screen.query_one(widget_id).render())


async def test_drift_a_failed_read_and_a_restart(tmp_path):
    """Ten minutes read (the last seven below the measurement: a drift at
    five), then a read that fails, held there until the test has looked,
    then an answer again."""
    log = tmp_path / "drift.jsonl"
    script = Scripted(DRIFTING + [(10, None), (11, LOW)], hold_before=11)
    app = app_for(script, log)
    async with app.run_test(size=(100, 30)) as pilot:
        try:
            await looked_at_a_failed_read(app, pilot)
        finally:
            script.go.set()   # (a failed check: the held read goes, the app can end)
        await until(pilot, lambda: app.reads == len(script.steps) and
                    "read 14:24:20" in text_of(app, "#w-status"), what="an answer again")
    text = log.read_text()
    events = [json.loads(ln) for ln in text.splitlines()]   # whole JSON lines only
    assert text.endswith("\n") and [e["event"] for e in events] == ["drift"], text
    assert events[0]["positions_fell"] == [2, 3] and events[0]["t"] == T0 + 480


async def looked_at_a_failed_read(app, pilot) -> None:
    """At the held read: the drift said, the failed read said, the last
    figures kept beside the measured ones."""
    await until(pilot, lambda: app.reads == 11 and "no answer since 14:23:20" in
                text_of(app, "#w-status"), what="the failed read said")   # T0 + 600 s, UTC
    assert "DRIFT" in text_of(app, "#w-drift") and \
        "positions 2, 3 fell" in text_of(app, "#w-drift")
    lines = screen_text(app).splitlines()
    table = next(ln for ln in lines if "acceptance length" in ln)
    # the last minute 2.50 (minutes 3-9 at 1 + 0.9 + 0.4 + 0.2); ten minutes and the hour
    # both since the first read: minutes 1-2 at 3.00 in them, 2.61; the measured 3.00
    assert table.split()[2:] == ["2.50", "2.61", "2.61", "3.00", "-0.50"], table
    position2 = next(ln for ln in lines if "position 2" in ln)
    assert position2.split()[2:] == ["0.40", "0.47", "0.47", "0.70", "-0.30"], position2


async def test_a_restart_is_said_and_counted_from(tmp_path):
    script = Scripted([(0, GOOD), (1, GOOD)])
    script.steps.append((120.0, metrics_text(10, 15, [8, 5, 2], 40)))   # counters went back
    app = app_for(script)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: "restarted (1x)" in text_of(app, "#w-status"),
                    what="the restart said")
        assert "since start 2.50 over 10 drafts" in text_of(app, "#w-gauges")


async def test_an_answer_nobody_foresaw_is_said_not_a_crash():
    """A read that raises what no rule expects is taken as a failed read
    (its words on the status line): the panel lives on and draws the next
    answer (before the catch-all, the worker's exception ended the app)."""
    script = Scripted([(0, GOOD), (1, GOOD), (2, GOOD)])
    real = script.source

    def source():
        if script.i == 0:   # the second read
            script.i += 1
            raise RuntimeError("something new")
        return real()
    app = WatchApp(Target("http://127.0.0.1:9"), 0.01, MEASURED, None,
                   telemetry=OneSample(simulate=2, host=False), source=source,
                   clock=script.clock, stop_after=3)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.reads == 3 and "read 14:15:20" in
                    text_of(app, "#w-status"), what="the reads after the odd one")
    assert app.watcher.history.last is not None


def test_drift_defaults():
    """The rule's defaults as documented (pipeline/watch/drift.py says why)."""
    assert (Drift().margin, Drift().hold_s) == (0.10, 300.0)


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
def test_watch_screen(snap_compare, size):
    script = Scripted(DRIFTING)
    app = app_for(script)

    async def read_all(pilot):
        await until(pilot, lambda: app.reads == len(script.steps) and "DRIFT" in
                    text_of(app, "#w-drift"), what="every scripted read drawn")
        await until(pilot, lambda: app.screen.query_one("#gpu").snapshot is not None,
                    what="the GPUs drawn")
        await pilot.pause()
    assert snap_compare(app, run_before=read_all, terminal_size=size)
