"""GPUs: memory bar, utilization, temperature, power, PCIe, a 0-100 history,
and which stage holds each GPU; a host line under them.

One line widget per row, redrawn only when its text changes (a GPU whose
numbers hold still costs nothing over SSH). Every GPU stays on screen: when
the tab is too short for one GPU per line (8 GPUs at 80x24 under six
stages), two GPUs share a line in a compact form. The host line is cut to
the width, never wrapped."""

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
    # 1fr: the table knows the height it has (the pane's), to choose the layout.
    DEFAULT_CSS = """
    GpuTable { height: 1fr; }
    GpuTable > QuietStatic { height: auto; }
    #gpu-rows { height: auto; }
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

    def two_columns(self, n_gpus: int, banner: bool, sim: bool) -> bool:
        """True when one GPU per line would not fit the height the tab has."""
        height = self.size.height
        other = 2 + int(banner) + int(sim)   # header, host line, banner, note
        return height > 0 and n_gpus + other > height

    def update_from(self, snap, holders: dict[int, str], forecast: dict | None) -> None:
        self.record(snap)
        self.holders, self.forecast = holders, forecast
        wide = self.size.width >= 120
        sim = snap.source == "simulated"
        gpus = snap.gpus
        pairs = self.two_columns(len(gpus), bool(snap.banner), sim)
        lines = [gpus[i:i + 2] for i in range(0, len(gpus), 2)] if pairs else [[g] for g in gpus]
        rows = self.query_one("#gpu-rows", Vertical)
        while len(self._rows) < len(lines):
            line = QuietStatic()
            self._rows.append(line)
            rows.mount(line)
        banner = self.query_one("#gpu-banner", QuietStatic)
        banner.display = bool(snap.banner)   # an empty line would still take a row
        banner.set(Text(snap.banner or "", style="yellow"))
        header = self._header_pairs() if pairs else self._header(wide, sim)
        self.query_one("#gpu-header", QuietStatic).set(header if gpus else Text(""))
        half = max(20, (self.size.width - 2) // 2)
        for line, group in zip(self._rows, lines, strict=False):   # spare rows stay hidden
            line.display = True
            if pairs:
                t = Text()
                for g in group:
                    t.append_text(_cell(self._compact(g, sim), half))
                line.set(t)
            else:
                line.set(self._row(group[0], wide, sim))
        for line in self._rows[len(lines):]:
            line.display = False   # rows of the other layout: they would still take height
        note = self.query_one("#gpu-note", QuietStatic)
        note.display = sim
        note.set(Text("* SIMULATED numbers (--simulate-gpus), not a real GPU",
                      style="bold magenta"))
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

    def _header_pairs(self) -> Text:
        half = max(20, (self.size.width - 2) // 2)
        one = _cell(" GPU Memory           Util Temp Stage", half)
        return Text.assemble(one, one.copy(), style="bold")

    def _compact(self, g, sim: bool) -> Text:
        """One GPU in half a line: index, memory bar and figures, util, temp, stage."""
        t = Text(" ")
        t.append_text(_cell(f"{g.index}" + ("*" if sim else ""), 3))
        if g.error:
            t.append(g.error, style="bold red")
            return t
        frac = g.mem_used / g.mem_total if g.mem_used is not None and g.mem_total else None
        t.append_text(bar(frac, 5))
        t.append(f" {g.mem_used / GiB:3.0f}/{g.mem_total / GiB:3.0f}G" if frac is not None
                 else "    -   ")
        t.append_text(_cell("-" if g.util is None else f"{g.util:.0f}%", 5, right=True))
        t.append_text(_cell("-" if g.temp is None else f"{g.temp:.0f}C", 5, right=True))
        t.append(" ")
        t.append(self.holders.get(g.index, ""), style="bold cyan")
        return t

    def _host_line(self) -> Text:
        h = self.snapshot.host if self.snapshot else None
        line = Text(" host ", style="bold")
        if h is None:
            return line
        line.append(f"CPU {h.cpu_percent:.0f}%  RAM {h.mem_used / GiB:.1f}/{h.mem_total / GiB:.1f}G")
        if h.disk_free is not None:
            line.append(f"  disk {fmt.nbytes(h.disk_free)} free")
        fc = self.forecast
        if fc and fc.get("disk_needed_bytes") is not None:
            need = fc["disk_needed_bytes"]
            style = "bold red" if h.disk_free is not None and need > h.disk_free else ""
            line.append(f", {fmt.nbytes(need)} of hidden states to write", style=style)
        if self.size.width > 0 and line.cell_len > self.size.width - 2:
            line.truncate(self.size.width - 2, overflow="ellipsis")
        return line

    def plain(self) -> str:
        """What the table shows, as text (tests, debugging)."""
        parts = [w._last.plain for w in self.query(QuietStatic) if getattr(w, "_last", None)]
        return "\n".join(parts)
