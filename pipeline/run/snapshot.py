"""One typed picture of a run: what `status`, `status --json`, `run --wait`
and the panel all show, read from the run directory and nothing else.

`RunReader` reads incrementally, as the panel needs: state.json when it
changes (through `reconcile.observe`, which never writes), each stage's
events.jsonl tailed by byte offset; memory stays bounded however long it runs
(metric series thin themselves out past a cap, warnings keep their newest).
`RunReader.snapshot()` hands out a `RunSnapshot` of frozen values; `read_run`
is the one-shot reader the commands use (the same reader, polled once over
every file). Before this module the panel, `status` and `run --wait` each
tailed the files and indexed state.json themselves, and disagreed: the KV tab
showed extract's cache whatever stage was selected, `status --json` had no
outcome, and a stage's time counted its last attempt only.

Reading only: nothing here writes, signals or removes (tests/test_shape.py
keeps it so); liveness comes from the executor's read-only checks.
"""

from __future__ import annotations

import os
import time
from array import array
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from pipeline.run.events import EventTail, EventType
from pipeline.run.executor import Executor, driver_alive, for_run
from pipeline.run.reconcile import observe
from pipeline.run.rundir import RunDir, RunDirError, Status
from pipeline.stage_graph import STAGE_NAMES

_EMPTY: Mapping = MappingProxyType({})


class Series:
    """(step, value) points, thinned to every other point when over `cap`.

    The cap is what a terminal chart can use, not what a run produces: a chart
    is a few hundred braille dots wide, and 20,000 points still give each of
    them the mean of dozens. At 200,000 a stage logging 4 metrics 50 times a
    second grew the panel's RSS for over an hour (56 -> 67 MiB in 30 minutes,
    bench/bench_panel.py); at 20,000: 61 MiB from the 10th minute to the 30th.
    The reader appends; a series a snapshot holds is copied before it changes
    (RunReader), so whoever draws a snapshot reads it on any thread."""

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

    def copy(self) -> Series:
        twin = Series(self.cap)
        twin.x, twin.y, twin.stride = array("d", self.x), array("d", self.y), self.stride
        twin._skip, twin.added = self._skip, self.added
        return twin


# -- the snapshot's values -------------------------------------------------------------

@dataclass(frozen=True)
class Attempt:
    """One try of a stage, from its stage_started / stage_finished events."""
    number: int
    started_at: float
    status: str               # its stage_finished status; "running" while it runs
    seconds: float | None     # None while it runs (StageView.seconds counts it so far)


@dataclass(frozen=True)
class ServerView:
    """One vLLM server a stage's current attempt started: its last `server`
    event (startup.describe reads it) and its own KV-cache report."""
    name: str
    label: str
    phase: str
    elapsed_s: float | None
    stalled_s: float | None
    last_line: str
    kv_cache: Mapping | None
    event: Mapping

    @property
    def stopped(self) -> bool:
        from pipeline.vllm.startup import STOPPED
        return self.phase == STOPPED


@dataclass(frozen=True)
class Progress:
    done: int
    total: int | None
    unit: str
    epoch: int | None
    eta_s: float | None
    event: Mapping            # the progress event (fmt.progress_text reads it)


