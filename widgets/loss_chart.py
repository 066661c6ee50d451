"""Training curves drawn in braille cells (2x4 dots per character).

Each series is reduced to one value per dot column (the mean of the points
that fall in it) before drawing, so a 100,000-step run costs about what a
100-step one does. A column is drawn from its lowest point to its highest
too (clipped to the means' range), so a one-step loss spike stays a visible
stroke however long the history: the series keep each bucket's extremes
(pipeline.run.series), the mean alone would flatten them. EMA smoothing
(which draws the smoothed means only) and a log scale are toggles.
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


def log_refused(series) -> bool:
    """A log scale cannot show a value of 0 or below (an accuracy of 0 at the
    start, a loss that is not a loss): those series stay linear."""
    return any(len(y) and float(np.min(y)) <= 0 for _, _, y, *_ in series)


def plot(series: list[tuple], width: int, height: int,
         smooth: bool = False, log: bool = False) -> list[Text]:
    """Render series [(label, x, y)] or [(label, x, y, "points")] into
    `height` lines of `width` cells: curves in braille dots, "points"
    series as one marked cell per value, y labelled every TICK_EVERY rows."""
    label_w = 8
    cols, rows = max(1, (width - label_w)) * 2, max(1, height - 1) * 4
    series = [(s[0], s[1], s[2], s[3] if len(s) > 3 else "line") for s in series if len(s[1])]
    if not series:
        return [Text("no training metrics yet", style="dim")]
    log = log and not log_refused(series)
    x0 = min(float(x[0]) for _, x, _, _ in series)
    x1 = max(float(x[-1]) for _, x, _, _ in series)
    reduced = [(name, *reduce_series(x, y, x0, x1, cols, log, smooth and kind == "line",
                                     extremes=kind == "line"), kind)
               for name, x, y, kind in series]
    finite = np.concatenate([m[~np.isnan(m)] for _, m, _, _ in reduced])
    if not len(finite):
        return [Text("no finite values", style="dim")]
    lo, hi = float(finite.min()), float(finite.max())
    if hi - lo < 1e-12:
        hi = lo + 1.0
    grid, color, marks = draw(reduced, lo, hi, rows, cols)
    fmt_v = (lambda v: f"{10 ** v:.3g}") if log else (lambda v: f"{v:.3g}")
    lines = rendered_rows(grid, color, marks, label_w,
                          lambda i, n: fmt_v(row_value(i, n, lo, hi, rows)))
    legend = Text(f"{'step':>{label_w - 1}} {int(x0)}..{int(x1)}  ", style="dim")
    for k, (name, _, _, kind) in enumerate(reduced):
        legend.append(f"{POINT if kind == 'points' else '■'} {name} ",
                      style=COLORS[k % len(COLORS)])
    lines.append(legend)
    return lines


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
    """The braille dot grid, each cell's series, and the marked points' cells."""
    grid = np.zeros((rows // 4, cols // 2), dtype=np.int32)
    color = np.full(grid.shape, -1)
    marks: dict[tuple[int, int], int] = {}

    def row(v: float) -> int:   # (an extreme past the range: drawn to its edge)
        return min(rows - 1, max(0, int(round((hi - v) / (hi - lo) * (rows - 1)))))

    for k, (_, m, env, kind) in enumerate(reduced):
        if kind == "points":
            for c in np.flatnonzero(~np.isnan(m)):
                marks[(row(m[c]) // 4, int(c) // 2)] = k
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


def rendered_rows(grid, color, marks: dict, label_w: int, label) -> list[Text]:
    """The grid as lines of text, a y label (`label(i, n_rows)`) every TICK_EVERY rows."""
    n_rows = grid.shape[0]
    lines = []
    for i in range(n_rows):
        tick = i == 0 or i == n_rows - 1 or (i % TICK_EVERY == 0 and n_rows - 1 - i >= 2)
        line = Text(f"{label(i, n_rows) if tick else '':>{label_w - 1}} ", style="dim")
        for j in range(grid.shape[1]):
            if (i, j) in marks:
                line.append(POINT, style="bold " + COLORS[marks[(i, j)] % len(COLORS)])
                continue
            bits = grid[i, j]
            line.append(chr(BRAILLE + bits) if bits else " ",
                        style=COLORS[color[i, j] % len(COLORS)] if bits else "")
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
    smooth = reactive(False)
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
        if family == "loss" and (self.split, "loss") in m:
            keys = ["loss", *keys]
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
        per_step = family in ("loss", "full_acc")   # EMA and log: for the training curves
        return plot(series, width, max(2, height), self.smooth and per_step,
                    self.log and per_step)

    def render(self):
        w, h = self.size.width, self.size.height
        series = self.series()
        title = self.title(self.metric)
        refused = self.log and log_refused(series)
        log_state = "off (values reach 0)" if refused else "on" if self.log else "off"
        hints = (f"   [e] EMA {'on' if self.smooth else 'off'}  [o] log {log_state}"
                 "  [a] loss/acc/acceptance  [v] train/val")
        if self.metric == "acceptance":   # points per checkpoint: no EMA, log or split
            hints = "   [a] loss/acc/acceptance"
        elif title.cell_len + len(hints) > w:   # one line at 80 columns: the keys only
            hints = (f"  e:EMA {'on' if self.smooth else 'off'} o:log {log_state} "
                     "a:metric v:split")
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
