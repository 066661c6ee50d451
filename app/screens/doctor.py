"""`d`: the doctor report (the same findings as `eagle-panel doctor`)."""

from __future__ import annotations

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from app.screens import text_box_css

STYLE = {"ok": ("  ok  ", "green"), "warning": (" WARN ", "yellow"), "blocking": ("BLOCK ", "bold red")}


def render(findings) -> Text:
    out = Text()
    for f in findings:
        tag, style = STYLE[f.level]
        out.append(f"[{tag}] ", style=style)
        out.append(f"{f.area}: ", style="bold")
        out.append(f.message + "\n")
        if f.fix:
            out.append(f"         fix: {f.fix}\n", style="dim")
    n = sum(f.level == "blocking" for f in findings)
    out.append(f"\n{n} blocking" + ("" if n else ": ready to launch"),
               style="bold red" if n else "bold green")
    return out


class DoctorScreen(ModalScreen[None]):
    """Runs the checks in a worker thread (the environment probe imports
    torch in the stage interpreter: seconds), then shows them."""

    DEFAULT_CSS = text_box_css("DoctorScreen")
    BINDINGS = [("escape", "dismiss", "Close"), ("d", "dismiss", "Close"), ("q", "dismiss", "Close")]

    def __init__(self, load_config=None, findings=None, heading: str = ""):
        """Either `load_config` (the checks run here) or the `findings` of
        checks already run (a launch they refused, with a `heading`)."""
        super().__init__()
        self.load_config, self.findings, self.heading = load_config, findings, heading

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help"):
            yield Static(Text("doctor: checking the environment, GPUs, model, vLLM, disk…",
                              style="dim"), id="doctor-report")

    def on_mount(self) -> None:
        if self.findings is None:
            self.check()
        else:
            text = Text(self.heading + "\n\n", style="bold red") if self.heading else Text()
            text.append_text(render(self.findings))
            self.query_one("#doctor-report", Static).update(text)

    @work(thread=True, exclusive=True)
    def check(self) -> None:
        from pipeline import doctor
        try:
            text = render(doctor.diagnose(self.load_config()))
        except Exception as e:  # noqa: BLE001 - shown, never a crash of the panel
            text = Text(f"doctor could not run: {type(e).__name__}: {e}", style="red")
        self.app.call_from_thread(self.query_one("#doctor-report", Static).update, text)
