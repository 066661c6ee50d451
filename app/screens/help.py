"""`?`: every key, in one place."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from app.screens import text_box_css

HELP = """\
[b]eagle-panel[/b] — closing the panel never stops a stage.

[b]Pipeline[/b]
  r        run / resume the pipeline from the first stage not done
  F        force re-run the selected stage from scratch (asks first)
  c        cancel the running stage: SIGINT, then SIGTERM, then SIGKILL (asks first)
  ↑ ↓      select a stage (its log, error and details follow the selection)

[b]Views[/b]
  1 2 3 4  logs · GPUs · KV cache · training
  z        full-screen log           f  follow the log on/off
  End      the log's end (follow)    Home  its start
  /        search the log            n  next match
  w        long log lines: elided in the middle <-> whole (scrolled sideways)
  l        the selected stage's log -> its vLLM servers' logs, one by one
  e        training: EMA smoothing, the raw curve faint under it (on at start)
  o        training: log scale       p  the loss per draft position too
  a        loss -> accuracy -> acceptance (vLLM)   v  train / validation
  d        doctor: environment, GPUs, model, vLLM, KV and disk checks
  C        compare the runs in this runs folder: algorithm, size, loss, acceptance
  g        GPUs of a Slurm run: one node's GPUs, the next node, all nodes
  ?        this help (Esc closes it) q  quit (stages keep running)
"""


class HelpScreen(ModalScreen[None]):
    DEFAULT_CSS = "HelpScreen { align: center middle; }" + text_box_css("HelpScreen")
    BINDINGS = [("escape", "dismiss", "Close"), ("question_mark", "dismiss", "Close"),
                ("q", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help"):
            yield Static(HELP)
