"""A stage's log: the end of the file, then followed as it grows.

Never reads a whole log: it starts from the last `initial_lines` lines
(reading backwards) and then only what is appended. `\\r` progress lines
(tqdm) are collapsed to their last state, ANSI colours are kept, at most
`max_lines` lines are held. Rendering is virtual (only visible lines).
"""

from __future__ import annotations

import os
from collections import deque

from rich.text import Text
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip

from pipeline.events import tail_lines


def collapse_cr(line: str) -> str:
    """What a terminal shows for a line rewritten with carriage returns."""
    if "\r" not in line:
        return line
    parts = [p for p in line.split("\r") if p]
    return parts[-1] if parts else ""


class LogTail:
    """Incremental reader of one log file."""

    def __init__(self, path, initial_lines: int = 1000):
        self.path = path
        lines, size = tail_lines(path, initial_lines)
        self.offset = size
        self.initial = [collapse_cr(b.decode("utf-8", "replace")) for b in lines]
        self.partial = b""
        self._ino = self._inode()

    def _inode(self):
        try:
            return os.stat(self.path).st_ino
        except OSError:
            return None

    def poll(self, max_bytes: int = 1 << 20) -> tuple[list[str], str]:
        """(complete new lines, the current unfinished line)."""
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            return [], ""
        with f:
            st = os.fstat(f.fileno())
            if st.st_ino != self._ino or st.st_size < self.offset:
                self._ino, self.offset, self.partial = st.st_ino, 0, b""
            f.seek(self.offset)
            data = f.read(max_bytes)
        self.offset += len(data)
        data = self.partial + data
        pieces = data.split(b"\n")
        self.partial = pieces.pop()
        lines = [collapse_cr(p.decode("utf-8", "replace")) for p in pieces]
        return lines, collapse_cr(self.partial.decode("utf-8", "replace"))


class LogView(ScrollView, can_focus=True):
    DEFAULT_CSS = "LogView { height: 1fr; }"

    def __init__(self, max_lines: int = 5000, **kw):
        super().__init__(**kw)
        self.lines: deque[Text] = deque(maxlen=max_lines)
        self.partial = Text("")
        self.follow = True
        self.search: str = ""
        self.tail: LogTail | None = None
        self._width = 0

    def watch_file(self, path) -> None:
        self.tail = LogTail(path)
        self.lines.clear()
        self._width = 0
        self._add(self.tail.initial, "")

    def poll(self) -> bool:
        if self.tail is None:
            return False
        lines, partial = self.tail.poll()
        if not lines and partial == self.partial.plain:
            return False
        self._add(lines, partial)
        return True

    def _add(self, lines: list[str], partial: str) -> None:
        for line in lines:
            t = Text.from_ansi(line)
            self._width = max(self._width, t.cell_len)
            self.lines.append(t)
        self.partial = Text.from_ansi(partial)
        self.virtual_size = Size(self._width, len(self.lines) + (1 if partial else 0))
        if self.follow:
            self.scroll_end(animate=False, immediate=True)
        self.refresh()

    def line_at(self, i: int) -> Text | None:
        if i < len(self.lines):
            return self.lines[i]
        if i == len(self.lines) and self.partial.plain:
            return self.partial
        return None

    def render_line(self, y: int) -> Strip:
        sx, sy = self.scroll_offset
        text = self.line_at(sy + y)
        width = self.scrollable_content_region.width
        if text is None:
            return Strip.blank(width, self.rich_style)
        if self.search and self.search.lower() in text.plain.lower():
            text = text.copy()
            text.highlight_words([self.search], style="reverse", case_sensitive=False)
        segments = list(text.render(self.app.console))
        strip = Strip(segments).crop(sx, sx + width)
        return strip.extend_cell_length(width, self.rich_style)

    def find(self, needle: str, forward_from: int | None = None) -> bool:
        """Scroll to the next line containing `needle`; True if found."""
        self.search = needle
        if not needle:
            self.refresh()
            return False
        start = (self.scroll_offset.y + 1) if forward_from is None else forward_from
        n = len(self.lines)
        for k in range(n):
            i = (start + k) % max(n, 1)
            if needle.lower() in self.lines[i].plain.lower():
                self.follow = False
                self.scroll_to(y=max(0, i - 2), animate=False, immediate=True)
                self.refresh()
                return True
        self.refresh()
        return False

    def set_follow(self, on: bool) -> None:
        self.follow = on
        if on:
            self.scroll_end(animate=False, immediate=True)

