"""Text bars and sparklines: plain characters and the 16 basic colours, so
they read the same in tmux, screen and a 16-colour terminal."""

from __future__ import annotations

from rich.text import Text

EIGHTHS = " ▏▎▍▌▋▊▉█"
SPARK = "▁▂▃▄▅▆▇█"


def bar(frac: float | None, width: int, style: str = "") -> Text:
    """A horizontal bar `width` cells wide for frac in [0, 1]."""
    if frac is None:
        return Text("·" * width, style="dim")
    frac = min(1.0, max(0.0, frac))
    eighths = int(round(frac * width * 8))
    full, part = divmod(eighths, 8)
    s = "█" * full + (EIGHTHS[part] if part else "")
    style = style or ("red" if frac > 0.9 else "yellow" if frac > 0.7 else "green")
    t = Text(s, style=style)
    t.append(" " * (width - len(s)))
    return t


def sparkline(values, width: int, lo: float = 0.0, hi: float = 100.0) -> Text:
    """The last `width` values on a fixed lo..hi scale (fixed, so that a quiet
    GPU does not look busy because the scale shrank)."""
    vals = list(values)[-width:]
    out = []
    for v in vals:
        if v is None:
            out.append(" ")
            continue
        f = (min(hi, max(lo, v)) - lo) / (hi - lo)
        out.append(SPARK[min(len(SPARK) - 1, int(f * (len(SPARK) - 1) + 0.5))])
    return Text(" " * (width - len(out)) + "".join(out), style="cyan")


def count(n) -> str:
    """n in at most 4 characters, rounded down (so 19,999 of 20,000 never reads
    as done): 9999, 20k, 1.2M, 10M. A training of 10M steps otherwise shows
    `10000000/1` in the 18-cell progress column."""
    if not isinstance(n, (int, float)) or isinstance(n, bool) or n < 10_000:
        return str(n)
    n = int(n)
    for unit, size in (("k", 10**3), ("M", 10**6), ("G", 10**9)):
        if n < 10 * size:
            return f"{n // (size // 10) / 10:.1f}{unit}"
        if n < 1000 * size:
            return f"{n // size}{unit}"
    return f"{n // 10**12}T"


def progress_bar(done, total, width: int) -> Text:
    if not total:
        return Text("")
    return bar(done / total, width, style="blue")
