"""Training curves drawn in braille cells (2x4 dots per character).

Each series is reduced to one value per dot column (the mean of the points
that fall in it) before drawing, so a 100,000-step run costs about what a
100-step one does. A column is drawn from its lowest point to its highest
too, so a one-step loss spike stays a visible stroke however long the
history: the series keep each bucket's extremes (pipeline.run.series), the
mean alone would flatten them.

What a person reads first is the trend: EMA smoothing is on by default,
drawn over the raw means in faint dots (`e` turns it off: the means and each
column's extremes, full strength); the loss is the total alone until `p`
adds each draft position's; and the y range is the bulk of the curve, not
its first steps: Tukey's far-out fences (quartiles +- 3 IQR) over the column
means, every series' last value kept inside, and a column past the range
marked at the edge it is drawn to (CLIPPED_UP/DOWN). A log scale is a toggle.
"""

from __future__ import annotations

import math
import time

import numpy as np
from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

COLORS = ("cyan", "magenta", "yellow", "green", "blue", "red", "white")
BRAILLE = 0x2800
# dot bit for (column 0..1, row 0..3) inside a braille cell
DOT = ((0x01, 0x02, 0x04, 0x40), (0x08, 0x10, 0x20, 0x80))


def ema(y: np.ndarray, alpha: float) -> np.ndarray:
    out = np.empty_like(y)
    acc = y[0] if len(y) else 0.0
    for i, v in enumerate(y):  # on at most a few thousand bucket means
        acc = alpha * v + (1 - alpha) * acc
        out[i] = acc
    return out


def columns(x: np.ndarray, x0: float, x1: float, cols: int) -> np.ndarray:
    """Each point's dot column."""
    return np.clip(((x - x0) / max(x1 - x0, 1e-12) * (cols - 1)).round().astype(int),
                   0, cols - 1)


def bucket_means(x: np.ndarray, y: np.ndarray, x0: float, x1: float, cols: int):
    """Mean of y per column of the x range; NaN where a column has no point."""
    if not len(x):
        return np.full(cols, np.nan)
    idx = columns(x, x0, x1, cols)
    sums = np.bincount(idx, weights=y, minlength=cols)
    counts = np.bincount(idx, minlength=cols)
    with np.errstate(invalid="ignore", divide="ignore"):
        return sums / counts


def bucket_extremes(x: np.ndarray, y: np.ndarray, x0: float, x1: float, cols: int):
    """(lowest, highest) y per column; NaN where a column has no point."""
    lo, hi = np.full(cols, np.inf), np.full(cols, -np.inf)
    if len(x):
        idx = columns(x, x0, x1, cols)
        np.minimum.at(lo, idx, y)
        np.maximum.at(hi, idx, y)
    lo[np.isinf(lo)] = np.nan
    hi[np.isinf(hi)] = np.nan
    return lo, hi


TICK_EVERY = 4     # a y label every this many rows (top and bottom always)
POINT = "●"        # a marked point (validation: one value per epoch, not a curve)
CLIPPED_UP, CLIPPED_DOWN = "▴", "▾"   # a column whose mean lies past the y range
FENCE_IQR = 3.0    # Tukey's "far out": what lies past the quartiles by 3 IQR is clipped
FENCE_MIN_COLUMNS = 8   # fewer columns than this: the whole range (nothing to call bulk)


def log_refused(series) -> bool:
    """A log scale cannot show a value of 0 or below (an accuracy of 0 at the
    start, a loss that is not a loss): those series stay linear."""
    return any(len(y) and float(np.min(y)) <= 0 for _, _, y, *_ in series)