@dataclass(frozen=True)
class StageView:
    name: str
    status: str
    attempt: int
    attempts: tuple[Attempt, ...]     # every attempt this run's events hold, oldest first
    earlier_s: float                  # the attempts before the current one, together
    exit_code: int | None
    signal: str | None
    pid: int | None
    devices: tuple[int, ...]
    reason: str | None
    slurm_job: str | None
    job: str                          # a running attempt's job as its scheduler says it
                                      # ("Slurm job 12 pending (Resources)"; "" locally)
    progress: Progress | None
    servers: tuple[ServerView, ...]   # the current attempt's, by name
    kv_reports: Mapping[str, Mapping]  # server (or "engine") -> its last kv_cache event
    kv_usage: Mapping | None          # the last live-use sample (while a server is up)
    online: Mapping | None            # online training's producer/consumer figures
    backend: str | None               # what "auto" resolved to in this attempt
    target_loads: int                 # vLLM servers that came up, every attempt
    loading_s: float                  # the seconds they took to (the cost of a big target)
    last_error: Mapping | None
    warnings: tuple[Mapping, ...]
    summary: Mapping                  # this attempt's stage_finished summary ({} before it)
    finished: Mapping | None          # the current attempt's stage_finished event
    state: Mapping                    # state.json's entry (fmt.exit_text reads it)

    @property
    def running(self) -> bool:
        return self.status == Status.RUNNING

    def seconds(self, now: float | None = None) -> float | None:
        """Every attempt's time: the earlier ones from their events, the
        current one from state.json (running: up to `now`)."""
        st = self.state
        if not st.get("started_at"):
            return None
        end = st.get("ended_at") or (time.time() if now is None else now)
        return self.earlier_s + max(0.0, end - st["started_at"])

    def kv_cache(self) -> Mapping | None:
        """The KV-cache report to show: the last one of a server still up,
        else the last one (a finished stage keeps what its servers reported;
        the engine route's report has no server)."""
        stopped = {s.name for s in self.servers if s.stopped}
        live = [ev for name, ev in self.kv_reports.items() if name not in stopped]
        reports = list(self.kv_reports.values())
        return (live or reports or [None])[-1]

    def live_kv_usage(self) -> Mapping | None:
        """Live KV use while the stage runs and a server of it is up (after
        the servers stop, the last sample is history, not use)."""
        if not self.running or (self.servers and all(s.stopped for s in self.servers)):
            return None
        return self.kv_usage


@dataclass(frozen=True)
class RunSnapshot:
    run_id: str
    path: str
    driver_pid: int | None            # the launcher, when it is alive
    stages: Mapping[str, StageView]
    metrics: Mapping[tuple[str, str], Series]   # (split, key) -> series
    state_error: str | None
    version: int                      # bumps on every change: draw on change only

    def focus_stage(self) -> str:
        """The stage a user opening the panel wants to see: the running one,
        else the first that failed or was cancelled, else the last that ran
        (a finished run's outcome), else the first."""
        for want in ((Status.RUNNING,), (Status.FAILED, Status.CANCELLED)):
            for name, st in self.stages.items():
                if st.status in want:
                    return name
        ran = [name for name, st in self.stages.items() if st.attempt]
        return ran[-1] if ran else STAGE_NAMES[0]

    def running_stages(self) -> list[str]:
        return [name for name, st in self.stages.items() if st.running]

    def devices_by_gpu(self) -> dict[int, str]:
        """GPU index -> the running stage that was given it (NVML's process
        list is empty in many containers; the assignment is what we know)."""
        held = {}
        for name, st in self.stages.items():
            if st.running:
                for d in st.devices:
                    held[d] = name
                for d in (st.online or {}).get("server_devices") or []:
                    held[d] = f"{name}:vLLM"   # online training's servers
        return held

    def failed_for_disk(self) -> bool:
        """Whether a failed stage stopped because the disk filled: it said so
        (its error has disk_full), or it could say nothing and (almost)
        nothing is free on the run's disk."""
        from pipeline.run.diskspace import NEARLY_FULL, free_bytes
        for st in self.stages.values():
            if st.status != Status.FAILED:
                continue
            if st.last_error is not None:
                if st.last_error.get("disk_full"):
                    return True
            elif free_bytes(self.path) < NEARLY_FULL:
                return True
        return False

    def outcome(self) -> dict:
        """What the pipeline made, as `status --json` gives it: the draft,
        its acceptance as vLLM measured it and train's estimate, the speedup."""
        train, ev = self.stages["train"].summary, self.stages["evaluate"].summary
        measured = ev.get("acceptance_length")
        return {"draft": (ev.get("checkpoint_path") if measured is not None else None)
                or train.get("checkpoint"),
                "acceptance_length": measured,
                "acceptance_estimate": train.get("acceptance_length"),
                "speedup": ev.get("speedup"),
                "training_stopped": train.get("stopped")}

    def acceptance_measured(self) -> float | None:
        """The last acceptance length the evaluate stage measured."""
        s = self.metrics.get(("eval", "acceptance_length"))
        return s.y[-1] if s is not None and len(s) else None

    def acceptance_estimate(self) -> float | None:
        """train's estimate: its summary's, else 1 + the latest validation
        full accuracies (while it trains)."""
        if self.stages["train"].summary.get("acceptance_length") is not None:
            return self.stages["train"].summary["acceptance_length"]
        own = self.metrics.get(("val", "acceptance_estimate"))   # the algorithm's (train's)
        if own is not None and len(own):
            return own.y[-1]
        accs = sorted(k for sp, k in self.metrics if sp == "val" and k.startswith("full_acc_"))
        if not accs:
            return None
        return 1.0 + sum(self.metrics[("val", k)].y[-1] for k in accs)


