"""GPUs: memory bar, utilization, temperature, power, PCIe, a 0-100 history,
and which stage holds each GPU; a host line under them.

One line widget per row, redrawn only when its text changes (a GPU whose
numbers hold still costs nothing over SSH). Every GPU stays on screen: when
the tab is too short for one GPU per line (8 GPUs at 80x24 under six
stages), two GPUs share a line in a compact form. The host line is cut to
the width, never wrapped.

A Slurm run's nodes (pipeline.cluster.node_telemetry) are shown one line per node
(sums, mean utilization, hottest GPU, the stage, STALE when its sampler went
quiet while the stage runs, LOST with the scheduler's word when it says the
node is down or not responding); `drill_next` shows one node's GPUs in the
one-machine layout, then the next node's, then all nodes again."""

from __future__ import annotations

from collections import deque

from rich.text import Text
from textual.containers import Vertical

from pipeline import fmt
from widgets.bars import bar, sparkline
from widgets.quiet import QuietStatic

GiB = 1 << 30


def _cell(t, width: int, right: bool = False) -> Text:
    t = t if isinstance(t, Text) else Text(str(t))
    if right and t.cell_len < width:
        t = Text(" " * (width - t.cell_len)) + t
    t.truncate(width, pad=True)
    return t


class GpuLine(QuietStatic):
    """One line of the table. New text that stays one line (not empty, no
    newline, no wider than the widget) changes no size: it is redrawn without
    the layout pass of the whole screen that Static.update does by default
    (measured: the GPU tab's rows every refresh, `g` from node to node)."""

    def set(self, content) -> None:
        old = getattr(self, "_last", None)
        if old == content:
            return
        self._last = content
        width = self.size.width
        same_size = width > 0 and all(isinstance(t, Text) and 0 < t.cell_len <= width
                                      and "\n" not in t.plain for t in (old, content))
        self.update(content, layout=not same_size)


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
        self.running: frozenset[str] = frozenset()
        self.drill: int | None = None     # which node's GPUs are shown (None: all nodes)
        self._rows: list[GpuLine] = []

    def compose(self):
        yield GpuLine(id="gpu-banner")
        yield GpuLine(id="gpu-header")
        yield Vertical(id="gpu-rows")
        yield GpuLine(id="gpu-note")
        yield GpuLine(id="gpu-host")

    def record(self, snap) -> None:
        """Take a sample into the history without drawing."""
        if snap is self.snapshot:
            return
        self.snapshot = snap
        for g in snap.gpus:
            self.history.setdefault(g.index, deque(maxlen=self.history_len)).append(g.util)
        for node in snap.nodes:
            if node.stale_s > 0:
                continue   # its file has not changed since the last look: no new sample
            for g in node.gpus:
                self.history.setdefault((node.host, g.index),
                                        deque(maxlen=self.history_len)).append(g.util)

    def on_resize(self, _event) -> None:
        # Columns depend on the width: a first draw before layout, or a
        # terminal resize, must not leave the narrow (or wide) layout behind.
        if self.snapshot is not None:
            self.update_from(self.snapshot, self.holders, self.forecast, self.running)

    def two_columns(self, n_gpus: int, banner: bool, sim: bool) -> bool:
        """True when one GPU per line would not fit the height the tab has."""
        height = self.size.height
        other = 2 + int(banner) + int(sim)   # header, host line, banner, note
        return height > 0 and n_gpus + other > height

    def update_from(self, snap, holders: dict[int, str], forecast: dict | None,
                    running: frozenset[str] = frozenset()) -> None:
        self.record(snap)
        self.holders, self.forecast, self.running = holders, forecast, running
        if snap.nodes:
            self._draw_nodes(snap.nodes)
            return
        sim = snap.source == "simulated"
        self._draw_gpus(snap.gpus, snap.banner, sim, self.history, holders)
        self._set_note("* SIMULATED numbers (--simulate-gpus), not a real GPU" if sim else "",
                       "bold magenta")

    def _draw_gpus(self, gpus, banner_text, sim: bool, history, holders) -> None:
        wide = self.size.width >= 120
        pairs = self.two_columns(len(gpus), bool(banner_text), sim)
        groups = [gpus[i:i + 2] for i in range(0, len(gpus), 2)] if pairs else [[g] for g in gpus]
        half = max(20, (self.size.width - 2) // 2)
        lines = []
        for group in groups:
            if pairs:
                t = Text()
                for g in group:
                    t.append_text(_cell(self._compact(g, sim, holders), half))
                lines.append(t)
            else:
                lines.append(self._row(group[0], wide, sim, history, holders))
        header = self._header_pairs() if pairs else self._header(wide, sim)
        self._show(banner_text, header if gpus else Text(""), lines)

    def _show(self, banner_text, header: Text, lines: list[Text]) -> None:
        rows = self.query_one("#gpu-rows", Vertical)
        while len(self._rows) < len(lines):
            line = GpuLine()
            self._rows.append(line)
            rows.mount(line)
        banner = self.query_one("#gpu-banner", GpuLine)
        banner.display = bool(banner_text)   # an empty line would still take a row
        banner.set(Text(banner_text or "", style="yellow"))
        self.query_one("#gpu-header", GpuLine).set(header)
        for row, text in zip(self._rows, lines, strict=False):   # spare rows stay hidden
            row.display = True
            row.set(text)
        for row in self._rows[len(lines):]:
            row.display = False   # rows of the other layout: they would still take height
        self.query_one("#gpu-host", GpuLine).set(self._host_line())

    def _set_note(self, text: str, style: str) -> None:
        note = self.query_one("#gpu-note", GpuLine)
        note.display = bool(text)
        note.set(Text(text, style=style))

    # -- several nodes (pipeline.cluster.node_telemetry) ----------------------------------
    def drill_next(self) -> None:
        """g: all nodes -> node 1 -> node 2 -> ... -> all nodes."""
        n = len(self.snapshot.nodes) if self.snapshot is not None else 0
        self.drill = None if not n or (self.drill is not None and self.drill + 1 >= n) else \
            (0 if self.drill is None else self.drill + 1)
        if self.snapshot is not None:
            self.update_from(self.snapshot, self.holders, self.forecast, self.running)

    def _node_state(self, node) -> tuple[str, str]:
        if node.stage not in self.running:
            return f"{node.stage} ended" if node.stage else "ended", "dim"
        if node.lost:   # the scheduler's word in full: the node's own line (g)
            return f"LOST {node.stale_s:.0f}s", "bold red"
        if node.stale:
            return f"STALE {node.stale_s:.0f}s", "bold red"
        return node.stage, "bold cyan"

    def _draw_nodes(self, nodes) -> None:
        if self.drill is not None and self.drill >= len(nodes):
            self.drill = None
        if self.drill is not None:
            node = nodes[self.drill]
            state, style = self._node_state(node)
            sim = node.source == "simulated"
            holders = {g.index: node.stage for g in node.gpus} if node.stage in self.running \
                else {}
            history = {g.index: self.history.get((node.host, g.index), ()) for g in node.gpus}
            self._draw_gpus(node.gpus, None, sim, history, holders)
            if node.lost:
                state += f" (Slurm: {node.lost})"
            title = Text.assemble((f" node {node.host}", "bold"),
                                  f" ({self.drill + 1} of {len(nodes)})  ", (state, style),
                                  f"  job {node.job or '-'}  g: next node")
            self._set_note(title.plain + ("  * SIMULATED" if sim else ""), style)
            return
        w = {"host": 14, "gpus": 5, "mem": 20, "util": 5, "temp": 5, "power": 8}
        header = Text(" ", style="bold")
        for name, key, right in (("Node", "host", False), ("GPUs", "gpus", True),
                                 ("Memory", "mem", False), ("Util", "util", True),
                                 ("Temp", "temp", True), ("Power", "power", True)):
            header.append_text(_cell(name, w[key], right))
            header.append(" ")
        header.append("Stage")
        lines = []
        for node in nodes:
            gpus = [g for g in node.gpus if not g.error]
            used = sum(g.mem_used or 0 for g in gpus)
            total = sum(g.mem_total or 0 for g in gpus)
            utils = [g.util for g in gpus if g.util is not None]
            temps = [g.temp for g in gpus if g.temp is not None]
            power = sum(g.power or 0 for g in gpus)
            mem = bar(used / total if total else None, 8)
            mem.append(f" {used / GiB:4.0f}/{total / GiB:4.0f}G" if total else "")
            state, style = self._node_state(node)
            lost = len(node.gpus) - len(gpus)
            t = Text(" ")
            for value, key, right in (
                    (node.host + ("*" if node.source == "simulated" else ""), "host", False),
                    (f"{len(node.gpus)}" + (f"-{lost}" if lost else ""), "gpus", True),
                    (mem, "mem", False),
                    (f"{sum(utils) / len(utils):.0f}%" if utils else "-", "util", True),
                    (f"{max(temps):.0f}C" if temps else "-", "temp", True),
                    (f"{power / 1000:.1f}kW" if power >= 1000 else
                     (f"{power:.0f}W" if gpus and power else "-"), "power", True)):
                t.append_text(_cell(value, w[key], right))
                t.append(" ")
            t.append(state, style=style)
            lines.append(t)
        self._show(None, header, lines)
        sim = any(n.source == "simulated" for n in nodes)
        self._set_note(f" {len(nodes)} nodes report (util: mean, temp: max)  g: one node's GPUs"
                       + ("  * SIMULATED" if sim else ""), "bold magenta" if sim else "dim")

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

    def _row(self, g, wide: bool, sim: bool, history, holders) -> Text:
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
        cells += [(sparkline(history.get(g.index, ()), w["hist"]), "hist", False),
                  (Text.assemble((holders.get(g.index, ""), "bold cyan")), "stage", False)]
        for value, key, right in cells:
            t.append_text(_cell(value, w[key], right))
            t.append(" ")
        return t

    def _header_pairs(self) -> Text:
        half = max(20, (self.size.width - 2) // 2)
        one = _cell(" GPU Memory           Util Temp Stage", half)
        return Text.assemble(one, one.copy(), style="bold")

    def _compact(self, g, sim: bool, holders) -> Text:
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
        t.append(holders.get(g.index, ""), style="bold cyan")
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
        parts = [w._last.plain for w in self.query(QuietStatic)
                 if getattr(w, "_last", None) and w.display]
        return "\n".join(parts)
