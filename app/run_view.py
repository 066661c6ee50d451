"""What the panel knows about a run, read incrementally from the run directory.

Only files: state.json (re-read when it changes) and each stage's
events.jsonl (tailed by byte offset). Memory stays bounded however long the
panel is open: metric series thin themselves out past a cap, lists of
warnings keep their newest entries.
"""

from __future__ import annotations

import os
from array import array
from collections import deque
from dataclasses import dataclass, field

from pipeline.run.events import EventTail, EventType
from pipeline.run.executor import driver_alive
from pipeline.run.reconcile import observe
from pipeline.run.rundir import RunDir, RunDirError, Status
from pipeline.stage_graph import STAGE_NAMES


class Series:
    """(step, value) points, thinned to every other point when over `cap`.

    The cap is what a terminal chart can use, not what a run produces: a chart
    is a few hundred braille dots wide, and 20,000 points still give each of
    them the mean of dozens. At 200,000 a stage logging 4 metrics 50 times a
    second grew the panel's RSS for over an hour (56 -> 67 MiB in 30 minutes,
    bench/bench_panel.py); at 20,000: 61 MiB from the 10th minute to the 30th."""

    def __init__(self, cap: int = 20_000):
        self.x, self.y, self.cap, self.stride, self._skip = array("d"), array("d"), cap, 1, 0
        self.added = 0   # points offered, kept or not: the next step of a step-less metric

    def add(self, x: float, y: float) -> None:
        self.added += 1
        self._skip += 1
        if self._skip < self.stride:
            return
        self._skip = 0
        self.x.append(x)
        self.y.append(y)
        if len(self.x) > self.cap:
            self.x, self.y = self.x[::2], self.y[::2]
            self.stride *= 2

    def __len__(self) -> int:
        return len(self.x)


@dataclass
class StageInfo:
    name: str
    state: dict = field(default_factory=dict)
    progress: dict | None = None
    last_error: dict | None = None
    warnings: deque = field(default_factory=lambda: deque(maxlen=20))
    finished: dict | None = None
    started: dict | None = None
    kv_cache: dict | None = None
    kv_servers: dict = field(default_factory=dict)   # server -> its kv_cache event
    kv_usage: dict | None = None
    online: dict | None = None    # online training's producer/consumer figures
    backend: str | None = None    # the backend the stage resolved (its `backend` event)
    servers: dict = field(default_factory=dict)   # server -> its last `server` event