# -- the reader ------------------------------------------------------------------------

@dataclass
class _Stage:
    """What the reader keeps of one stage between polls."""
    attempts: list = field(default_factory=list)     # [number, started_at, status, seconds]
    progress: dict | None = None
    last_error: dict | None = None
    warnings: deque = field(default_factory=lambda: deque(maxlen=20))
    finished: dict | None = None
    summary: dict = field(default_factory=dict)
    servers: dict = field(default_factory=dict)      # name -> its last server event
    kv: dict = field(default_factory=dict)           # name -> its last kv_cache event
    kv_usage: dict | None = None
    online: dict | None = None
    backend: str | None = None
    loads: int = 0            # servers that came up, every attempt
    loading_s: float = 0.0    # and their start times, summed


class RunReader:
    """`on_event(stage, event)`, when set, sees each event as it is read (after
    the reader took it in): `run --wait` prints the new ones from it."""

    def __init__(self, run: RunDir, executor: Executor | None = None,
                 poll_bytes: int = 8 << 20):
        self.run = run
        self.on_event = None
        self.executor = executor
        self.poll_bytes = poll_bytes
        self._stages = {s: _Stage() for s in STAGE_NAMES}
        self._tails = {s: EventTail(run.events_path(s)) for s in STAGE_NAMES}
        self._metrics: dict[tuple[str, str], Series] = {}
        # series a snapshot holds: the reader copies one before it changes it
        # (copy on write), so a thread drawing a snapshot never sees one change
        self._shared: set[tuple[str, str]] = set()
        self._state: dict = {}
        self._state_error: str | None = None
        self._state_exc: RunDirError | None = None   # state.json unreadable: read_run raises it
        self._state_sig = None
        self._polls = 0
        self._unsafe: set[str] = set()   # stages whose events file is damaged or a link out
        self._jobs: dict[str, str] = {}  # a running stage's job, as its scheduler says
        self.version = 0

    def poll(self) -> bool:
        """Read what changed; True if anything did."""
        changed = self._read_state()
        for s, tail in self._tails.items():
            if s in self._unsafe:
                continue
            events = tail.poll(self.poll_bytes)
            self._take(s, events)
            changed |= bool(events)
        if changed:
            self.version += 1
        return changed

    def read_all(self) -> None:
        """Read every file to its end, `poll_bytes` at a time (the one-shot
        commands: memory stays the reader's, however long the files)."""
        self.poll()
        for s, tail in self._tails.items():
            while s not in self._unsafe and tail.offset < _size(tail.path):
                before = tail.offset
                self._take(s, tail.poll(self.poll_bytes))
                if tail.offset == before:
                    break
        self.version += 1

    def _take(self, stage: str, events: list[dict]) -> None:
        for ev in events:
            self._apply(stage, ev)
            if self.on_event is not None:
                self.on_event(stage, ev)

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
            ex = self.executor or for_run(self.run)
            self._state = observe(self.run, ex)
            self._state_error, self._state_exc = None, None
            self._jobs = {s: ex.describe(st) for s, st in self._state["stages"].items()
                          if st.get("slurm_job") and st.get("status") == Status.RUNNING}
        except RunDirError as e:
            self._state_error, self._state_exc = str(e), e
        self._check_events()
        return True

    def _check_events(self) -> None:
        """An events file that is a folder, or a link out of the run (on a
        shared run: another user's file), is not read; the snapshot says why."""
        self._unsafe.clear()
        for s in STAGE_NAMES:
            try:
                self.run.readable(self.run.events_path(s), "an events file")
            except RunDirError as e:
                self._unsafe.add(s)
                self._state_error = self._state_error or str(e)

    def _apply(self, stage: str, ev: dict) -> None:
        info, t = self._stages[stage], ev.get("type")
        if t == EventType.PROGRESS:
            info.progress = ev
        elif t == EventType.METRIC:
            self._add_metric(ev)
        elif t == EventType.ERROR:
            info.last_error = ev
        elif t == EventType.WARNING:
            info.warnings.append(ev)
        elif t == EventType.STAGE_STARTED:
            self._started(info, ev)
        elif t == EventType.STAGE_FINISHED:
            self._finished(info, ev)
        elif t == EventType.KV_CACHE:
            name = str(ev.get("server", "engine"))
            info.kv.pop(name, None)   # the newest last
            info.kv[name] = ev
        elif t == EventType.KV_USAGE:
            info.kv_usage = ev
        elif t == EventType.ONLINE:
            info.online = ev
        elif t == EventType.BACKEND:
            info.backend = ev.get("backend")
        elif t == EventType.SERVER:
            from pipeline.vllm.startup import READY
            key = str(ev.get("server"))
            before = info.servers.get(key)
            if ev.get("phase") == READY and (before is None or before.get("phase") != READY):
                info.loads += 1   # (a server's ready may be said again while another starts)
                info.loading_s += float(ev.get("elapsed_s") or 0.0)
            info.servers[key] = ev

    def _add_metric(self, ev: dict) -> None:
        split, step = ev.get("split", "train"), ev.get("step")
        if step is None:
            loss = self._metrics.get((split, "loss"))
            step = loss.added if loss is not None else 0
        for k, v in (ev.get("values") or {}).items():
            if isinstance(v, (int, float)):
                key = (split, k)
                if key in self._shared:
                    self._shared.discard(key)
                    self._metrics[key] = self._metrics[key].copy()
                series = self._metrics.get(key)
                if series is None:   # (not setdefault: that builds a Series per point)
                    series = self._metrics[key] = Series()
                series.add(step, float(v))

    @staticmethod
    def _started(info: _Stage, ev: dict) -> None:
        """A new attempt: what the last one showed goes (its time stays). An
        attempt still open had no stage_finished: it was killed."""
        if info.attempts and info.attempts[-1][2] == Status.RUNNING:
            info.attempts[-1][2] = "killed"
        info.attempts.append([ev.get("attempt") or len(info.attempts) + 1,
                              ev.get("t") or 0.0, Status.RUNNING, None])
        del info.attempts[:-50]   # bounded: a stage re-run all day keeps its last 50
        info.finished = info.last_error = info.progress = info.kv_usage = None
        info.summary = {}
        info.servers.clear()
        info.kv.clear()
        info.backend = None

    @staticmethod
    def _finished(info: _Stage, ev: dict) -> None:
        info.finished = ev
        info.summary = ev.get("summary") or {}
        if info.attempts and info.attempts[-1][2] == Status.RUNNING:
            info.attempts[-1][2:] = [ev.get("status"), ev.get("duration_s")]

    # -- the snapshot --------------------------------------------------------------------
    def driver_pid(self) -> int | None:
        """The launcher's pid while it is alive (`run --wait` asks this every
        0.3 s: no snapshot, which would have the reader copy its series)."""
        d = self._state.get("driver") or {}
        return d.get("pid") if self._state and driver_alive(self._state) else None

    def snapshot(self) -> RunSnapshot:
        stages = {s: self._stage_view(s) for s in STAGE_NAMES}
        return RunSnapshot(
            run_id=self.run.id, path=str(self.run.path), driver_pid=self.driver_pid(),
            stages=MappingProxyType(stages), metrics=self._hand_out_metrics(),
            state_error=self._state_error, version=self.version)

    def _hand_out_metrics(self) -> Mapping[tuple[str, str], Series]:
        """The series as they are now, for a snapshot: the reader changes none
        of them again (it copies one first), and the dict is the snapshot's own."""
        self._shared = set(self._metrics)
        return MappingProxyType(dict(self._metrics))

    def _stage_view(self, name: str) -> StageView:
        st = (self._state.get("stages") or {}).get(name) or {}
        info = self._stages[name]
        attempts = tuple(Attempt(n, t0, status, secs) for n, t0, status, secs in info.attempts)
        return StageView(
            name=name, status=st.get("status", Status.PENDING), attempt=st.get("attempt", 0),
            attempts=attempts,
            earlier_s=_earlier_s(attempts, st.get("attempt") or 0),
            exit_code=st.get("exit_code"), signal=st.get("signal"), pid=st.get("pid"),
            devices=tuple(st.get("devices") or ()), reason=st.get("reason"),
            slurm_job=st.get("slurm_job"), job=self._jobs.get(name, ""),
            progress=_progress(info.progress),
            servers=tuple(_server(k, info.servers[k], info.kv.get(k))
                          for k in sorted(info.servers)),
            kv_reports=MappingProxyType(dict(info.kv)),
            kv_usage=info.kv_usage, online=info.online, backend=info.backend,
            target_loads=info.loads, loading_s=info.loading_s,
            last_error=info.last_error, warnings=tuple(info.warnings),
            summary=MappingProxyType(info.summary), finished=info.finished,
            state=MappingProxyType(st))


