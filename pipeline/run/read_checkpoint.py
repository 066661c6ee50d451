"""The read model's checkpoint: a stage's folded events, saved beside them.

`status`, `runs`, `compare` and the panel show where a run stands: six rows,
a progress figure, bounded curves. Replaying a week's events.jsonl for that
(1,000,000 events: 7.5 s and 105 MB before this module) costs the history, not
what is shown. So the stage's supervisor, which outlives every reader, folds
its events as they are written and saves the fold every SAVE_EVERY_S seconds
(or SAVE_EVERY_BYTES of new events) and once more when the stage ends:

    <stage>/read-model.json   {format, offset, anchor, bad_lines, fold}

A reader loads it, then reads the events after `offset` only. It is derived
and disposable, and the events stay the one source of truth:
- deleting it changes nothing but speed;
- it is written atomically and only ever covers bytes already in the file
  (the events are append-only and it is saved after they are read), so a
  killed writer leaves the previous one, never one ahead of the events;
- a reader that finds it damaged, of another format, a link out of the run,
  or not matching the file (shorter than its offset; `anchor`, a hash of the
  bytes before the offset, differs: the file was replaced or rewritten)
  ignores it and replays the events, saying nothing wrong: the result is the
  same, only slower.
Validation where it pays: each line is checked once, when it is folded
(events.valid_event); the checkpoint's events are checked again on load,
because the file could be damaged by hand like any other.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time

from pipeline.run.events import EventTail
from pipeline.run.rundir import RunDir, RunDirError, atomic_write_bytes
from pipeline.run.stage_fold import StageFold

FORMAT = 1
NAME = "read-model.json"
SAVE_EVERY_S = 30.0
SAVE_EVERY_BYTES = 4 << 20
ANCHOR_BYTES = 4096


def path_of(run: RunDir, stage: str):
    return run.stage_dir(stage) / NAME


def anchor(events_path, offset: int) -> str:
    """A hash of the first and last ANCHOR_BYTES before `offset`: a file
    replaced by another of the same length or longer does not match."""
    with open(events_path, "rb") as f:
        head = f.read(min(offset, ANCHOR_BYTES))
        f.seek(max(0, offset - ANCHOR_BYTES))
        tail = f.read(min(offset, ANCHOR_BYTES))
    return hashlib.blake2b(head + b"|" + tail + b"|" + str(offset).encode(),
                           digest_size=16).hexdigest()


def save(run: RunDir, stage: str, fold: StageFold, tail: EventTail) -> None:
    """The fold as of `tail.offset`, written atomically. What the tail holds
    of a half-written line is not covered: the offset is the last line end."""
    offset = tail.offset - len(tail._partial)
    body = {"format": FORMAT, "offset": offset, "anchor": anchor(tail.path, offset),
            "bad_lines": tail.bad_lines, "fold": fold.to_json()}
    atomic_write_bytes(path_of(run, stage), json.dumps(body, separators=(",", ":")).encode())


def load(run: RunDir, stage: str) -> tuple[StageFold, EventTail] | None:
    """The saved fold and a tail at its offset, or None when there is none
    a reader may trust (see the module's docstring): then replay."""
    path, events = path_of(run, stage), run.events_path(stage)
    try:
        run.readable(path, "a read model")
        with open(path, "rb") as f:
            body = json.loads(f.read())
        offset = body["offset"]
        if body["format"] != FORMAT or not isinstance(offset, int) or offset < 0:
            return None
        with open(events, "rb") as f:
            if os.fstat(f.fileno()).st_size < offset:
                return None
            if offset:
                f.seek(offset - 1)
                if f.read(1) != b"\n":
                    return None
        if anchor(events, offset) != body["anchor"]:
            return None
        fold = StageFold.from_json(body["fold"])
        tail = EventTail(events, offset=offset)
        tail.bad_lines = int(body["bad_lines"])
    except (OSError, RunDirError, ValueError, TypeError, KeyError, AttributeError,
            RecursionError):
        return None
    return fold, tail


def catch_up(fold: StageFold, tail: EventTail, max_bytes: int = 8 << 20) -> int:
    """Fold what the file has past the tail's offset; the bytes read."""
    start = tail.offset
    while True:
        before = tail.offset
        for ev in tail.poll(max_bytes):
            fold.apply(ev)
        if tail.offset == before:
            return tail.offset - start


def refresh(run: RunDir, stage: str) -> StageFold:
    """Bring the stage's checkpoint up to its events' end (from the saved one
    when it is good, else from the start) and save it."""
    got = load(run, stage)
    fold, tail = got if got is not None else (StageFold(), EventTail(run.events_path(stage)))
    catch_up(fold, tail)
    save(run, stage, fold, tail)
    return fold


class Keeper:
    """The supervisor's thread that keeps a stage's checkpoint current while
    the stage writes: it folds new events as they come and saves every
    `every_s` seconds or `every_bytes` of new events, and once more at
    `stop()`. Its failures (a full disk, a read-only run) cost speed only:
    it never fails the supervisor, which must record the stage's end."""

    def __init__(self, run: RunDir, stage: str, every_s: float = SAVE_EVERY_S,
                 every_bytes: int = SAVE_EVERY_BYTES):
        self.run, self.stage = run, stage
        self.every_s, self.every_bytes = every_s, every_bytes
        self.saves, self.error = 0, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="read-model", daemon=True)
        self._fold = self._tail = None

    def start(self) -> Keeper:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Fold what is left and save it (the stage has ended: its events are whole)."""
        self._stop.set()
        self._thread.join()
        self._step(then_save=True)

    def _loop(self) -> None:
        pending, saved_at = 0, time.monotonic()
        while not self._stop.wait(min(1.0, self.every_s)):
            pending += self._step(then_save=False)
            if pending >= self.every_bytes or time.monotonic() - saved_at >= self.every_s:
                if pending:
                    self._step(then_save=True)
                pending, saved_at = 0, time.monotonic()

    def _step(self, then_save: bool) -> int:
        """Fold the new events (the first time, from the saved checkpoint or
        the start); save when asked. The bytes read."""
        try:
            if self._fold is None:
                got = load(self.run, self.stage)
                self._fold, self._tail = got if got is not None else (
                    StageFold(), EventTail(self.run.events_path(self.stage)))
            read = catch_up(self._fold, self._tail)
            if then_save:
                save(self.run, self.stage, self._fold, self._tail)
                self.saves += 1
            return read
        except Exception as e:   # noqa: BLE001 (speed only: see the class)
            self.error = e
            return 0