class RunView:
    def __init__(self, run: RunDir, poll_bytes: int = 8 << 20):
        self.run = run
        self.stages = {s: StageInfo(s) for s in STAGE_NAMES}
        self.tails = {s: EventTail(run.events_path(s)) for s in STAGE_NAMES}
        self.metrics: dict[tuple[str, str], Series] = {}   # (split, key) -> series
        self.state: dict = {}
        self.state_error: str | None = None
        self.poll_bytes = poll_bytes
        self._state_sig = None
        self._polls = 0
        self._unsafe: set[str] = set()   # stages whose events file is damaged or a link out
        self.version = 0  # bumps on every change; widgets redraw on change only

    def poll(self) -> bool:
        """Read what changed; True if anything did."""
        changed = self._read_state()
        for s, tail in self.tails.items():
            if s in self._unsafe:
                continue
            events = tail.poll(self.poll_bytes)
            for ev in events:
                self._apply(s, ev)
            changed |= bool(events)
        if changed:
            self.version += 1
        return changed

    def _read_state(self) -> bool:
        try:
            st = os.stat(self.run.state_path)
        except FileNotFoundError:
            return False
        sig = (st.st_mtime_ns, st.st_size, st.st_ino)
        self._polls += 1
        # Re-check liveness now and then even without a change: a supervisor
        # killed with SIGKILL never writes again.
        if sig == self._state_sig and self._polls % 10:
            return False
        self._state_sig = sig
        try:
            self.state = observe(self.run)
            self.state_error = None
        except RunDirError as e:
            self.state_error = str(e)
        self._check_events()
        for s, info in self.stages.items():
            info.state = self.state.get("stages", {}).get(s, {})
        return True

    def _check_events(self) -> None:
        """An events file that is a folder, or a link out of the run (on a
        shared run: another user's file), is not read; the panel says why."""
        self._unsafe.clear()
        for s in STAGE_NAMES:
            try:
                self.run.readable(self.run.events_path(s), "an events file")
            except RunDirError as e:
                self._unsafe.add(s)
                self.state_error = self.state_error or str(e)

    def _apply(self, stage: str, ev: dict) -> None:
        info = self.stages[stage]
        t = ev.get("type")
        if t == EventType.PROGRESS:
            info.progress = ev
        elif t == EventType.METRIC:
            split = ev.get("split", "train")
            step = ev.get("step")
            if step is None:
                loss = self.metrics.get((split, "loss"))
                step = loss.added if loss is not None else 0
            for k, v in (ev.get("values") or {}).items():
                if isinstance(v, (int, float)):
                    self.metrics.setdefault((split, k), Series()).add(step, float(v))
        elif t == EventType.ERROR:
            info.last_error = ev
        elif t == EventType.WARNING:
            info.warnings.append(ev)
        elif t == EventType.STAGE_STARTED:
            info.started, info.finished, info.last_error, info.progress = ev, None, None, None
            info.kv_servers.clear()
            info.servers.clear()
            info.backend = None
        elif t == EventType.STAGE_FINISHED:
            info.finished = ev
        elif t == EventType.KV_CACHE:
            info.kv_cache = ev
            if "server" in ev:
                info.kv_servers[ev["server"]] = ev
        elif t == EventType.KV_USAGE:
            info.kv_usage = ev
        elif t == EventType.ONLINE:
            info.online = ev
        elif t == EventType.BACKEND:
            info.backend = ev.get("backend")
        elif t == EventType.SERVER:
            info.servers[str(ev.get("server"))] = ev

    # derived views ------------------------------------------------------------
    def driver_pid(self) -> int | None:
        d = self.state.get("driver") or {}
        return d.get("pid") if self.state and driver_alive(self.state) else None

    def focus_stage(self) -> str:
        """The stage a user opening the panel wants to see: the running one,
        else the first that failed or was cancelled, else the last that ran
        (a finished run's outcome), else the first."""
        states = {s: info.state for s, info in self.stages.items()}
        for want in ((Status.RUNNING,), (Status.FAILED, Status.CANCELLED)):
            for s, st in states.items():
                if st.get("status") in want:
                    return s
        ran = [s for s, st in states.items() if st.get("attempt")]
        return ran[-1] if ran else STAGE_NAMES[0]

    def running_stage(self) -> str | None:
        for s, info in self.stages.items():
            if info.state.get("status") == Status.RUNNING:
                return s
        return None

    def running_stages(self) -> list[str]:
        return [s for s, info in self.stages.items()
                if info.state.get("status") == Status.RUNNING]

    def devices_by_gpu(self) -> dict[int, str]:
        """GPU index -> the running stage that was given it (NVML's process
        list is empty in many containers; the assignment is what we know)."""
        held = {}
        for s, info in self.stages.items():
            if info.state.get("status") == Status.RUNNING:
                for d in info.state.get("devices") or []:
                    held[d] = s
                if info.online:   # online training: its vLLM servers' GPUs
                    for d in info.online.get("server_devices") or []:
                        held[d] = f"{s}:vLLM"
        return held

    def acceptance_measured(self) -> float | None:
        """The last acceptance length the evaluate stage measured."""
        s = self.metrics.get(("eval", "acceptance_length"))
        return s.y[-1] if s is not None and len(s) else None

    def acceptance_estimate(self) -> float | None:
        fin = self.stages["train"].finished
        if fin and (fin.get("summary") or {}).get("acceptance_length") is not None:
            return fin["summary"]["acceptance_length"]
        accs = sorted(k for sp, k in self.metrics if sp == "val" and k.startswith("full_acc_"))
        if not accs:
            return None
        return 1.0 + sum(self.metrics[("val", k)].y[-1] for k in accs)