def plot(series: list[tuple], width: int, height: int,
         smooth: bool = False, log: bool = False, fence: bool = False) -> list[Text]:
    """Render series [(label, x, y)] or [(label, x, y, "points")] into
    `height` lines of `width` cells: curves in braille dots, "points"
    series as one marked cell per value, y labelled every TICK_EVERY rows.
    `smooth`: each curve EMA-smoothed over its raw self in faint dots;
    `fence`: the y range is the curves' bulk (y_range), the rest marked."""
    label_w = 8
    cols, rows = max(1, (width - label_w)) * 2, max(1, height - 1) * 4
    series = [(s[0], s[1], s[2], s[3] if len(s) > 3 else "line") for s in series if len(s[1])]
    if not series:
        return [Text("no training metrics yet", style="dim")]
    log = log and not log_refused(series)
    x0 = min(float(x[0]) for _, x, _, _ in series)
    x1 = max(float(x[-1]) for _, x, _, _ in series)
    reduced = []   # (name, values per column, extremes, kind, color index, faint)
    for k, (name, x, y, kind) in enumerate(series):
        line = kind == "line"
        if smooth and line:   # the raw means first, faint: the smoothed curve drawn over them
            reduced.append((name, *reduce_series(x, y, x0, x1, cols, log, False, False), kind,
                            k, True))
        reduced.append((name, *reduce_series(x, y, x0, x1, cols, log, smooth and line,
                                             extremes=line), kind, k, False))
    if not any((~np.isnan(r[1])).any() for r in reduced):
        return [Text("no finite values", style="dim")]
    lo, hi, clipped = y_range(reduced, fence)
    grid, color, marks = draw(reduced, lo, hi, rows, cols)
    if clipped:
        mark_clipped(reduced, lo, hi, grid.shape, marks)
    fmt_v = (lambda v: f"{10 ** v:.3g}") if log else (lambda v: f"{v:.3g}")
    lines = rendered_rows(grid, color, marks, label_w,
                          lambda i, n: fmt_v(row_value(i, n, lo, hi, rows)), reduced)
    legend = Text(f"{'step':>{label_w - 1}} {int(x0)}..{int(x1)}  ", style="dim")
    for name, _, _, kind, k, faint in reduced:
        if not faint:
            legend.append(f"{POINT if kind == 'points' else '■'} {name} ",
                          style=COLORS[k % len(COLORS)])
    if clipped:
        legend.append(f"{CLIPPED_UP}{CLIPPED_DOWN} clipped", style="dim")
    lines.append(legend)
    return lines


def y_range(reduced: list[tuple], fence: bool) -> tuple[float, float, bool]:
    """(lo, hi, whether some column lies past them): every value's range, or
    with `fence` the curves' bulk — Tukey's far-out fences over the column
    means of the curves, widened to each curve's last value (where it is now
    is never clipped) and never past the values themselves."""
    every = np.concatenate([r[1][~np.isnan(r[1])] for r in reduced if not r[5]])
    lo, hi = float(every.min()), float(every.max())
    means = np.concatenate([r[1][~np.isnan(r[1])] for r in reduced
                            if r[3] == "line" and not r[5]] or [np.empty(0)])
    q1, q3 = np.percentile(means, [25, 75]) if len(means) else (0.0, 0.0)
    # a curve constant over half its columns (an accuracy pinned at 1.0) has no IQR: no
    # bulk to scale to, so the whole range
    if fence and len(means) >= FENCE_MIN_COLUMNS and q3 - q1 > 1e-9 * max(1.0, abs(q3)):
        spread = FENCE_IQR * (q3 - q1)
        last = [float(r[1][~np.isnan(r[1])][-1]) for r in reduced
                if r[3] == "line" and not r[5] and (~np.isnan(r[1])).any()]
        lo = max(lo, min([q1 - spread, *last]))
        hi = min(hi, max([q3 + spread, *last]))
    clipped = lo > float(every.min()) or hi < float(every.max())
    if hi - lo < 1e-12:
        hi = lo + 1.0
    return lo, hi, clipped


