"""The drift rule: a draft whose acceptance on the traffic it gets stays
below what evaluate measured, said once when it starts and once when it
ends, on screen and as a JSON line in the log the user names.

Defaults, and why: the last minute's acceptance length more than 10% below
the measured one (MARGIN), for 5 minutes (HOLD_S). A minute of serving holds
thousands of verify steps, so its acceptance is steady to a few per cent;
evaluate's own measurement is over tens to hundreds of prompts, a few per
cent again; 10% is past both. One odd request type moves a minute, not five:
5 minutes is a change in the traffic, the thing worth a line. A position
"fell" when its accept rate is below the measured one by the same margin."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.watch.figures import Figures
from pipeline.watch.measured import Measured

MARGIN, HOLD_S = 0.10, 300.0


@dataclass
class Drift:
    """The rule's state across readings."""
    margin: float = MARGIN
    hold_s: float = HOLD_S
    below_since: float | None = None    # when the window first fell below
    drifting: bool = False
    fell: list[int] = field(default_factory=list)   # positions (1-based) below, last seen

    def update(self, t: float, window: Figures | None, m: Measured) -> dict | None:
        """The window at `t` against the measurement; the event to log when
        the state changes ("drift" or "recovered"), else None. A window with
        no verified draft neither starts nor ends a drift."""
        if window is None or window.acceptance_length is None:
            return None
        floor = m.acceptance_length * (1 - self.margin)
        below = window.acceptance_length < floor
        self.fell = [k + 1 for k, (live, want) in enumerate(zip(
            window.per_position, m.per_position, strict=False))
            if live is not None and want is not None and live < want * (1 - self.margin)]
        if below:
            self.below_since = self.below_since if self.below_since is not None else t
        else:
            self.below_since = None
        event = None
        if below and not self.drifting and t - self.below_since >= self.hold_s:
            self.drifting, event = True, "drift"
        elif not below and self.drifting:
            self.drifting, event = False, "recovered"
        if event is None:
            return None
        return {"t": t, "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t)),
                "event": event, "acceptance_length": round(window.acceptance_length, 4),
                "measured": round(m.acceptance_length, 4), "margin": self.margin,
                "window_s": round(window.seconds, 1), "positions_fell": self.fell,
                "measured_from": m.source}

    def text(self, t: float, m: Measured) -> str:
        """The screen's line: drifting (since when, which positions), or how
        long the window has been below, or nothing."""
        if self.drifting:
            return (f"DRIFT: acceptance below {1 - self.margin:.0%} of the measured "
                    f"{m.acceptance_length:.2f} for {t - self.below_since:.0f} s"
                    + (f"; positions {', '.join(map(str, self.fell))} fell" if self.fell else ""))
        if self.below_since is not None:
            return (f"below {1 - self.margin:.0%} of the measured acceptance for "
                    f"{t - self.below_since:.0f} s (a drift at {self.hold_s:.0f} s)")
        return ""


def append_line(path: Path, event: dict) -> None:
    """One JSON line, appended in one write (readers never see half a line)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(event) + "\n").encode())
    finally:
        os.close(fd)
