"""`eagle-panel watch URL` without the panel: `--once` reads /metrics twice,
`--interval` apart, and prints the interval's figures and those since the
server started; `--lines`, the same each interval until Ctrl-C (`--json`:
a JSON object, one per line). Beside each figure, what evaluate measured for
the draft when one is named (`--run`, `--draft`), only for the positions the
server reports.

Exit status: 0; 1 the server did not answer the first read; 2 bad input (a
URL that is not http(s), a server that is not vLLM, a key variable unset,
a draft whose measurement cannot be read)."""

from __future__ import annotations

import json
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from pipeline.watch.figures import Figures, NotVllm, Reading, between, read
from pipeline.watch.measured import Measured
from pipeline.watch.scrape import NoAnswer, Target
from pipeline.watch.state import Watcher

EXIT_OK, EXIT_NO_ANSWER, EXIT_BAD_INPUT = 0, 1, 2


@dataclass(frozen=True)
class Report:
    """An interval's figures, those since the server started, its gauges now,
    and the draft's measurement beside them (None: not named)."""
    url: str
    model: str | None
    window: Figures
    since_start: Figures
    now: Reading
    measured: Measured | None

    def difference(self) -> dict | None:
        """Live minus measured: acceptance length, and each position the
        server reports that evaluate measured too."""
        m, w = self.measured, self.window
        if m is None or w.acceptance_length is None:
            return None
        n = min(len(w.per_position), len(m.per_position))
        return {"acceptance_length": w.acceptance_length - m.acceptance_length,
                "per_position": [None if w.per_position[k] is None or m.per_position[k] is None
                                 else w.per_position[k] - m.per_position[k] for k in range(n)]}

    def to_json(self) -> dict:
        now = self.now
        return {"url": self.url, "model": self.model, "spec_decode": now.spec_decode,
                "window": self.window.to_json(), "since_start": self.since_start.to_json(),
                "running": now.running, "waiting": now.waiting, "kv_usage": now.kv_usage,
                "measured": self.measured.to_json() if self.measured else None,
                "difference": self.difference()}

    def lines(self) -> list[str]:
        w, s, now, m = self.window, self.since_start, self.now, self.measured
        head = f"vLLM at {self.url}" + (f" serving {self.model}" if self.model else "")
        if not now.spec_decode:
            return [head, "no speculative decoding on this server (no spec_decode counters "
                          "in its /metrics): it serves no draft", gauges(now)]
        out = [head + (f" · over {w.seconds:.1f} s" if w.seconds else "")
               + (" · the server restarted: counted from then" if w.restarted else "")]
        if w.acceptance_length is None:
            out.append("acceptance length - (no draft verified in this interval)")
        else:
            diff = self.difference()
            out.append(f"acceptance length {w.acceptance_length:.2f}"
                       + (f" (measured {m.acceptance_length:.2f}: "
                          f"{diff['acceptance_length']:+.2f})" if diff else "")
                       + f" · accept rate {w.acceptance_rate:.2f}")
            out.append("per position " + "  ".join(position_text(k, w, m)
                                                    for k in range(len(w.per_position))))
        if w.seconds:
            out.append(f"drafted {w.drafted_per_s:.1f} tokens/s · accepted "
                       f"{w.accepted_per_s:.1f} tokens/s · generated {w.generated_per_s:.1f} "
                       "tokens/s")
        out.append(gauges(now))
        out.append("since the server started: "
                   + (f"acceptance length {s.acceptance_length:.2f} over {s.drafts:,} drafts"
                      if s.acceptance_length is not None else "no draft verified")
                   + f", {s.generated_tokens:,} tokens generated")
        if m is not None:
            out.append(f"measured: {m.source}")
        return out


def position_text(k: int, w: Figures, m: Measured | None) -> str:
    live = w.per_position[k]
    text = f"{k + 1}: {live:.2f}" if live is not None else f"{k + 1}: -"
    if m is not None and k < len(m.per_position) and m.per_position[k] is not None:
        text += f" ({m.per_position[k]:.2f})"
    return text


def gauges(now: Reading) -> str:
    def num(v):
        return "-" if v is None else f"{v:.0f}"
    kv = "-" if now.kv_usage is None else f"{now.kv_usage:.1%}"
    return f"requests running {num(now.running)} · waiting {num(now.waiting)} · KV cache {kv}"


def scrape(target: Target, timeout: float) -> Reading:
    return read(target.metrics(timeout), time.time())


@contextmanager
def ctrl_c_ends(stopping: threading.Event):
    """Ctrl-C (and SIGTERM) set `stopping` rather than raise: the loop ends
    after the read in flight (at most its timeout), never halfway through a
    printed line (a script reading the JSON gets whole lines). Outside the
    main thread (a test's) nothing is installed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {sig: signal.signal(sig, lambda *_: stopping.set())
           for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def run(target: Target, interval: float, measured: Measured | None, once: bool,
        as_json: bool, out: TextIO, err: TextIO, stop=lambda: False,
        log: Path | None = None) -> int:
    """Read the server every `interval` seconds, one request at a time,
    print each interval; `--once`: one interval. The drift rule runs on every
    read (its line printed, its events in `log`). `stop`: a test's way to end
    the loop (a user's is Ctrl-C, exit 0)."""
    stopping = threading.Event()
    with ctrl_c_ends(stopping):
        return _loop(target, interval, measured, once, as_json, out, err,
                     lambda: stopping.is_set() or stop(), stopping, log)


def _loop(target: Target, interval: float, measured: Measured | None, once: bool,
          as_json: bool, out: TextIO, err: TextIO, stop, stopping: threading.Event,
          log: Path | None) -> int:
    timeout = max(1.0, min(interval, 10.0))
    try:
        first = scrape(target, timeout)
    except NoAnswer as e:
        print(f"eagle-panel watch: {e}", file=err)
        return EXIT_NO_ANSWER
    except NotVllm as e:
        print(f"eagle-panel watch: {target.url}: {e}", file=err)
        return EXIT_BAD_INPUT
    model = target.served_model(timeout)
    last, silent_since = first, None
    watcher = Watcher(target.url, interval, measured, log)
    watcher.answered(first)
    while not stopping.wait(interval):
        try:
            now = scrape(target, timeout)
        except (NoAnswer, NotVllm) as e:
            silent_since = silent_since or time.strftime("%H:%M:%S")
            print(f"no answer since {silent_since} ({e}); the last figures stand",
                  file=err, flush=True)
            if once:
                return EXIT_NO_ANSWER
            continue
        silent_since = None
        watcher.answered(now)
        drift = watcher.state().drift
        report = Report(target.url, model, between(last, now), between(None, now), now,
                        measured)
        if as_json:
            print(json.dumps({**report.to_json(), "drift": drift or None}), file=out,
                  flush=True)
        else:
            print("\n".join(report.lines() + ([drift] if drift else []))
                  + ("" if once else "\n"), file=out, flush=True)
        if once or stop():
            return EXIT_OK
        last = now
    return EXIT_OK