def mark_clipped(reduced: list[tuple], lo: float, hi: float, shape, marks: dict) -> None:
    """At the top (bottom) row, a CLIPPED_UP (DOWN) mark over each column
    whose mean lies above (below) the range, in its series' color."""
    for _, m, _, _, k, faint in reduced:
        if faint:
            continue
        for c in np.flatnonzero(~np.isnan(m)):
            if m[c] > hi or m[c] < lo:
                cell = (0 if m[c] > hi else shape[0] - 1, int(c) // 2)
                marks[cell] = (k, CLIPPED_UP if m[c] > hi else CLIPPED_DOWN)


def reduce_series(x, y, x0: float, x1: float, cols: int, log: bool, smooth: bool,
                  extremes: bool = True):
    """(one value per dot column, (lowest, highest) per column): log10 when
    `log`; when `smooth`, the values EMA-smoothed and no extremes (None), as
    when not `extremes` (marked points)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if log:
        y = np.log10(np.clip(y, 1e-12, None))
    m = bucket_means(x, y, x0, x1, cols)
    if not smooth:
        return m, bucket_extremes(x, y, x0, x1, cols) if extremes else None
    ok = ~np.isnan(m)
    if ok.any():
        m[ok] = ema(m[ok], 0.15)
    return m, None


def draw(reduced: list[tuple], lo: float, hi: float, rows: int, cols: int):
    """The braille dot grid, each cell's entry of `reduced` (the last drawn
    there: a smoothed curve over its faint raw self), and the marked cells
    ((color index, the mark))."""
    grid = np.zeros((rows // 4, cols // 2), dtype=np.int32)
    color = np.full(grid.shape, -1)
    marks: dict[tuple[int, int], tuple[int, str]] = {}

    def row(v: float) -> int:   # (a value past the range: drawn to its edge)
        return min(rows - 1, max(0, int(round((hi - v) / (hi - lo) * (rows - 1)))))

    for k, (_, m, env, kind, ci, _) in enumerate(reduced):
        if kind == "points":
            for c in np.flatnonzero(~np.isnan(m)):
                marks[(row(m[c]) // 4, int(c) // 2)] = (ci, POINT)
            continue
        prev = None
        for c in range(cols):
            v = m[c]
            if math.isnan(v):
                prev = None
                continue
            r = row(v)
            # join to the previous column so steep curves stay connected, and
            # reach the column's extremes (a spike is a stroke, not lost)
            ends = [r] if prev is None else [r, prev]
            if env is not None:
                ends += [row(env[0][c]), row(env[1][c])]
            for rr in range(min(ends), max(ends) + 1):
                grid[rr // 4, c // 2] |= DOT[c % 2][rr % 4]
                color[rr // 4, c // 2] = k
            prev = r
    return grid, color, marks


def row_value(i: int, n_rows: int, lo: float, hi: float, rows: int) -> float:
    """The value a row's label says: the top's, the bottom's, else its middle dot's."""
    if i == 0:
        return hi
    return lo if i == n_rows - 1 else hi - (i * 4 + 1.5) / max(rows - 1, 1) * (hi - lo)


def rendered_rows(grid, color, marks: dict, label_w: int, label,
                  reduced: list[tuple]) -> list[Text]:
    """The grid as lines of text, a y label (`label(i, n_rows)`) every
    TICK_EVERY rows; a faint entry's dots dim."""
    n_rows = grid.shape[0]
    lines = []
    for i in range(n_rows):
        tick = i == 0 or i == n_rows - 1 or (i % TICK_EVERY == 0 and n_rows - 1 - i >= 2)
        line = Text(f"{label(i, n_rows) if tick else '':>{label_w - 1}} ", style="dim")
        for j in range(grid.shape[1]):
            if (i, j) in marks:
                ci, mark = marks[(i, j)]
                line.append(mark, style="bold " + COLORS[ci % len(COLORS)])
                continue
            bits = grid[i, j]
            if not bits:
                line.append(" ")
                continue
            _, _, _, _, ci, faint = reduced[color[i, j]]
            line.append(chr(BRAILLE + bits),
                        style=("dim " if faint else "") + COLORS[ci % len(COLORS)])
        lines.append(line)
    return lines


# The family drawn under the selected one when the chart has the rows for two
# (120x40 and up): loss over accuracy, accuracy over loss, and under vLLM's
# measured acceptance per checkpoint its accept rate per draft position.
COMPANION = {"loss": "full_acc", "full_acc": "loss", "acceptance": "accept_rate"}
TWO_PLOTS_AT = 24   # rows the chart needs before it draws two families


