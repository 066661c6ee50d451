"""`eagle-panel watch`'s screen: a serving vLLM's speculative decoding over
the last minute, ten minutes and hour, beside what evaluate measured for the
draft; the drift rule's line; the local GPUs. It draws the WatchState the
app sends (app/watch_app.py) and reads nothing itself."""

from __future__ import annotations

import time

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.screen import Screen
from textual.widgets import Footer, Static

from app.messages import TelemetryRead, WatchRead
from pipeline.watch.history import WINDOWS
from pipeline.watch.state import WatchState
from widgets.gpu_table import GpuTable
from widgets.quiet import QuietStatic


def cell(v: float | None, fmt: str, dim: bool = False) -> Text:
    return Text("-" if v is None else format(v, fmt), style="dim" if dim else "")


def rows(state: WatchState) -> list[tuple[str, str, list]]:
    """(label, format, value per window + measured) for the table."""
    wins = [state.windows.get(name) for name, _ in WINDOWS]
    m = state.measured
    n = max([len(w.per_position) for w in wins if w] + [0])

    def of(get):
        return [get(w) if w else None for w in wins]
    out = [("acceptance length", ".2f", of(lambda w: w.acceptance_length)
            + [m.acceptance_length if m else None]),
           ("accept rate", ".2f", of(lambda w: w.acceptance_rate) + [None])]
    for k in range(n):
        out.append((f"  position {k + 1}", ".2f",
                    of(lambda w, k=k: w.per_position[k] if k < len(w.per_position) else None)
                    + [m.per_position[k] if m and k < len(m.per_position) else None]))
    out += [("drafted tokens/s", ".1f", of(lambda w: w.drafted_per_s) + [None]),
            ("accepted tokens/s", ".1f", of(lambda w: w.accepted_per_s) + [None]),
            ("generated tokens/s", ".1f", of(lambda w: w.generated_per_s) + [None])]
    return out


def figures_table(state: WatchState) -> Table:
    """Windows as columns, then the measurement and the last minute minus it."""
    dim = state.silent_since is not None   # the last figures, kept and greyed
    t = Table(box=None, pad_edge=False, show_edge=False, header_style="bold")
    t.add_column("", no_wrap=True)
    # (Textual draws a rich Table without cell padding: the widths keep the gaps)
    for name, _ in WINDOWS:
        t.add_column(name, justify="right", min_width=8)
    t.add_column("measured", justify="right", min_width=10)
    t.add_column("diff (1 min)", justify="right", min_width=14)
    for label, fmt, vals in rows(state):
        live, want = vals[0], vals[-1]
        diff = None if live is None or want is None else live - want
        t.add_row(label + "  ", *(cell(v, fmt, dim) for v in vals),
                  cell(diff, "+" + fmt, dim or diff is None))
    return t


def gauges_text(state: WatchState) -> Text:
    r, s = state.last, state.since_start
    if r is None:
        return Text("")
    kv = "-" if r.kv_usage is None else f"{r.kv_usage:.1%}"
    t = Text(f"requests running {r.running or 0:.0f} · waiting {r.waiting or 0:.0f} · "
             f"KV cache {kv}", style="dim" if state.silent_since else "")
    if s is not None and s.acceptance_length is not None:
        t.append(f" · since start {s.acceptance_length:.2f} over {s.drafts:,} drafts",
                 style="dim")
    return t


def status_text(state: WatchState) -> Text:
    if state.silent_since is not None:
        return Text(f"no answer since {time.strftime('%H:%M:%S', time.localtime(state.silent_since))}"
                    f" ({state.silent_why}); the last figures stand", style="bold red")
    if state.last is None:
        return Text("reading the server...", style="dim")
    t = Text(f"read {time.strftime('%H:%M:%S', time.localtime(state.last.t))}", style="dim")
    if state.restarts:
        t.append(f" · the server restarted ({state.restarts}x): windows count from then",
                 style="yellow")
    return t


class WatchScreen(Screen):
    DEFAULT_CSS = """
    WatchScreen QuietStatic { height: auto; padding: 0 1; }
    #w-title { background: $boost; }
    #w-table { height: auto; padding: 0 1; }
    #w-drift { color: $error; text-style: bold; }
    #gpu { height: 1fr; padding: 0 1; }
    """
    BINDINGS = [("q", "app.quit", "Quit")]

    def compose(self) -> ComposeResult:
        yield QuietStatic(id="w-title")
        yield QuietStatic(id="w-status")
        yield Static(id="w-table")
        yield QuietStatic(id="w-gauges")
        yield QuietStatic(id="w-drift")
        yield GpuTable(id="gpu")
        yield Footer()

    def on_watch_read(self, message: WatchRead) -> None:
        state: WatchState = message.state
        title = Text("eagle-panel watch ", style="bold")
        title.append(state.url + (f" serving {state.model}" if state.model else ""))
        if state.measured is not None:
            title.append(f" · draft: {state.measured.source}", style="dim")
        self.query_one("#w-title", QuietStatic).set(title)
        self.query_one("#w-status", QuietStatic).set(status_text(state))
        table = self.query_one("#w-table", Static)
        if state.last is not None and not state.last.spec_decode:
            table.update(Text("no speculative decoding on this server: its /metrics has no "
                              "spec_decode counters (it serves no draft)", style="bold"))
        elif state.last is not None:
            table.update(figures_table(state))
        self.query_one("#w-gauges", QuietStatic).set(gauges_text(state))
        self.query_one("#w-drift", QuietStatic).set(state.drift)

    def on_telemetry_read(self, message: TelemetryRead) -> None:
        self.query_one(GpuTable).update_from(message.sample, {}, None)

