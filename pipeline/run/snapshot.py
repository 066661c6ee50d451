"""One typed picture of a run: what `status`, `status --json`, `run --wait`
and the panel all show, read from the run directory and nothing else.

`RunReader` reads incrementally, as the panel needs: state.json when it
changes (through `reconcile.observe`, which never writes), each stage's
events.jsonl tailed by byte offset and folded (pipeline.run.stage_fold);
memory stays bounded however long it runs (metric series keep min/max per
bucket, warnings keep their newest). A long run is read from its read model's
checkpoint (pipeline.run.read_checkpoint) and the events after it: what is
shown costs what is shown, not the history.
`RunReader.snapshot()` hands out a `RunSnapshot` of frozen values; `read_run`
is the one-shot reader the commands use (the same reader, polled once over
every file). Before this module the panel, `status` and `run --wait` each
tailed the files and indexed state.json themselves, and disagreed: the KV tab
showed extract's cache whatever stage was selected, `status --json` had no
outcome, and a stage's time counted its last attempt only.

Reading only: nothing here writes, signals or removes (tests/unit/test_shape.py
keeps it so); liveness comes from the executor's read-only checks.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from pipeline.run import read_checkpoint, summaries
from pipeline.run.events import SERVER_STOPPED, EventTail
from pipeline.run.executor import Executor, driver_alive, for_run
from pipeline.run.reconcile import observe
from pipeline.run.rundir import RunDir, RunDirError, Status
from pipeline.run.series import Series
from pipeline.run.stage_fold import StageFold
from pipeline.run.summaries import Summary
from pipeline.stage_graph import STAGE_NAMES

_EMPTY: Mapping = MappingProxyType({})


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
        return self.phase == SERVER_STOPPED


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
    summary: Summary                  # this attempt's stage_finished summary (empty before it)
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
        measured = ev.acceptance_length
        return {"draft": (ev.checkpoint_path if measured is not None else None)
                or train.checkpoint,
                "acceptance_length": measured,
                "acceptance_estimate": train.acceptance_length,   # (train's is the estimate)
                "speedup": ev.speedup,
                "training_stopped": train.stopped}

    def acceptance_measured(self) -> float | None:
        """The last acceptance length the evaluate stage measured."""
        s = self.metrics.get(("eval", "acceptance_length"))
        return s.last_y if s is not None and s.added else None

    def acceptance_estimate(self) -> float | None:
        """train's estimate: its summary's, else 1 + the latest validation
        full accuracies (while it trains)."""
        if self.stages["train"].summary.acceptance_length is not None:
            return self.stages["train"].summary.acceptance_length
        own = self.metrics.get(("val", "acceptance_estimate"))   # the algorithm's (train's)
        if own is not None and own.added:
            return own.last_y
        accs = sorted(k for sp, k in self.metrics if sp == "val" and k.startswith("full_acc_"))
        if not accs:
            return None
        return 1.0 + sum(self.metrics[("val", k)].last_y for k in accs)


# -- the reader ------------------------------------------------------------------------

class RunReader:
    """`on_event(stage, event)`, when set, sees each event as it is read (after
    the reader took it in): `run --wait` prints the new ones from it."""

    def __init__(self, run: RunDir, executor: Executor | None = None,
                 poll_bytes: int = 8 << 20):
        self.run = run
        self.on_event = None
        self.executor = executor
        self.poll_bytes = poll_bytes
        self._folds = {s: StageFold() for s in STAGE_NAMES}
        self._tails = {s: EventTail(run.events_path(s)) for s in STAGE_NAMES}
        self._started_from_checkpoints = False
        self._state: dict = {}
        self._state_error: str | None = None
        self._state_exc: RunDirError | None = None   # state.json unreadable: read_run raises it
        self._state_sig = None
        self._polls = 0
        self._unsafe: set[str] = set()   # stages whose events file is damaged or a link out
        self._jobs: dict[str, str] = {}  # a running stage's job, as its scheduler says
        # each stage's typed summary, with the stage_finished event it was read from:
        # read once per event, not at every refresh
        self._summaries: dict[str, tuple[dict | None, Summary]] = {}
        self.version = 0

    def poll(self) -> bool:
        """Read what changed; True if anything did."""
        changed = self._read_state()
        if not self._started_from_checkpoints:
            self._started_from_checkpoints = True
            changed |= self._start_from_checkpoints()
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

    def _start_from_checkpoints(self) -> bool:
        """Each stage's saved fold and the offset it covers, where one can be
        trusted (read_checkpoint.load; a stage whose events file is damaged
        is not read at all). Only before the first event is read: `on_event`
        then sees the events after the checkpoint, not the history."""
        found = False
        for s in STAGE_NAMES:
            got = None if s in self._unsafe else read_checkpoint.load(self.run, s)
            if got is not None:
                self._folds[s], self._tails[s] = got
                found = True
        return found

    def _take(self, stage: str, events: list[dict]) -> None:
        fold = self._folds[stage]
        for ev in events:
            fold.apply(ev)
            if self.on_event is not None:
                self.on_event(stage, ev)

    def _apply(self, stage: str, ev: dict) -> None:
        """One event into a stage's fold (tests feed events one by one)."""
        self._folds[stage].apply(ev)

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
        of them again (a fold copies one first), and the dict is the
        snapshot's own. A metric two stages log is one curve, in stage order."""
        out: dict[tuple[str, str], Series] = {}
        for fold in self._folds.values():
            fold.shared = set(fold.metrics)
            for key, series in fold.metrics.items():
                out[key] = out[key].extended(series) if key in out else series
        return MappingProxyType(out)

    def _stage_view(self, name: str) -> StageView:
        st = (self._state.get("stages") or {}).get(name) or {}
        info = self._folds[name]
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
            summary=self._summary(name, info), finished=info.finished,
            state=MappingProxyType(st))

    def _summary(self, name: str, info: StageFold) -> Summary:
        """The stage's summary, typed (pipeline.run.summaries.read) once per
        stage_finished event."""
        fin, typed = self._summaries.get(name, (None, None))
        if typed is None or fin is not info.finished:
            typed = summaries.read(name, info.summary)
            self._summaries[name] = (info.finished, typed)
        return typed


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
