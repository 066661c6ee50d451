"""The readings of the last hour, bounded, and the windows over them (the
last minute, ten minutes, hour): each window's figures are the counters'
deltas between the newest reading and the oldest one inside it. A restart
(counters going back) clears what came before it: the new server's counts
start from zero at the last read before it (an upper bound on its age)."""

from __future__ import annotations

from collections import deque
from dataclasses import replace

from pipeline.watch.figures import ZERO, Figures, Reading, between, restarted

WINDOWS = (("1 min", 60.0), ("10 min", 600.0), ("1 h", 3600.0))


class History:
    """At most an hour of readings at `interval` (a slow server's gaps only
    make it shorter): memory stays bounded however long `watch` runs."""

    def __init__(self, interval: float, span_s: float = WINDOWS[-1][1]):
        self.span_s, self.interval = span_s, interval
        self.readings: deque[Reading] = deque(maxlen=int(span_s / interval) + 2)
        self.restarts = 0

    def add(self, r: Reading) -> bool:
        """Keep `r`; True when it shows a restart since the last reading."""
        last = self.readings[-1] if self.readings else None
        reset = last is not None and restarted(last, r)
        if reset:
            self.restarts += 1
            self.readings.clear()
            self.readings.append(replace(ZERO, t=last.t, per_position={
                k: 0.0 for k in r.per_position}, spec_decode=r.spec_decode))
        self.readings.append(r)
        while self.readings and self.readings[-1].t - self.readings[0].t > self.span_s + 1e-9:
            self.readings.popleft()
        return reset

    @property
    def last(self) -> Reading | None:
        return self.readings[-1] if self.readings else None

    def window(self, seconds: float) -> Figures | None:
        """The figures of the last `seconds` (from the oldest reading inside
        them); None before two readings, and after a silence longer than the
        window (the reading before it is not "the last minute")."""
        if len(self.readings) < 2:
            return None
        newest = self.readings[-1]
        oldest = next((r for r in self.readings if newest.t - r.t <= seconds + 1e-9), newest)
        if oldest is newest:   # a window shorter than the interval: the last one, if recent
            oldest = self.readings[-2]
            if newest.t - oldest.t > 2 * max(seconds, self.interval):
                return None
        return between(oldest, newest)

    def windows(self) -> dict[str, Figures | None]:
        return {name: self.window(s) for name, s in WINDOWS}