class LossChart(Widget):
    """Loss or accuracy per TTT step (train, and validation when shown), or
    the acceptance length vLLM measured per checkpoint beside train's estimate
    (evaluate's view). With room for two (TWO_PLOTS_AT rows), the companion
    family is drawn under the selected one."""

    DEFAULT_CSS = "LossChart { height: 1fr; min-height: 6; }"
    smooth = reactive(True)       # the trend first; `e`: the raw means alone
    positions = reactive(False)   # the loss per draft position too (`p`)
    log = reactive(False)
    metric = reactive("loss")   # "loss" | "full_acc" | "acceptance"
    METRICS = ("loss", "full_acc", "acceptance")
    split = reactive("train")

    def __init__(self, **kw):
        super().__init__(**kw)
        self.metrics: dict = {}   # (split, key) -> Series
        self._seen_version = -1
        self._drawn_at = -1e9

    # New points redraw the chart at most every REDRAW_INTERVAL seconds (a
    # toggle redraws at once): curves move slowly, and a redraw resends the
    # whole chart to the terminal.
    REDRAW_INTERVAL = 5.0

    def update_from(self, metrics: dict, version: int, force: bool = False) -> None:
        """metrics: (split, key) -> Series; version: bumps when any changed."""
        self.metrics = metrics
        now = time.monotonic()
        if version != self._seen_version and (
                force or now - self._drawn_at >= self.REDRAW_INTERVAL):
            self._seen_version, self._drawn_at = version, now
            self.refresh()

    def series(self, family: str | None = None):
        """The series of one family (default: the selected metric)."""
        family = family or self.metric
        m = self.metrics

        def arrays(key):
            s = m[key]
            return np.frombuffer(s.x, dtype=float), np.frombuffer(s.y, dtype=float)
        if family == "acceptance":   # a value per checkpoint: marked points
            return [(label, *arrays(("eval", k)), "points")
                    for k, label in (("acceptance_length", "measured (vLLM)"),
                                     ("acceptance_estimate", "estimate (train)"))
                    if ("eval", k) in m]
        if family == "accept_rate":  # vLLM's, per draft position, per checkpoint
            keys = sorted((k for sp, k in m if sp == "eval" and k.startswith("accept_rate_")
                           and k[len("accept_rate_"):].isdigit()),
                          key=lambda k: int(k.rsplit("_", 1)[1]))
            return [(f"position {int(k.rsplit('_', 1)[1]) + 1}", *arrays(("eval", k)),
                     "points") for k in keys]
        keys = [k for sp, k in m if sp == self.split and k.startswith(family + "_")
                and k[len(family) + 1:].isdigit()]
        keys.sort(key=lambda k: int(k.rsplit("_", 1)[1]))
        if family == "full_acc" and not keys:   # P-EAGLE, DFlash: each depth's own accuracy
            keys = sorted((k for sp, k in m if sp == self.split and k.startswith("position_")
                           and k.endswith("_acc") and k[9:-4].isdigit()),
                          key=lambda k: int(k[9:-4]))
        if family == "loss" and (self.split, "loss") in m:   # the total, positions on demand
            keys = ["loss", *keys] if self.positions else ["loss"]
        out = [(k, *arrays((self.split, k))) for k in keys]
        # over the train curves, validation's figure of the family (once an epoch)
        val = next((k for k in keys if ("val", k) in m), None) if self.split == "train" else None
        if val is not None:
            out.append((f"val {val}", *arrays(("val", val)), "points"))
        return out

    def title(self, family: str) -> Text:
        return Text({"acceptance": "acceptance length per checkpoint",
                     "accept_rate": "vLLM's accept rate per draft position"}.get(
                         family, f"{self.split} {family}"), style="bold")

    def body(self, family: str, series, width: int, height: int) -> list[Text]:
        if family == "acceptance" and not series:
            return [Text("no acceptance measured yet: evaluate measures each checkpoint "
                         "through vLLM (train's estimate comes with it)", style="dim")]
        per_step = family in ("loss", "full_acc")   # EMA, log, fences: the training curves
        return plot(series, width, max(2, height), self.smooth and per_step,
                    self.log and per_step, fence=per_step)

    def render(self):
        w, h = self.size.width, self.size.height
        series = self.series()
        title = self.title(self.metric)
        refused = self.log and log_refused(series)
        log_state = "off (values reach 0)" if refused else "on" if self.log else "off"
        smooth, pos = "on" if self.smooth else "off", "on" if self.positions else "off"
        hints = (f"   [e] EMA {smooth}  [o] log {log_state}  [p] per position {pos}"
                 "  [a] loss/acc/acceptance  [v] train/val")
        if self.metric == "acceptance":   # points per checkpoint: no EMA, log or split
            hints = "   [a] loss/acc/acceptance"
        elif title.cell_len + len(hints) > w:   # one line at 80 columns: the keys only
            hints = f"  e:EMA {smooth} o:log {log_state} p:pos {pos} a:metric v:split"
        title.append(hints, style="dim")
        title.truncate(max(1, w), overflow="ellipsis")
        companion = COMPANION.get(self.metric)
        below = self.series(companion) if companion and h >= TWO_PLOTS_AT else []
        if not below:
            lines = [title, *self.body(self.metric, series, w, h - 1)]
            return Text("\n").join(lines[:h])
        top_h = (h - 1) // 2          # the selected family's rows, then a blank and the other
        low_title = self.title(companion)
        low_title.truncate(max(1, w), overflow="ellipsis")
        lines = [title, *self.body(self.metric, series, w, top_h - 1)][:top_h]
        lines += [Text("")] * (top_h - len(lines)) + [Text(""), low_title]
        lines += self.body(companion, below, w, h - len(lines))
        return Text("\n").join(lines[:h])
