"""A stage's log: the end of the file, then followed as it grows.

Never reads a whole log: it starts from the last `initial_lines` lines
(reading backwards) and then only what is appended. `\\r` progress lines
(tqdm) are collapsed to their last state, ANSI colours are kept, at most
`max_lines` lines are held. Rendering is virtual (only visible lines).
"""

from __future__ import annotations

import os
import re
import time
from collections import deque

from rich.text import Text
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip

from pipeline.run.events import tail_lines
from pipeline.vllm.shutdown_noise import MARK, ShutdownNoise


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
        except OSError:   # not there yet, or damaged (a folder): nothing to show
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


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
ELLIPSIS = " … "


def elided(text: Text, width: int, match: int = -1) -> Text:
    """`text` in about `width` cells: its first two thirds and its end, the
    middle replaced by an ellipsis (styles kept on both sides). With `match`
    (where a searched word starts) in the part left out, its start and the
    stretch around the match instead."""
    head = (width - len(ELLIPSIS)) * 2 // 3
    tail = width - len(ELLIPSIS) - head
    if head <= match < len(text) - tail:
        lead = max(8, width // 4)
        start = max(lead + len(ELLIPSIS), match - width // 3)
        out = text[:lead]
        out.append(ELLIPSIS, style="dim")
        out.append_text(text[start:start + width - lead - len(ELLIPSIS)])
        return out
    out = text[:head]
    out.append(ELLIPSIS, style="dim")
    out.append_text(text[len(text) - tail:])
    return out


class LogView(ScrollView, can_focus=True):
    """Lines are kept as raw strings and turned into styled Text only when
    drawn: a stage writing thousands of lines a second costs the panel the
    few lines on screen, not every line."""

    DEFAULT_CSS = "LogView { height: 1fr; }"

    def __init__(self, max_lines: int = 5000, **kw):
        super().__init__(**kw)
        self.lines: deque[str] = deque(maxlen=max_lines)
        self.partial = ""
        self._parsed: dict[str, Text] = {}
        self._pending = 0
        self._drawn_at = 0.0
        self.follow = True
        self.search: str = ""
        self.tail: LogTail | None = None
        self._width = 0
        self.noise = ShutdownNoise()
        # A line wider than the view shows its start and its end, elided in
        # the middle (a vLLM arguments line is thousands of characters: cut at
        # the edge, its end is never seen); `w` shows whole lines, scrolled
        # sideways, instead.
        self.elide = True

    def watch_file(self, path) -> None:
        self.tail = LogTail(path)
        self.lines.clear()
        self._width = 0
        self.noise = ShutdownNoise()
        self._add(self.tail.initial, "")

    # A log that scrolls more than a screen between draws is redrawn at most
    # every BUSY_INTERVAL seconds: nobody reads 2,000 lines a second, and
    # each redraw resends the whole screen over SSH.
    BUSY_INTERVAL = 2.0

    def poll(self) -> bool:
        if self.tail is None:
            return False
        lines, partial = self.tail.poll()
        if lines or partial != self.partial:
            self._add(lines, partial, draw=False)
            self._pending += len(lines) + 1
        if not self._pending:
            return False
        now = time.monotonic()
        busy = self._pending > max(1, self.size.height)
        if busy and now - self._drawn_at < self.BUSY_INTERVAL:
            return False
        self._pending, self._drawn_at = 0, now
        self._draw()
        return True

    def _add(self, lines: list[str], partial: str, draw: bool = True) -> None:
        for line in lines[-self.lines.maxlen:]:
            line = self.noise.shown(line)
            if line is None:
                continue
            if line is MARK:
                line = f"\x1b[2m{MARK}\x1b[0m"
            plain_len = len(ANSI.sub("", line)) if "\x1b" in line else len(line)
            self._width = max(self._width, plain_len)
            self.lines.append(line)
        self.partial = partial
        if draw:
            self._draw()

    def _draw(self) -> None:
        # eliding, nothing is wider than the view: no sideways scrolling (a
        # width of 0, not the view's, which the vertical scrollbar then narrows)
        self.virtual_size = Size(0 if self.elide else self._width,
                                 len(self.lines) + (1 if self.partial else 0))
        if self.follow:
            self.scroll_end(animate=False, immediate=True)
        self.refresh()

    @staticmethod
    def plain(line: str) -> str:
        return ANSI.sub("", line) if "\x1b" in line else line

    def line_at(self, i: int) -> Text | None:
        if i < len(self.lines):
            raw = self.lines[i]
        elif i == len(self.lines) and self.partial:
            raw = self.partial
        else:
            return None
        text = self._parsed.get(raw)
        if text is None:
            if len(self._parsed) > 500:
                self._parsed.clear()
            text = self._parsed[raw] = Text.from_ansi(raw)
        return text

    def render_line(self, y: int) -> Strip:
        sx, sy = self.scroll_offset
        text = self.line_at(sy + y)
        width = self.scrollable_content_region.width
        if text is None:
            return Strip.blank(width, self.rich_style)
        if self.elide and text.cell_len > width > 20:
            text = elided(text, width, text.plain.lower().find(self.search.lower())
                          if self.search else -1)
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
            if needle.lower() in self.plain(self.lines[i]).lower():
                self.follow = False
                self.scroll_to(y=max(0, i - 2), animate=False, immediate=True)
                self.refresh()
                return True
        self.refresh()
        return False

    def set_elide(self, on: bool) -> None:
        self.elide = on
        self.scroll_to(x=0, animate=False, immediate=True)
        self._draw()

    def set_follow(self, on: bool) -> None:
        self.follow = on
        if on:
            self.scroll_end(animate=False, immediate=True)

    def jump(self, end: bool) -> None:
        """End: to the last line, following again; Home: to the first, not following."""
        self.set_follow(end)
        if not end:
            self.scroll_home(animate=False, immediate=True)

    # With the log focused, Textual's own End/Home bindings of a scroll view
    # come first: they do what the screen's do.
    def action_scroll_end(self) -> None:
        self.jump(True)

    def action_scroll_home(self) -> None:
        self.jump(False)

    # A log drawn while its tab was hidden (or before its first layout) scrolled
    # to the end of a zero-height view: once shown it sat a screenful or a
    # thousand lines short of the end while "follow" was on. Following means the
    # end whenever the view gets its size.
    def on_resize(self, _event) -> None:
        self._to_end_if_following()

    def on_show(self, _event) -> None:
        self._to_end_if_following()

    def _to_end_if_following(self) -> None:
        if self.follow:
            self.call_after_refresh(self.scroll_end, animate=False, immediate=True)

