"""The Textual panel: stages, logs, GPUs, KV cache and training curves.

It reads only the run directory and NVML. Files are polled in a worker
thread (woken by inotify when a file changes), telemetry is sampled in
another, and the UI thread only draws — so the panel can be closed, lose its
SSH connection or be opened twice without touching a running stage.

The app holds what was read (`view`, the run's RunSnapshot from a RunReader,
and `snapshot`, the last telemetry sample) and acts on the run through
pipeline.control when the main screen asks (r, c, F, d); the main screen
(app/screens/main.py) draws what the app sends and owns the keys that change
only the view. They talk in messages only (app/messages.py).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from textual import work
from textual.app import App
from textual.binding import Binding

from app.messages import (
    CancelRequested,
    CompareRequested,
    DoctorRequested,
    ForceRequested,
    RunRead,
    RunRequested,
    ScreenReady,
    TelemetryRead,
    Transitions,
)
from app.screens.compare import CompareScreen
from app.screens.confirm import ConfirmScreen
from app.screens.doctor import DoctorScreen
from app.screens.help import HelpScreen
from app.screens.main import MainScreen, all_done
from pipeline import control, fmt
from pipeline.cluster.node_telemetry import NodeWatch
from pipeline.config import ConfigError
from pipeline.drive import driver
from pipeline.run.events import ChangeWaiter
from pipeline.run.rundir import RunDir, RunDirError, Status, list_runs
from pipeline.run.snapshot import RunReader
from pipeline.stage_graph import STAGE_NAMES
from pipeline.telemetry import Telemetry


class PanelApp(App):
    UI_INTERVAL = 1.0   # seconds between redraws
    MIN_POLL = 0.2      # seconds between reads of the run's files
    LOG_INTERVAL = 1.0  # seconds between log view updates
    CSS_PATH = Path(__file__).with_name("panel.tcss")
    TITLE = "eagle-panel"
    BINDINGS = [   # r, c, F and d: the main screen's keys, which ask the app by message
        Binding("question_mark", "help", "Help"),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(self, run: RunDir | None, config_path: Path | None = None,
                 simulate_gpus: int = 0, interval: float = 1.0, refresh: float = 2.0,
                 runs_dir: Path | None = None,
                 telemetry: Telemetry | None = None, clock=time.time):
        super().__init__()
        self.rundir = run
        self.config_path = config_path
        self.runs_dir = runs_dir
        self.interval = max(Telemetry.MIN_INTERVAL, interval)
        # GPU rows are redrawn every refresh_s (samples still land in the
        # history every `interval`): 8 GPUs of changing numbers each second
        # are most of what a slow SSH link would carry.
        self.refresh_s = max(self.interval, refresh)
        self.reader = RunReader(run) if run else None
        self.view = None   # the reader's last RunSnapshot (replaced whole, never changed)
        self.lock = threading.Lock()   # the reader: the file worker's, swapped by _attach
        self.telemetry = telemetry or Telemetry(simulate_gpus, disk_path=(run.path if run else runs_dir))
        # Cluster nodes' GPUs, from the files their jobs write (no NVML here for them).
        self.nodes = NodeWatch(run.path) if run else None
        self.clock = clock
        self.snapshot = None
        self._statuses: dict[str, str] = {}
        self._all_done: bool | None = None   # unknown until the first look
        self._stop = threading.Event()
        self._dirty = False  # set by the file watcher, drawn by _tick
        self._backend_cache: tuple[int | None, str | None] = (None, None)

    def get_default_screen(self) -> MainScreen:
        return MainScreen(run_id=self.rundir.id if self.rundir else None,
                          config_name=self.config_path.name if self.config_path else "config.toml",
                          gpu_kind=self.telemetry.kind, refresh_s=self.refresh_s,
                          log_interval=self.LOG_INTERVAL, ui_interval=self.UI_INTERVAL,
                          clock=self.clock)

    @property
    def main(self) -> MainScreen:
        """The main screen, also while a modal screen is on top of it (the
        app only posts messages to it; tests read it)."""
        return self.screen_stack[0]

    def on_mount(self) -> None:
        self._watch_files()
        self._sample_telemetry()
        self.set_interval(self.UI_INTERVAL, self._tick)

    # -- workers ------------------------------------------------------------------
    @work(thread=True, exclusive=True, group="files")
    def _watch_files(self) -> None:
        """Poll the run's files; wake at once when inotify sees a change."""
        waiter = None
        while not self._stop.is_set():
            if self.reader is None:
                self._stop.wait(0.5)
                continue
            if waiter is None:
                waiter = ChangeWaiter([self.rundir.path]
                                      + [self.rundir.stage_dir(s) for s in STAGE_NAMES])
            with self.lock:
                if self._read():
                    self._dirty = True
            waiter.wait(0.5)
            self._stop.wait(self.MIN_POLL)  # coalesce bursts of file changes
        if waiter:
            waiter.close()

    @work(thread=True, exclusive=True, group="telemetry")
    def _sample_telemetry(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            snap = self.telemetry.sample()
            watch = self.nodes
            if watch is not None:
                snap.nodes = watch.read()
            self.call_from_thread(self._apply_snapshot, snap)
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - t0)))

    def on_unmount(self) -> None:
        self._stop.set()
        self.telemetry.close()

    # -- what was read -> the screen --------------------------------------------------
    def _read(self) -> bool:
        """Poll the run's files (the caller holds the lock); True if anything
        changed. The snapshot is taken when it is sent, at most once a tick:
        each one makes the reader copy the metric series it changes next."""
        return self.reader.poll()

    def on_screen_ready(self, _message: ScreenReady) -> None:
        """The main screen is up: read the run, have it select the stage a
        user opening the panel wants to see."""
        if self.reader is None:
            return
        with self.lock:
            self._read()
        self._send(first=True)

    def _send(self, first: bool = False) -> None:
        """A new snapshot to the main screen, with what changed since the last."""
        with self.lock:
            view = self.view = self.reader.snapshot()
        changes = self._transitions(view, view.focus_stage() if first else None)
        self.main.post_message(RunRead(view, self.rundir, self.extract_backend(view), changes))

    def _apply_snapshot(self, snap) -> None:
        if self._stop.is_set() or not self.screen_stack:
            return   # a sample in flight as the app exits: no screen left to tell
        self.snapshot = snap
        self.main.post_message(TelemetryRead(snap))

    def _tick(self) -> None:
        """The one redraw timer: at most once per UI_INTERVAL however fast a
        stage writes (what reaches the terminal over SSH is what users feel)."""
        if self.view is not None and self._dirty:   # (after the first look)
            self._dirty = False
            self._send()

    def extract_backend(self, view) -> str | None:
        """The backend extract runs: what the stage resolved (its `backend`
        event: "auto" may become hf), else the run's frozen config when it
        names one; re-read only when that config changes."""
        said = view.stages["extract"].backend
        if said:
            return said
        try:
            mtime = self.rundir.config_path.stat().st_mtime_ns
            if self._backend_cache[0] != mtime:
                backend = driver.load_run_config(self.rundir).stages.extract.backend
                self._backend_cache = (mtime, None if backend == "auto" else backend)
            return self._backend_cache[1]
        except Exception:  # noqa: BLE001 - shown as "no report yet"
            return None

    def _transitions(self, view, focus: str | None) -> Transitions:
        """Ring and say what ended badly; tell the screen what started and
        failed, which the selection follows (a start unless the user moved it
        in the last minute; a failure always, its error under the table)."""
        started, failed = [], []
        for s, info in view.stages.items():
            status = info.status
            before = self._statuses.get(s)
            self._statuses[s] = status
            if before is None or before == status:
                continue
            if status == Status.RUNNING:
                started.append(s)
            if status == Status.FAILED:
                failed.append(s)
                self.bell()
                self.notify(f"{s} failed ({fmt.exit_text(info.state)})", severity="error",
                            timeout=10)
        # A finished pipeline rings once, when the statuses turn all done (not
        # when the launcher is seen to end: a quick run can start and end
        # between two redraws).
        done = all_done(view)
        if done and self._all_done is False:
            self.bell()
            self.notify("pipeline finished: all stages succeeded", timeout=10)
        self._all_done = done
        return Transitions(tuple(started), tuple(failed), focus)

    # -- what the screen asks for -----------------------------------------------------
    def on_run_requested(self, _message: RunRequested) -> None:
        self.action_run()

    def on_cancel_requested(self, _message: CancelRequested) -> None:
        self.action_cancel()

    def on_force_requested(self, message: ForceRequested) -> None:
        self.force(message.stage)

    def on_doctor_requested(self, _message: DoctorRequested) -> None:
        self.action_doctor()

    def on_compare_requested(self, _message: CompareRequested) -> None:
        runs_dir = self.rundir.path.parent if self.rundir is not None else self.runs_dir
        if runs_dir is None:
            self.notify("no runs folder to compare", timeout=3)
            return
        self.push_screen(CompareScreen(runs_dir, self.rundir.id if self.rundir else None))

    # -- keys that act on the run ---------------------------------------------------
    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_doctor(self) -> None:
        def load():
            if self.rundir is not None:
                return driver.load_run_config(self.rundir)
            return control.load_config(self.config_path and str(self.config_path))
        self.push_screen(DoctorScreen(load))

    def action_run(self) -> None:
        try:
            if self.rundir is None:
                cfg = control.load_config(self.config_path and str(self.config_path))
                started = control.launch(cfg, busy_wait=1.0)
                self._attach(started.run)
            else:
                started = control.resume(self.rundir, busy_wait=1.0)
        except control.Busy:
            self.notify("the pipeline is already running", timeout=3)
            return
        except control.Refused as e:
            self.push_screen(DoctorScreen(findings=e.findings, heading=f"{e}; nothing was "
                                          "started. Fix the config, then press r again."))
            return
        except (ConfigError, RunDirError, control.Blocked) as e:
            self.notify(str(e), severity="error", timeout=15)
            return
        if started.nothing_to_do:
            self.notify(f"{self.rundir.id}: everything is up to date", timeout=4)
        else:
            self.notify(f"started {self.rundir.id}: stages that are not done run now", timeout=4)

    def _attach(self, run: RunDir) -> None:
        with self.lock:
            self.rundir = run
            self.reader, self.view = RunReader(run), None
            self.telemetry.disk_path = run.path
            self.nodes = NodeWatch(run.path)
            self._read()
        self._send()

    def force(self, stage: str) -> None:
        """Re-run `stage` from scratch, after a confirmation."""
        if self.rundir is None:
            return

        def go(yes: bool | None) -> None:
            if not yes:
                return
            try:
                control.start(self.rundir, only=stage, force=True, busy_wait=1.0)
            except control.Busy:
                self.notify("cancel the running pipeline first", severity="warning", timeout=4)
                return
            except control.Refused as e:
                self.push_screen(DoctorScreen(findings=e.findings, heading=str(e)))
                return
            except (control.Blocked, ConfigError, RunDirError) as e:
                self.notify(str(e), severity="warning", timeout=6)
                return
            self.notify(f"re-running {stage} from scratch", timeout=4)

        self.push_screen(ConfirmScreen(f"Re-run {stage} from scratch? Its outputs are deleted."), go)

    def action_cancel(self) -> None:
        if self.view is None:
            return
        running = (self.view.running_stages() or [None])[0]
        if running is None and self.view.driver_pid is None:
            self.notify("nothing is running", timeout=3)
            return

        def go(yes: bool | None) -> None:
            if yes:
                self._cancel_worker()

        self.push_screen(ConfirmScreen(
            f"Cancel the pipeline{f' (running: {running})' if running else ''}? "
            "SIGINT first (training saves a checkpoint), then SIGTERM, then SIGKILL."), go)

    @work(thread=True, exclusive=True, group="cancel")
    def _cancel_worker(self) -> None:
        self.call_from_thread(self.notify, "cancelling...", timeout=3)
        results = control.cancel(self.rundir)
        left = [f"{pid} {name}" for r in results for pid, name in r.survivors]
        if left:
            self.call_from_thread(self.notify, "could not stop: " + "; ".join(left),
                                  severity="error", timeout=20)
        elif any(r.stage is None for r in results):
            self.call_from_thread(self.notify, "cancelled before any stage started", timeout=5)
        else:
            sent = ", ".join(s for r in results for s in r.signals) or "nothing needed"
            self.call_from_thread(self.notify, f"cancelled ({sent})", timeout=5)


def run_panel(args) -> int:
    runs_dir = control.runs_dir(args.config, args.runs_dir)
    try:
        run = control.resolve_run(runs_dir, args.run) if args.run is not None else \
            (list_runs(runs_dir) or [None])[0]
    except RunDirError as e:
        print(f"eagle-panel: {e}")
        return 2
    cfg_path = Path(args.config) if args.config else None
    app = PanelApp(run, cfg_path, simulate_gpus=args.simulate_gpus,
                   interval=getattr(args, "interval", 1.0), refresh=getattr(args, "refresh", 2.0),
                   runs_dir=runs_dir)
    app.run()
    return 0
