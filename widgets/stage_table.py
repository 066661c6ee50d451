"""The stages: status, attempt, duration, progress with rate and ETA, exit.

One line widget per stage, each redrawn only when its text changes: over
SSH the bytes sent are the cost, and a whole-table repaint every second for
one ticking duration would send six lines instead of one.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from rich.text import Text
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message

from pipeline import fmt
from pipeline.run.rundir import Status
from pipeline.run.snapshot import StageView
from pipeline.stage_graph import STAGE_NAMES
from pipeline.vllm import startup
from widgets.bars import count, progress_bar
from widgets.quiet import QuietStatic

STATUS_STYLE = {Status.PENDING: "dim", Status.SKIPPED: "dim", Status.RUNNING: "bold cyan",
                Status.SUCCEEDED: "green",
                Status.FAILED: "bold red", Status.CANCELLED: "yellow"}
# column: (title, width); the last column takes what is left
ENDED = (Status.FAILED, Status.CANCELLED, Status.SUCCEEDED, Status.SKIPPED)
COLUMNS = (("Stage", 10), ("Status", 10), ("Att", 3), ("Time", 7), ("Progress", 18),
           ("Rate / ETA", 16), ("Exit", 7))


class StageTable(Vertical, can_focus=True):
    DEFAULT_CSS = """
    StageTable { height: auto; }
    StageTable > QuietStatic { height: 1; }
    StageTable > .header { text-style: bold; background: $boost; }
    StageTable > .selected { background: $accent 30%; }
    StageTable:focus > .selected { background: $accent 60%; }
    """
    BINDINGS = [Binding("up,k", "move(-1)", show=False), Binding("down,j", "move(1)", show=False)]

    class Selected(Message):
        def __init__(self, stage: str):
            super().__init__()
            self.stage = stage

    def __init__(self, **kw):
        super().__init__(**kw)
        self.cursor_row = 0
        self.cells: dict[str, dict[str, str]] = {s: {c: "" for c, _ in COLUMNS} for s in STAGE_NAMES}
        self.cells.update({s: {**self.cells[s], "Stage": s} for s in STAGE_NAMES})

    def compose(self):
        yield QuietStatic(self._row_text({c: c for c, _ in COLUMNS}, header=True), classes="header")
        for i, s in enumerate(STAGE_NAMES):
            yield QuietStatic(self._row_text(self.cells[s]), id=f"row-{s}",
                       classes="selected" if i == 0 else "")

    @property
    def selected_stage(self) -> str:
        return STAGE_NAMES[self.cursor_row]

    def select(self, stage: str) -> None:
        self.action_move(STAGE_NAMES.index(stage) - self.cursor_row)

    def action_move(self, delta: int) -> None:
        new = min(len(STAGE_NAMES) - 1, max(0, self.cursor_row + delta))
        if new == self.cursor_row:
            return
        self.query_one(f"#row-{self.selected_stage}").remove_class("selected")
        self.cursor_row = new
        self.query_one(f"#row-{self.selected_stage}").add_class("selected")
        self.post_message(self.Selected(self.selected_stage))

    def on_click(self, event) -> None:
        row = event.y - 1
        if 0 <= row < len(STAGE_NAMES):
            self.action_move(row - self.cursor_row)

    def get_cell(self, stage: str, col: str) -> str:
        return self.cells[stage][col]

    def _row_text(self, cells: dict, header: bool = False) -> Text:
        """The cells in their columns; a cell too long for its column runs on
        into the next one when that is empty (a finished stage's end)."""
        t, spill = Text(" "), 0
        for i, (col, width) in enumerate(COLUMNS):
            if spill:   # taken by the cell before
                spill -= 1
                continue
            v = cells.get(col, "")
            piece = v if isinstance(v, Text) else Text(str(v))
            if piece.cell_len > width and i + 1 < len(COLUMNS) and \
                    not str(cells.get(COLUMNS[i + 1][0], "")):
                width, spill = width + 1 + COLUMNS[i + 1][1], 1
            piece.truncate(width, pad=True)
            t.append_text(piece)
            t.append(" ")
        return t

    def refresh_from(self, stages: Mapping[str, StageView], now: float | None = None) -> None:
        """Time counts every attempt of the stage (a cancelled first try included)."""
        now = now or time.time()
        for s in STAGE_NAMES:
            row = stages[s]
            status = row.status
            prog = dict(row.progress.event) if row.progress and row.attempt else None
            live = [dict(v.event) for v in row.servers if not v.stopped]
            starting = [e for e in live if e.get("phase") != startup.READY] \
                if status == Status.RUNNING else []
            seconds = row.seconds(now)
            styled = {
                "Stage": s,
                "Status": Text(status, style=STATUS_STYLE.get(status, "")),
                "Att": str(row.attempt or ""),
                "Time": fmt.duration(seconds) if seconds is not None else "",
                "Progress": self._servers(starting, len(live)) if starting
                else self._progress(prog, status, row.summary.stopped),
                "Rate / ETA": self._server_state(starting, now) if starting
                else self._rate(prog, status),
                "Exit": Text(fmt.exit_text(row.state) if status in ENDED
                             else "", style="red" if status == Status.FAILED else ""),
            }
            self.cells[s] = {k: (v.plain if isinstance(v, Text) else v) for k, v in styled.items()}
            self.query_one(f"#row-{s}", QuietStatic).set(self._row_text(styled))

    @staticmethod
    def _progress(ev, status: str = Status.RUNNING, stopped: str | None = None) -> Text:
        """A bar with done/total while the stage runs (or stopped part-way);
        a stage that succeeded says what it did, no bar (one that stopped
        early on a plateau is not 62% of anything), and why it did less than
        planned: "1620 steps, plateau at epoch 5" (`stopped`: train's summary's why)."""
        if not ev:
            return Text("")
        if status == Status.SUCCEEDED:
            unit, done, total = ev.get("unit", ""), ev.get("done", 0), ev.get("total")
            why = stopped
            if total and done < total:   # train says why it stopped; another stage, what of
                return Text(f"{count(done)} {unit}, {str(why).split(':')[0]}" if why
                            else f"{count(done)}/{count(total)} {unit}".rstrip())
            return Text(f"{count(done)} {unit}".rstrip())
        t = progress_bar(ev.get("done", 0), ev.get("total"), 8)
        total = ev.get("total")
        done = count(ev.get("done"))
        t.append(f" {done}/{count(total)}" if total else f" {done}")
        return t

    @staticmethod
    def _servers(starting: list[dict], count: int) -> Text:
        """A start in progress: a bar over the shards while one server loads
        its weights, else the phase; with several, how many are ready."""
        if count > 1:
            return Text(f"servers {count - len(starting)}/{count} up")
        ev = starting[0]
        if ev.get("total"):
            t = progress_bar(ev.get("done", 0), ev["total"], 8)
            t.append(f" {ev['done']}/{ev['total']}")
            return t
        return Text(ev.get("phase", ""), style="cyan")

    @staticmethod
    def _server_state(starting: list[dict], now: float) -> Text:
        stalled = [e for e in starting if e.get("stalled_s")]
        if stalled:
            return Text(f"STALLED {fmt.duration(stalled[0]['stalled_s'])}", style="bold red")
        ev = min(starting, key=lambda e: startup.ORDER.index(e.get("phase", startup.STARTING))
                 if e.get("phase") in startup.ORDER else 0)
        what = "loading" if ev.get("phase") == startup.LOADING else "vLLM"
        # the time since the start, counted on from the last report (every 10 s)
        elapsed = (ev.get("elapsed_s") or 0) + max(0.0, now - ev.get("t", now))
        if ev.get("expected_s"):   # beside the last start of this target here
            return Text(f"{fmt.duration(elapsed)} of ~{fmt.duration(ev['expected_s'])}",
                        style="cyan")
        return Text(f"{what} {fmt.duration(elapsed)}", style="cyan")

    @staticmethod
    def _rate(ev, status) -> str:
        if not ev or status != Status.RUNNING:
            return ""
        if ev.get("phase"):   # between counted units: validating, saving a checkpoint
            return ev["phase"]
        parts = []
        if ev.get("rate"):
            parts.append(fmt.rate_text(ev["rate"]))
        if ev.get("eta_s") is not None:
            parts.append(f"ETA {fmt.duration(ev['eta_s'])}")
        return " ".join(parts)
