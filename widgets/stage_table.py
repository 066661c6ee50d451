"""The four stages: status, attempt, duration, progress with rate and ETA, exit."""

from __future__ import annotations

import time

from rich.text import Text
from textual.widgets import DataTable

from app import fmt
from pipeline.config import STAGE_NAMES
from widgets.bars import progress_bar

STATUS_STYLE = {"pending": "dim", "running": "bold cyan", "succeeded": "green",
                "failed": "bold red", "cancelled": "yellow"}


class StageTable(DataTable):
    """One row per stage; cells change in place, so nothing flickers."""

    DEFAULT_CSS = "StageTable { height: 6; }"
    COLUMNS = ("Stage", "Status", "Att", "Time", "Progress", "Rate / ETA", "Exit")

    def on_mount(self) -> None:
        self.cursor_type = "row"
        self.zebra_stripes = False
        for c in self.COLUMNS:
            self.add_column(c, key=c)
        for s in STAGE_NAMES:
            self.add_row(s, "", "", "", "", "", "", key=s)

    @property
    def selected_stage(self) -> str:
        return STAGE_NAMES[self.cursor_row] if 0 <= self.cursor_row < len(STAGE_NAMES) else STAGE_NAMES[0]

    def refresh_from(self, model, now: float | None = None) -> None:
        now = now or time.time()
        for s in STAGE_NAMES:
            info = model.stages[s]
            st = info.state
            status = st.get("status", "pending")
            prog = info.progress if st.get("attempt") else None
            cells = {
                "Status": Text(status, style=STATUS_STYLE.get(status, "")),
                "Att": str(st.get("attempt") or ""),
                "Time": fmt.duration(fmt.stage_duration(st, now)) if st.get("started_at") else "",
                "Progress": self._progress(prog),
                "Rate / ETA": self._rate(prog, status),
                "Exit": Text(fmt.exit_text(st) if status in ("failed", "cancelled", "succeeded")
                             else "", style="red" if status == "failed" else ""),
            }
            for col, value in cells.items():
                if self.get_cell(s, col) != value:
                    self.update_cell(s, col, value, update_width=True)

    @staticmethod
    def _progress(ev) -> Text:
        if not ev:
            return Text("")
        t = progress_bar(ev.get("done", 0), ev.get("total"), 10)
        total = ev.get("total")
        t.append(f" {ev.get('done')}/{total}" if total else f" {ev.get('done')}")
        return t

    @staticmethod
    def _rate(ev, status) -> str:
        if not ev or status != "running":
            return ""
        parts = []
        if ev.get("rate"):
            parts.append(f"{ev['rate']:.1f} {ev.get('unit', '')}/s")
        if ev.get("eta_s") is not None:
            parts.append(f"ETA {fmt.duration(ev['eta_s'])}")
        return "  ".join(parts)
