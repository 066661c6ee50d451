"""GPUs: memory bar, utilization, temperature, power, PCIe, a 0-100 history,
and which stage holds each GPU; a host line under them.

One line widget per GPU, redrawn only when its text changes (a GPU whose
numbers hold still costs nothing over SSH)."""

from __future__ import annotations

from collections import deque

from rich.text import Text
from textual.containers import Vertical

from app import fmt
from widgets.bars import bar, sparkline
from widgets.quiet import QuietStatic

GiB = 1 << 30


def _cell(t, width: int, right: bool = False) -> Text:
    t = t if isinstance(t, Text) else Text(str(t))
    if right and t.cell_len < width:
        t = Text(" " * (width - t.cell_len)) + t
    t.truncate(width, pad=True)
    return t


class GpuTable(Vertical):
    DEFAULT_CSS = """
    GpuTable { height: auto; }
    GpuTable > QuietStatic { height: auto; }
    """

    def __init__(self, history: int = 60, **kw):
        super().__init__(**kw)
        self.history: dict[int, deque] = {}
        self.history_len = history
        self.snapshot = None
        self.holders: dict[int, str] = {}
        self.forecast: dict | None = None
        self._rows: list[QuietStatic] = []

    def compose(self):
        yield QuietStatic(id="gpu-banner")
        yield QuietStatic(id="gpu-header")
        yield Vertical(id="gpu-rows")
        yield QuietStatic(id="gpu-note")
        yield QuietStatic(id="gpu-host")

    def record(self, snap) -> None:
        """Take a sample into the history without drawing."""
        if snap is self.snapshot:
            return
        self.snapshot = snap
        for g in snap.gpus:
            self.history.setdefault(g.index, deque(maxlen=self.history_len)).append(g.util)

    def on_resize(self, _event) -> None:
        # Columns depend on the width: a first draw before layout, or a
        # terminal resize, must not leave the narrow (or wide) layout behind.
        if self.snapshot is not None:
            self.update_from(self.snapshot, self.holders, self.forecast)

    def update_from(self, snap, holders: dict[int, str], forecast: dict | None) -> None:
        self.record(snap)
        self.holders, self.forecast = holders, forecast
        wide = self.size.width >= 120
        rows = self.query_one("#gpu-rows", Vertical)
        while len(self._rows) < len(snap.gpus):
            line = QuietStatic()
            self._rows.append(line)
            rows.mount(line)
        sim = snap.source == "simulated"
        self.query_one("#gpu-banner", QuietStatic).set(
            Text(snap.banner, style="yellow") if snap.banner else Text(""))
        self.query_one("#gpu-header", QuietStatic).set(self._header(wide, sim) if snap.gpus else Text(""))
        for line, g in zip(self._rows, snap.gpus):
            line.set(self._row(g, wide, sim))
        self.query_one("#gpu-note", QuietStatic).set(
            Text("* SIMULATED numbers (--simulate-gpus), not a real GPU", style="bold magenta")
            if sim else Text(""))
        self.query_one("#gpu-host", QuietStatic).set(self._host_line())

    @staticmethod
    def _widths(wide: bool):
        return dict(idx=4, mem=26 if wide else 18, util=5, temp=5, power=10, pcie=20 if wide else 0,
                    hist=30 if wide else 10, stage=10)

    def _header(self, wide: bool, sim: bool) -> Text:
        w = self._widths(wide)
        t = Text(" ", style="bold")
        for name, key, right in (("GPU", "idx", False), ("Memory", "mem", False),
                                 ("Util", "util", True), ("Temp", "temp", True),
                                 ("Power", "power", True), ("PCIe rx/tx", "pcie", True),
                                 ("History", "hist", False), ("Stage", "stage", False)):
            if w[key]:
                t.append_text(_cell(name, w[key], right))
                t.append(" ")
        return t

    def _row(self, g, wide: bool, sim: bool) -> Text:
        w = self._widths(wide)
        t = Text(" ")
        # Styles only where they carry meaning: each style change costs ~25
        # bytes on the wire, and this row is resent every refresh.
        t.append_text(_cell(f"{g.index}" + ("*" if sim else ""), w["idx"]))
        t.append(" ")
        if g.error:
            t.append(g.error, style="bold red")
            return t
        frac = g.mem_used / g.mem_total if g.mem_used is not None and g.mem_total else None
        mem = bar(frac, w["mem"] - 9)
        if frac is not None:
            mem.append(f" {g.mem_used / GiB:3.0f}/{g.mem_total / GiB:3.0f}G")
        power = "-" if g.power is None else (
            f"{g.power:.0f}/{g.power_limit:.0f}W" if g.power_limit else f"{g.power:.0f}W")
        cells = [(mem, "mem", False),
                 ("-" if g.util is None else f"{g.util:.0f}%", "util", True),
                 ("-" if g.temp is None else f"{g.temp:.0f}C", "temp", True),
                 (power, "power", True)]
        if wide:
            cells.append(("-" if g.pcie_rx is None else
                          f"{fmt.nbytes(g.pcie_rx)}/s {fmt.nbytes(g.pcie_tx)}/s", "pcie", True))
        cells += [(sparkline(self.history.get(g.index, ()), w["hist"]), "hist", False),
                  (Text.assemble((self.holders.get(g.index, ""), "bold cyan")), "stage", False)]
        for value, key, right in cells:
            t.append_text(_cell(value, w[key], right))
            t.append(" ")
        return t

    def _host_line(self) -> Text:
        h = self.snapshot.host if self.snapshot else None
        line = Text(" host ", style="bold")
        if h is None:
            return line
        line.append(f"CPU {h.cpu_percent:.0f}%  RAM {h.mem_used / GiB:.1f}/{h.mem_total / GiB:.1f}G")
        if h.disk_free is not None:
            line.append(f"  disk free {fmt.nbytes(h.disk_free)}")
        fc = self.forecast
        if fc and fc.get("disk_needed_bytes") is not None:
            need = fc["disk_needed_bytes"]
            style = "bold red" if h.disk_free is not None and need > h.disk_free else ""
            line.append(f"  hidden states still to write {fmt.nbytes(need)}", style=style)
        return line

    def plain(self) -> str:
        """What the table shows, as text (tests, debugging)."""
        parts = [w._last.plain for w in self.query(QuietStatic) if getattr(w, "_last", None)]
        return "\n".join(parts)
