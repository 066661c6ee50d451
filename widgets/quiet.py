"""A Static that redraws only when its content changes.

Textual repaints every line of a widget that is updated, and over SSH the
bytes are the cost: widgets refreshed on a timer go through this."""

from __future__ import annotations

from textual.widgets import Static


class QuietStatic(Static):
    def set(self, content) -> None:
        if getattr(self, "_last", None) != content:
            self._last = content
            self.update(content)
