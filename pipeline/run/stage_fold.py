"""What a reader keeps of one stage's events: the fold of its events.jsonl.

`RunReader` (pipeline.run.snapshot) folds each stage's events into one of
these as it tails them, and the read model's checkpoint
(pipeline.run.read_checkpoint) saves one to disk with the byte offset it
covers, so a reader of a long run starts from there instead of replaying a
million events. One class for both, so the checkpoint can never fold an
event differently from the live reader.
"""

from __future__ import annotations

from collections import deque

from pipeline.run.events import SERVER_READY, EventType, valid_event
from pipeline.run.rundir import Status
from pipeline.run.series import Series

WARNINGS_KEPT = 20     # a stage's newest warnings
ATTEMPTS_KEPT = 50     # a stage re-run all day keeps its last 50

# the fields that hold one event each, and the type that event must have
_ONE_EVENT = {"progress": EventType.PROGRESS, "last_error": EventType.ERROR,
              "finished": EventType.STAGE_FINISHED, "kv_usage": EventType.KV_USAGE,
              "online": EventType.ONLINE}


class StageFold:
    """One stage's events, folded: its attempts, the last event of each kind
    the views show, its metric series. `shared` names the series a snapshot
    holds: they are copied before they change (copy on write)."""

    def __init__(self):
        self.attempts: list = []           # [number, started_at, status, seconds]
        self.progress: dict | None = None
        self.last_error: dict | None = None
        self.warnings: deque = deque(maxlen=WARNINGS_KEPT)
        self.finished: dict | None = None
        self.servers: dict = {}            # name -> its last server event
        self.kv: dict = {}                 # name -> its last kv_cache event
        self.kv_usage: dict | None = None
        self.online: dict | None = None
        self.backend: str | None = None
        self.loads = 0                     # servers that came up, every attempt
        self.loading_s = 0.0               # and their start times, summed
        self.metrics: dict[tuple[str, str], Series] = {}
        self.shared: set[tuple[str, str]] = set()

    @property
    def summary(self) -> dict:
        """The attempt's stage_finished summary ({} until it has one)."""
        return (self.finished or {}).get("summary") or {}

    def apply(self, ev: dict) -> None:
        t = ev.get("type")
        if t == EventType.METRIC:
            self._metric(ev)
        elif t == EventType.PROGRESS:
            self.progress = ev
        elif t == EventType.ERROR:
            self.last_error = ev
        elif t == EventType.WARNING:
            self.warnings.append(ev)
        elif t == EventType.STAGE_STARTED:
            self._started(ev)
        elif t == EventType.STAGE_FINISHED:
            self._finished(ev)
        elif t == EventType.KV_CACHE:
            name = str(ev.get("server", "engine"))
            self.kv.pop(name, None)   # the newest last
            self.kv[name] = ev
        elif t == EventType.KV_USAGE:
            self.kv_usage = ev
        elif t == EventType.ONLINE:
            self.online = ev
        elif t == EventType.BACKEND:
            self.backend = ev.get("backend")
        elif t == EventType.SERVER:
            self._server(ev)

    def _metric(self, ev: dict) -> None:
        split, step = ev.get("split", "train"), ev.get("step")
        if step is None:   # the next step, counted over every point offered
            loss = self.metrics.get((split, "loss"))
            step = loss.added if loss is not None else 0
        metrics, shared = self.metrics, self.shared
        for k, v in (ev.get("values") or {}).items():
            if isinstance(v, (int, float)):
                key = (split, k)
                series = metrics.get(key)
                if series is None:   # (not setdefault: that builds a Series per point)
                    series = metrics[key] = Series()
                elif shared and key in shared:
                    shared.discard(key)
                    series = metrics[key] = series.copy()
                series.add(step, float(v))

    def _server(self, ev: dict) -> None:
        key = str(ev.get("server"))
        before = self.servers.get(key)
        if ev.get("phase") == SERVER_READY and (before is None or before.get("phase") != SERVER_READY):
            self.loads += 1   # (a server's ready may be said again while another starts)
            self.loading_s += float(ev.get("elapsed_s") or 0.0)
        self.servers[key] = ev

    def _started(self, ev: dict) -> None:
        """A new attempt: what the last one showed goes (its time stays). An
        attempt still open had no stage_finished: it was killed."""
        if self.attempts and self.attempts[-1][2] == Status.RUNNING:
            self.attempts[-1][2] = "killed"
        self.attempts.append([ev.get("attempt") or len(self.attempts) + 1,
                              ev.get("t") or 0.0, Status.RUNNING, None])
        del self.attempts[:-ATTEMPTS_KEPT]
        self.finished = self.last_error = self.progress = self.kv_usage = None
        self.servers.clear()
        self.kv.clear()
        self.backend = None

    def _finished(self, ev: dict) -> None:
        self.finished = ev
        if self.attempts and self.attempts[-1][2] == Status.RUNNING:
            self.attempts[-1][2:] = [ev.get("status"), ev.get("duration_s")]

    # -- the checkpoint's form -----------------------------------------------------------
    def to_json(self) -> dict:
        return {**{k: getattr(self, k) for k in _ONE_EVENT},
                "attempts": self.attempts, "warnings": list(self.warnings),
                "servers": self.servers, "kv": self.kv, "backend": self.backend,
                "loads": self.loads, "loading_s": self.loading_s,
                "metrics": [[split, key, s.to_json()]
                            for (split, key), s in self.metrics.items()]}

    @classmethod
    def from_json(cls, d: dict) -> StageFold:
        """The fold `to_json` wrote; ValueError (TypeError, KeyError) on
        anything a reader could trip on: each event it holds is checked as a
        line read from the events file would be."""
        f = cls()
        for k, kind in _ONE_EVENT.items():
            setattr(f, k, _event(d[k], kind))
        f.warnings.extend(_event(ev, EventType.WARNING) for ev in d["warnings"][-WARNINGS_KEPT:])
        f.servers = {str(k): _event(ev, EventType.SERVER) for k, ev in d["servers"].items()}
        f.kv = {str(k): _event(ev, EventType.KV_CACHE) for k, ev in d["kv"].items()}
        f.attempts = [_attempt(a) for a in d["attempts"][-ATTEMPTS_KEPT:]]
        f.backend = d["backend"]
        if f.backend is not None and not isinstance(f.backend, str):
            raise ValueError("backend")
        f.loads, f.loading_s = int(d["loads"]), float(d["loading_s"])
        f.metrics = {(str(split), str(key)): Series.from_json(s)
                     for split, key, s in d["metrics"]}
        return f


def _event(ev, kind: EventType) -> dict | None:
    if ev is None and kind not in (EventType.WARNING, EventType.SERVER, EventType.KV_CACHE):
        return None
    if not valid_event(ev) or ev["type"] != kind:
        raise ValueError(f"not a {kind.value} event")
    return ev


def _attempt(a) -> list:
    number, started_at, status, seconds = a   # (ValueError: not four)
    if not isinstance(number, int) or not isinstance(status, str) or \
            not isinstance(started_at, (int, float)) or \
            not (seconds is None or isinstance(seconds, (int, float))):
        raise ValueError("not an attempt")
    return [number, started_at, status, seconds]
