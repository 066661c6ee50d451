"""`C`: the runs of this runs folder side by side (`eagle-panel compare`'s
rows, pipeline/compare.py), to pick a draft algorithm, size or budget from
the user's own numbers.

One row per run in a table the cursor moves through (the run shown in the
panel starts highlighted); the highlighted run's per-position and
per-category acceptance, and why vLLM did not measure it where it did not,
below. What the runs do not share (the target, the data) is said above the
table. The rows are read in a worker: a runs folder of many runs is many
files, and the panel's redraws must not wait for them."""

from __future__ import annotations

from pathlib import Path

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Static

from app.screens import text_box_css
from pipeline.compare import COLUMNS, cells


def shown_path(path) -> str:
    """A folder as the user typed it, where it is under the current one."""
    p = Path(path).resolve()
    try:
        return str(p.relative_to(Path.cwd()))
    except ValueError:
        return str(p)


def detail(r) -> Text:
    """The highlighted run's figures under the table."""
    out = Text()
    out.append(f"{r.run}: ", style="bold")
    out.append(f"{r.algorithm}, {r.draft or '?'} draft layer")
    if r.per_position:
        out.append("\naccept rate per position " + " ".join(f"{p:.2f}" for p in r.per_position))
    if r.per_category:
        out.append("\nper category " + " · ".join(f"{c} {v:.2f}"
                                                  for c, v in sorted(r.per_category.items())))
    if r.not_measured:
        out.append(f"\nnot measured: {r.not_measured}", style="yellow")
    elif r.acceptance is None:
        out.append("\nnot measured yet: its evaluate has not finished", style="dim")
    return out


class CompareScreen(ModalScreen[None]):
    DEFAULT_CSS = text_box_css("CompareScreen") + """
    CompareScreen #help { width: 100%; }
    CompareScreen #compare-table { height: auto; max-height: 60vh; }
    CompareScreen #compare-detail { height: auto; max-height: 30vh; margin-top: 1; }
    """
    BINDINGS = [("escape", "dismiss", "Close"), ("C", "dismiss", "Close"),
                ("q", "dismiss", "Close")]

    def __init__(self, runs_dir, current: str | None = None):
        super().__init__()
        self.runs_dir, self.current = runs_dir, current
        self.rows: list = []

    def compose(self) -> ComposeResult:
        with Vertical(id="help"):
            yield Static(Text(f"compare: reading the runs in {shown_path(self.runs_dir)}…",
                              style="dim"),
                         id="compare-head")
            # (no cell padding: ten columns of figures in 76 cells, at 80x24)
            yield DataTable(id="compare-table", cursor_type="row", zebra_stripes=True,
                            cell_padding=0)
            yield Static("", id="compare-detail")

    def on_mount(self) -> None:
        self.read()

    @work(thread=True, exclusive=True)
    def read(self) -> None:
        from pipeline import compare
        from pipeline.run.rundir import RunDirError, list_runs
        rows, unread = [], []
        try:
            runs = list_runs(self.runs_dir)
        except RunDirError as e:
            runs, unread = [], [str(e)]
        for rd in runs:
            try:
                rows.append(compare.row(rd))
            except Exception as e:  # noqa: BLE001 - one odd run is a note, never the panel's end
                unread.append(f"{rd.id}: {type(e).__name__}: {e}")
        notes = compare.differences(rows) + [f"not read: {u}" for u in unread]
        self.app.call_from_thread(self.show, rows, notes)

    def show(self, rows: list, notes: list[str]) -> None:
        self.rows = rows
        head = Text(f"compare: {len(rows)} run(s) in {shown_path(self.runs_dir)}", style="bold")
        head.append("   ↑↓ a run, its details below · esc closes", style="dim")
        for n in notes:
            head.append(f"\nnote: {n}", style="yellow")
        self.query_one("#compare-head", Static).update(head)
        table = self.query_one("#compare-table", DataTable)
        table.clear(columns=True)
        table.add_columns(*(f"{c} " for c in COLUMNS))
        for r in rows:
            table.add_row(*(f"{c} " for c in cells(r)), key=r.run)
        at = next((i for i, r in enumerate(rows) if r.run == self.current), 0)
        if rows:
            table.move_cursor(row=at)
        table.focus()
        self.show_detail(at if rows else None)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self.show_detail(event.cursor_row)

    def show_detail(self, i: int | None) -> None:
        r = self.rows[i] if i is not None and 0 <= i < len(self.rows) else None
        self.query_one("#compare-detail", Static).update(
            detail(r) if r else Text("no runs with records here yet", style="dim"))

    def report_text(self) -> str:
        """What the screen says, as plain text: the heading, a line per run
        and its details (what a test reads)."""
        head = str(self.query_one("#compare-head", Static).render())
        return "\n".join([head, *(" ".join(cells(r)) + "\n" + detail(r).plain
                                  for r in self.rows)])
