"""GPUs: memory bar, utilization, temperature, power, PCIe, a 0-100 history,
and which stage holds each GPU; a host line under it."""

from __future__ import annotations

from collections import deque

from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from app import fmt
from widgets.bars import bar, sparkline

GiB = 1 << 30


class GpuTable(Static):
    DEFAULT_CSS = "GpuTable { height: auto; }"

    def __init__(self, history: int = 60, **kw):
        super().__init__("", **kw)
        self.history: dict[int, deque] = {}
        self.history_len = history
        self.snapshot = None
        self.holders: dict[int, str] = {}
        self.forecast: dict | None = None

    def update_from(self, snap, holders: dict[int, str], forecast: dict | None) -> None:
        self.snapshot, self.holders, self.forecast = snap, holders, forecast
        for g in snap.gpus:
            self.history.setdefault(g.index, deque(maxlen=self.history_len)).append(g.util)
        self.update(self._render_table())

    def _render_table(self):
        snap = self.snapshot
        wide = self.size.width >= 120
        hist_w = 24 if wide else 10
        t = Table(box=None, pad_edge=False, expand=True, show_edge=False, padding=(0, 1))
        sim = snap.source == "simulated"
        t.add_column("GPU" + (" (SIMULATED)" if sim else ""), no_wrap=True,
                     style="magenta" if sim else "")
        t.add_column("Memory", no_wrap=True)
        t.add_column("Util", justify="right", no_wrap=True)
        t.add_column("Temp", justify="right", no_wrap=True)
        t.add_column("Power", justify="right", no_wrap=True)
        if wide:
            t.add_column("PCIe rx/tx", justify="right", no_wrap=True)
        t.add_column("Util history", no_wrap=True)
        t.add_column("Stage", no_wrap=True)
        for g in snap.gpus:
            if g.error:
                t.add_row(str(g.index), Text(g.error, style="bold red"), "", "", "", *([""] * wide), "", "")
                continue
            frac = g.mem_used / g.mem_total if g.mem_used is not None and g.mem_total else None
            mem = bar(frac, 10 if not wide else 16)
            if frac is not None:
                mem.append(f" {g.mem_used / GiB:.0f}/{g.mem_total / GiB:.0f}G")
            power = "-" if g.power is None else (
                f"{g.power:.0f}/{g.power_limit:.0f}W" if g.power_limit else f"{g.power:.0f}W")
            row = [f"{g.index}" + ("*" if sim else ""), mem,
                   "-" if g.util is None else f"{g.util:.0f}%",
                   "-" if g.temp is None else f"{g.temp:.0f}C", power]
            if wide:
                row.append("-" if g.pcie_rx is None else
                           f"{fmt.nbytes(g.pcie_rx)}/s {fmt.nbytes(g.pcie_tx)}/s")
            row += [sparkline(self.history.get(g.index, ()), hist_w),
                    Text(self.holders.get(g.index, ""), style="bold cyan")]
            t.add_row(*row)
        from rich.console import Group
        parts = []
        if snap.banner:
            parts.append(Text(snap.banner, style="yellow"))
        if snap.gpus:
            parts.append(t)
        if sim:
            parts.append(Text("* simulated numbers (--simulate-gpus), not a real GPU", style="magenta"))
        parts.append(self._host_line())
        return Group(*parts)

    def _host_line(self) -> Text:
        h = self.snapshot.host
        line = Text("host ", style="bold")
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
