"""A metric's curve, bounded however long the run: min and max per bucket.

A week of training logs millions of points per metric; a terminal chart is a
few hundred dots wide and the trackers' export wants the curve's shape. So a
series keeps at most BUCKETS buckets of consecutive points, each as its lowest
and its highest point (in step order): a loss spike of one step survives any
amount of history, where keeping every other point (the series before this
one) dropped it half the time, and a mean would flatten it. When the buckets
are full, neighbours merge in pairs and each bucket holds twice as many points
from then on (TensorBoard keeps a reservoir per scalar, W&B samples 500 points;
neither keeps a one-step spike for sure).

The last point is kept as well, whatever bucket it falls in: `status` and the
panel show the latest learning rate and acceptance, not the bucket's extremes.
The raw events stay on disk, and the trackers ([tracking]) log every point
as training reports it.
"""

from __future__ import annotations

import base64
from array import array

BUCKETS = 2048   # 4,096 points at most: 10x a wide terminal's dots, 64 KiB


class Series:
    """(step, value) points; see the module's docstring. `x` and `y` are
    array("d") (a chart reads them through np.frombuffer); the reader copies
    a series a snapshot holds before it changes it (copy on write)."""

    __slots__ = ("_b", "per", "_fill", "added", "last_x", "last_y", "_xy")

    def __init__(self):
        # buckets, flat: x of the first extreme, its y, x of the second, its y
        self._b = array("d")
        self.per = 1          # points a bucket holds (a power of 2)
        self._fill = 0        # points in the last bucket so far
        self.added = 0        # points offered: the next step of a step-less metric
        self.last_x = self.last_y = 0.0
        self._xy = None       # (x, y) built for the readers, until the next add

    def add(self, x: float, y: float) -> None:
        self.added += 1
        self.last_x, self.last_y, self._xy = x, y, None
        b, fill = self._b, self._fill
        if fill and fill < self.per:
            self._fill = fill + 1
            # Most points fall between the bucket's extremes: nothing to do. A
            # new extreme, the newest step: the other extreme first, it second.
            y1, y2 = b[-3], b[-1]
            if y1 <= y2:   # first the lowest, second the highest
                if y < y1:
                    kx, ky = b[-2], y2
                elif y > y2:
                    kx, ky = b[-4], y1
                else:
                    return
            elif y < y2:
                kx, ky = b[-4], y1
            elif y > y1:
                kx, ky = b[-2], y2
            else:
                return
            if x >= b[-2]:
                b[-4], b[-3], b[-2], b[-1] = kx, ky, x, y
            else:   # (steps that went back: a resumed attempt)
                _widen(b, len(b) - 4, x, y)
            return
        if len(b) >= 4 * BUCKETS:
            self._halve()
            b = self._b   # (a new array: the point goes into it, not the old one)
        b.extend((x, y, x, y))
        self._fill = 1

    def _halve(self) -> None:
        """Merge neighbouring buckets in pairs: half as many, twice as wide.
        Only `add` calls it, with BUCKETS (an even number of) full buckets."""
        b, out = self._b, array("d")
        for i in range(0, len(b), 8):
            out.extend(b[i:i + 4])
            _widen(out, len(out) - 4, b[i + 4], b[i + 5])
            _widen(out, len(out) - 4, b[i + 6], b[i + 7])
        self._b, self.per = out, self.per * 2
        self._fill = self.per   # (the merged last bucket is full too)

    def _points(self) -> tuple[array, array]:
        if self._xy is None:
            x, y, b = array("d"), array("d"), self._b
            for i in range(0, len(b), 4):
                x.append(b[i])
                y.append(b[i + 1])
                if b[i + 2] != b[i] or b[i + 3] != b[i + 1]:   # one point: once
                    x.append(b[i + 2])
                    y.append(b[i + 3])
            self._xy = (x, y)
        return self._xy

    @property
    def x(self) -> array:
        return self._points()[0]

    @property
    def y(self) -> array:
        return self._points()[1]

    def __len__(self) -> int:
        return len(self.x)

    def copy(self) -> Series:
        twin = Series()
        twin._b, twin._xy = array("d", self._b), self._xy   # (_xy is never changed, only dropped)
        twin.per, twin._fill, twin.added = self.per, self._fill, self.added
        twin.last_x, twin.last_y = self.last_x, self.last_y
        return twin

    def extended(self, other: Series) -> Series:
        """This series, then `other`'s points after it (two stages that log
        the same metric: a snapshot shows them as one curve)."""
        out = self.copy()
        xs, ys = other.x, other.y
        for x, y in zip(xs, ys, strict=True):
            out.add(x, y)
        out.added = self.added + other.added
        if other.added:
            out.last_x, out.last_y = other.last_x, other.last_y
        return out

    def to_json(self) -> dict:
        """Exactly this series (the read model's checkpoint): the buckets as
        base64 of their doubles, nothing rounded."""
        return {"b": base64.b64encode(self._b.tobytes()).decode(), "per": self.per,
                "fill": self._fill, "added": self.added, "last": [self.last_x, self.last_y]}

    @classmethod
    def from_json(cls, d: dict) -> Series:
        """The series `to_json` wrote; ValueError (or TypeError, KeyError)
        on anything else: the checkpoint is then rebuilt from the events."""
        s = cls()
        s._b.frombytes(base64.b64decode(d["b"], validate=True))
        s.per, s._fill, s.added = int(d["per"]), int(d["fill"]), int(d["added"])
        s.last_x, s.last_y = (float(v) for v in d["last"])
        if len(s._b) % 4 or len(s._b) > 4 * BUCKETS or s.per < 1 or s.per & (s.per - 1) or \
                not 0 <= s._fill <= s.per or s.added < len(s._b) // 4:
            raise ValueError("not a series")
        return s


def _widen(b: array, i: int, x: float, y: float) -> None:
    """Take (x, y) into the bucket at b[i:i+4]: its lowest and highest points,
    in step order."""
    lo_first = b[i + 1] <= b[i + 3]
    lo = (b[i], b[i + 1]) if lo_first else (b[i + 2], b[i + 3])
    hi = (b[i + 2], b[i + 3]) if lo_first else (b[i], b[i + 1])
    if y < lo[1]:
        lo = (x, y)
    elif y > hi[1]:
        hi = (x, y)
    first, second = (lo, hi) if lo[0] <= hi[0] else (hi, lo)
    b[i:i + 4] = array("d", (*first, *second))
