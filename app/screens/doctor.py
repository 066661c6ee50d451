"""`d`: the doctor report (the same findings as `eagle-panel doctor`), one
check a line at any width; the highlighted one whole, with its fix, below.

A full report is ~20 findings, some of them three 80-column lines of
figures: wrapped, they pushed the blocking one off an 80x24 screen. So the
list says level, area and the start of each message in doctor's order, the
cursor starts on the first blocking one, and the details follow the cursor."""

from __future__ import annotations

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option

from app.screens import text_box_css

STYLE = {"ok": ("  ok  ", "green"), "warning": (" WARN ", "yellow"), "blocking": ("BLOCK ", "bold red")}
AREA_WIDTH = 11


def summary(findings) -> Text:
    n = sum(f.level == "blocking" for f in findings)
    w = sum(f.level == "warning" for f in findings)
    return Text(f"{n} blocking, {w} warning(s)" + ("" if n else ": ready to launch"),
                style="bold red" if n else "bold green")


def line(f, width: int) -> Text:
    """One finding on one line of `width` cells: `[BLOCK ] layers  layer id 9 is…`."""
    tag, style = STYLE[f.level]
    out = Text(no_wrap=True, overflow="ellipsis")
    out.append(f"[{tag}] ", style=style)
    out.append(f"{f.area:<{AREA_WIDTH}} ", style="bold")
    out.append(f.message.replace("\n", " "))
    out.truncate(max(20, width), overflow="ellipsis")
    return out


def detail(f) -> Text:
    """The finding whole: its message, and the fix when there is one."""
    tag, style = STYLE[f.level]
    out = Text()
    out.append(f"[{tag}] ", style=style)
    out.append(f"{f.area}: ", style="bold")
    out.append(f.message)
    if f.fix:
        out.append(f"\nfix: {f.fix}", style="dim")
    return out


def first_to_read(findings) -> int:
    """Where the cursor starts: the first blocking finding, else the first warning."""
    for level in ("blocking", "warning"):
        for i, f in enumerate(findings):
            if f.level == level:
                return i
    return 0


class DoctorScreen(ModalScreen[None]):
    """Runs the checks in a worker thread (the environment probe imports
    torch in the stage interpreter: seconds), then lists them."""

    DEFAULT_CSS = text_box_css("DoctorScreen") + """
    DoctorScreen #doctor-list { height: auto; max-height: 60vh; border: none; padding: 0; }
    DoctorScreen #doctor-detail { height: auto; max-height: 25vh; margin-top: 1; }
    """
    BINDINGS = [("escape", "dismiss", "Close"), ("d", "dismiss", "Close"), ("q", "dismiss", "Close")]

    def __init__(self, load_config=None, findings=None, heading: str = ""):
        """Either `load_config` (the checks run here) or the `findings` of
        checks already run (a launch they refused, with a `heading`)."""
        super().__init__()
        self.load_config, self.findings, self.heading = load_config, findings, heading

    def compose(self) -> ComposeResult:
        with Vertical(id="help"):
            yield Static(Text("doctor: checking the environment, GPUs, model, vLLM, disk…",
                              style="dim"), id="doctor-report")
            yield OptionList(id="doctor-list")
            yield Static("", id="doctor-detail")

    def on_mount(self) -> None:
        if self.findings is None:
            self.check()
        else:
            self.show(self.findings)

    @work(thread=True, exclusive=True)
    def check(self) -> None:
        from pipeline import doctor
        try:
            findings = doctor.diagnose(self.load_config())
        except Exception as e:  # noqa: BLE001 - shown, never a crash of the panel
            text = Text(f"doctor could not run: {type(e).__name__}: {e}", style="red")
            self.app.call_from_thread(self.query_one("#doctor-report", Static).update, text)
            return
        self.app.call_from_thread(self.show, findings)

    def show(self, findings) -> None:
        self.findings = findings
        head = Text(self.heading + "\n", style="bold red") if self.heading else Text()
        head.append_text(summary(findings))
        head.append("   ↑↓ a check, its details below", style="dim")
        self.query_one("#doctor-report", Static).update(head)
        self.fill(first_to_read(findings) if findings else None)
        # the lines are cut to the list's width, known once it is laid out
        self.call_after_refresh(self.fill)

    def fill(self, highlighted: int | None = -1) -> None:
        """The list, a finding a line cut to the list's width (-1: the
        cursor where it was)."""
        options = self.query_one("#doctor-list", OptionList)
        if highlighted == -1:
            highlighted = options.highlighted
        width = (options.scrollable_content_region.width or self.app.size.width - 8) - 1
        options.clear_options()
        options.add_options([Option(line(f, width)) for f in self.findings or []])
        options.highlighted = highlighted
        options.focus()
        self.show_detail()

    def on_resize(self) -> None:
        if self.findings:
            self.call_after_refresh(self.fill)

    def on_option_list_option_highlighted(self, event: OptionList.OptionHighlighted) -> None:
        self.show_detail()

    def show_detail(self) -> None:
        i = self.query_one("#doctor-list", OptionList).highlighted
        f = self.findings[i] if self.findings and i is not None else None
        self.query_one("#doctor-detail", Static).update(detail(f) if f else "")

    def report_text(self) -> str:
        """Everything the screen says, as plain text (the heading, every
        finding whole): what a test or a copy wants."""
        head = str(self.query_one("#doctor-report", Static).render())
        return "\n".join([head, *(detail(f).plain for f in self.findings or [])])