def _size(path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _earlier_s(attempts: tuple[Attempt, ...], current: int) -> float:
    """The attempts before the current one that led to it: those since the
    last success (a forced re-run starts the count over), the current one
    (started or still queued) left out."""
    earlier = [a for a in attempts if a.number != current]
    done = [i for i, a in enumerate(earlier) if a.status == Status.SUCCEEDED]
    return sum(a.seconds or 0.0 for a in earlier[done[-1] + 1 if done else 0:])


def _progress(ev: dict | None) -> Progress | None:
    if not ev:
        return None
    return Progress(done=ev.get("done") or 0, total=ev.get("total"), unit=ev.get("unit", ""),
                    epoch=ev.get("epoch"), eta_s=ev.get("eta_s"), event=MappingProxyType(ev))


def _server(name: str, ev: dict, kv: dict | None) -> ServerView:
    return ServerView(name=name, label=ev.get("label", "vLLM server"), phase=ev.get("phase", ""),
                      elapsed_s=ev.get("elapsed_s"), stalled_s=ev.get("stalled_s"),
                      last_line=ev.get("last_line", ""), kv_cache=kv,
                      event=MappingProxyType(ev))


def read_run(run: RunDir, executor: Executor | None = None) -> RunSnapshot:
    """The run as it is now (`status`, the end of `run --wait`). A state.json
    that cannot be read raises its RunDirError (the panel shows it instead)."""
    reader = RunReader(run, executor)
    reader.read_all()
    if reader._state_exc is not None:
        raise reader._state_exc
    return reader.snapshot()
