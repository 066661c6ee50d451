"""The Textual panel: stages, logs, GPUs, KV cache and training curves.

It reads only the run directory and NVML. Files are polled in a worker
thread (woken by inotify when a file changes), telemetry is sampled in
another, and the UI thread only draws — so the panel can be closed, lose its
SSH connection or be opened twice without touching a running stage.
"""

from __future__ import annotations

import functools
import threading
import time
from pathlib import Path

from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.css.query import NoMatches
from textual.widgets import Footer, Input, TabbedContent, TabPane

from app.run_view import RunView
from app.screens.confirm import ConfirmScreen
from app.screens.doctor import DoctorScreen
from app.screens.help import HelpScreen
from pipeline import control, fmt
from pipeline.cluster.node_telemetry import NodeWatch
from pipeline.config import ConfigError
from pipeline.run import driver
from pipeline.run.events import ChangeWaiter
from pipeline.run.rundir import RunDir, RunDirError, Status, list_runs
from pipeline.stage_graph import STAGE_NAMES
from pipeline.telemetry import Telemetry
from widgets.gpu_table import GpuTable
from widgets.kv_panel import KVCachePanel
from widgets.log_view import LogView
from widgets.loss_chart import LossChart
from widgets.online_view import online_text
from widgets.quiet import QuietStatic
from widgets.stage_table import StageTable


def drawing_callback(fn):
    """Timers and thread callbacks can still fire while Textual tears the
    screen down at exit (seen once in CI: the log poll found no LogView).
    Their widgets exist for the app's whole life otherwise, so a missing
    one means there is nothing left to draw."""
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        except NoMatches:
            return None
    return wrapper


class PanelApp(App):
    UI_INTERVAL = 1.0   # seconds between redraws
    MIN_POLL = 0.2      # seconds between reads of the run's files
    LOG_INTERVAL = 1.0  # seconds between log view updates
    CSS_PATH = Path(__file__).with_name("panel.tcss")
    TITLE = "eagle-panel"
    BINDINGS = [
        Binding("r", "run", "Run/resume"),
        Binding("c", "cancel", "Cancel"),
        Binding("F", "force", "Force re-run"),
        Binding("1", "tab('logs')", "Logs", show=False),
        Binding("2", "tab('gpus')", "GPUs", show=False),
        Binding("3", "tab('kv')", "KV", show=False),
        Binding("4", "tab('training')", "Train", show=False),
        Binding("z", "fullscreen", "Full log"),
        Binding("f", "follow", "Follow", show=False),
        Binding("slash", "search", "Search", show=False),
        Binding("n", "next_match", "Next", show=False),
        Binding("e", "chart('smooth')", "EMA", show=False),
        Binding("o", "chart('log')", "Log scale", show=False),
        Binding("a", "chart('metric')", "Loss/acc", show=False),
        Binding("v", "chart('split')", "Train/val", show=False),
        Binding("d", "doctor", "Doctor", show=False),
        Binding("g", "node", "Node", show=False),
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
        self._gpus_drawn_at = -1e9
        self.model = RunView(run) if run else None
        self.lock = threading.Lock()
        self.telemetry = telemetry or Telemetry(simulate_gpus, disk_path=(run.path if run else runs_dir))
        # Cluster nodes' GPUs, from the files their jobs write (no NVML here for them).
        self.nodes = NodeWatch(run.path) if run else None
        self.clock = clock
        self.snapshot = None
        self._statuses: dict[str, str] = {}
        self._all_done: bool | None = None   # unknown until the first look
        self._log_stage = None
        self._stop = threading.Event()
        self._dirty = False  # set by the file watcher, drawn by _tick
        self._backend_cache: tuple[int | None, str | None] = (None, None)

    # -- layout -----------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield QuietStatic(id="title")
        yield StageTable(id="stages")
        yield QuietStatic(id="detail")
        with TabbedContent(initial="logs", id="tabs"):
            with TabPane("1 Logs", id="logs"):
                yield LogView(id="log")
                yield Input(placeholder="search the log (Enter: find, Esc: close)", id="search")
            with TabPane("2 GPUs", id="gpus"):
                yield GpuTable(id="gpu")
            with TabPane("3 KV cache", id="kv"):
                yield KVCachePanel(id="kvpanel")
            with TabPane("4 Training", id="training"):
                with Vertical():
                    yield QuietStatic(id="train-info")
                    yield LossChart(id="chart")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#search").display = False
        self.query_one(StageTable).focus()
        self._draw_title()
        if self.model is not None:
            with self.lock:
                self.model.poll()
                self.query_one(StageTable).select(self.model.focus_stage())
            self._apply_model()
            self._select_log(self.query_one(StageTable).selected_stage)
        else:
            cfg = self.config_path.name if self.config_path else "config.toml"
            self.query_one("#detail", QuietStatic).set(Text(
                f"No runs yet. Press r to start one from {cfg}.", style="bold"))
        self._watch_files()
        self._sample_telemetry()
        self.set_interval(self.LOG_INTERVAL, self._poll_log)
        self.set_interval(self.UI_INTERVAL, self._tick)

    # -- workers ------------------------------------------------------------------
    @work(thread=True, exclusive=True, group="files")
    def _watch_files(self) -> None:
        """Poll the run's files; wake at once when inotify sees a change."""
        waiter = None
        while not self._stop.is_set():
            if self.model is None:
                self._stop.wait(0.5)
                continue
            if waiter is None:
                waiter = ChangeWaiter([self.rundir.path]
                                      + [self.rundir.stage_dir(s) for s in STAGE_NAMES])
            with self.lock:
                if self.model.poll():
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

    # -- drawing -------------------------------------------------------------------
    def _draw_title(self) -> None:
        t = Text("eagle-panel ", style="bold")
        if self.rundir is None:
            t.append("no run", style="dim")
        else:
            t.append(f"run {self.rundir.id}")
            pid = self.model.driver_pid() if self.model else None
            t.append(f"  launcher pid {pid}" if pid else "  idle (r runs/resumes)",
                     style="green" if pid else "dim")
        kind = self.telemetry.kind
        t.append(f"  GPUs: {'SIMULATED' if kind == 'simulated' else kind}",
                 style="magenta" if kind == "simulated" else "dim")
        self.query_one("#title", QuietStatic).set(t)

    def _apply_model(self) -> None:
        if self.model is None:
            return
        with self.lock:
            table = self.query_one(StageTable)
            table.refresh_from(self.model, self.clock())
            self._notify_transitions()
            self._draw_detail()
            self._draw_title()
            self._draw_active_tab()

    def _draw_active_tab(self, switched: bool = False) -> None:
        """Hidden tabs are not drawn; switching to one draws it."""
        tab = self.query_one(TabbedContent).active
        if tab == "training" and self.model is not None:
            self._draw_training(force=switched)
        elif tab == "kv" and self.model is not None:
            self.query_one(KVCachePanel).update_from(self.model, self._backend())
        elif tab == "gpus" and self.snapshot is not None:
            self._draw_gpus(force=switched)

    def on_tabbed_content_tab_activated(self, _event) -> None:
        with self.lock:
            self._draw_active_tab(switched=True)

    @drawing_callback
    def _apply_snapshot(self, snap) -> None:
        self.snapshot = snap
        with self.lock:
            self.query_one(GpuTable).record(snap)
            if self.query_one(TabbedContent).active == "gpus":
                self._draw_gpus()

    def _draw_gpus(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._gpus_drawn_at < self.refresh_s:
            return  # the history keeps every sample; the rows wait
        self._gpus_drawn_at = now
        holders = self.model.devices_by_gpu() if self.model else {}
        forecast = self.model.stages["extract"].progress if self.model else None
        running = frozenset(self.model.running_stages()) if self.model else frozenset()
        self.query_one(GpuTable).update_from(self.snapshot, holders, forecast, running)

    def action_node(self) -> None:
        """g on the GPU tab: one cluster node's GPUs, the next, then all nodes."""
        if self.query_one(TabbedContent).active == "gpus" and self.snapshot is not None:
            with self.lock:
                self.query_one(GpuTable).drill_next()

    def _draw_detail(self) -> None:
        stage = self.query_one(StageTable).selected_stage
        info = self.model.stages[stage]
        st = info.state
        t = Text(f"{stage}: ", style="bold")
        if self.model.state_error:
            t.append(self.model.state_error, style="bold red")
        elif st.get("status") == Status.FAILED:
            err = info.last_error or {}
            t.append(err.get("message") or f"failed ({fmt.exit_text(st)})", style="bold red")
            if err.get("hint"):
                t.append(f"\n  hint: {err['hint']}", style="yellow")
            if st.get("reason"):
                t.append(f"\n  {st['reason']}", style="dim")
        elif info.warnings:
            t.append(info.warnings[-1].get("message", ""), style="yellow")
        elif info.finished:
            summary = info.finished.get("summary") or {}
            t.append(", ".join(f"{k}={v}" for k, v in summary.items()
                               if isinstance(v, (int, float)) and not isinstance(v, bool)) or
                     info.finished.get("status", ""), style="dim")
        else:
            t.append(st.get("status", Status.PENDING), style="dim")
        self.query_one("#detail", QuietStatic).set(t)

    def _draw_training(self, force: bool = False) -> None:
        m = self.model
        prog = m.stages["train"].progress
        t = Text()
        if prog:
            t.append(f"step {prog.get('done')}/{prog.get('total')}  ")
            if prog.get("epoch") is not None:
                t.append(f"epoch {prog['epoch']}  ")
            if prog.get("eta_s") is not None and m.stages["train"].state.get("status") == Status.RUNNING:
                t.append(f"ETA {fmt.duration(prog['eta_s'])}  ")
        lr = m.metrics.get(("train", "lr")) or m.metrics.get(("train", "lr_AdamW"))
        if lr is not None and len(lr):
            t.append(f"lr {lr.y[-1]:.2e}  ")
        acc = m.acceptance_estimate()
        measured = m.acceptance_measured()
        if measured is not None:
            t.append(f"acceptance length {measured:.2f} (vLLM)", style="bold green")
            if acc is not None:
                t.append(f", est. {acc:.2f}")
        elif acc is not None:
            t.append(f"acceptance length (est.) {acc:.2f}", style="bold green")
        if not t.plain:
            t.append("no training yet", style="dim")
        if m.stages["train"].online:
            t.append("\n")
            t.append_text(online_text(m.stages["train"].online))
        self.query_one("#train-info", QuietStatic).set(t)
        self.query_one(LossChart).update_from(m, force)

    def _backend(self) -> str | None:
        """The backend extract runs: what the stage resolved (its `backend`
        event: "auto" may become hf), else the run's frozen config when it
        names one; re-read only when that config changes."""
        said = self.model.stages["extract"].backend
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

    def _notify_transitions(self) -> None:
        for s, info in self.model.stages.items():
            status = info.state.get("status")
            before = self._statuses.get(s)
            self._statuses[s] = status
            if before is None or before == status:
                continue
            if status == Status.FAILED:
                self.bell()
                self.notify(f"{s} failed ({fmt.exit_text(info.state)})", severity="error",
                            timeout=10)
        # A finished pipeline rings once, when the statuses turn all done (not
        # when the launcher is seen to end: a quick run can start and end
        # between two redraws).
        all_done = all(self.model.stages[s].state.get("status") in driver.DONE
                       for s in STAGE_NAMES)
        if all_done and self._all_done is False:
            self.bell()
            self.notify("pipeline finished: all stages succeeded", timeout=10)
        self._all_done = all_done

    @drawing_callback
    def _tick(self) -> None:
        """The one redraw timer: at most once per UI_INTERVAL however fast a
        stage writes (what reaches the terminal over SSH is what users feel);
        durations advance even when no file changes."""
        if self.model is None:
            return
        if self._dirty:
            self._dirty = False
            self._apply_model()
        else:
            with self.lock:
                self.query_one(StageTable).refresh_from(self.model, self.clock())

    def _select_log(self, stage: str) -> None:
        if self.rundir is None or stage == self._log_stage:
            return
        self._log_stage = stage
        self.query_one(LogView).watch_file(self.rundir.log_path(stage))

    @drawing_callback
    def _poll_log(self) -> None:
        self.query_one(LogView).poll()

    def on_stage_table_selected(self, event: StageTable.Selected) -> None:
        if self.model is None:
            return
        stage = event.stage
        self._select_log(stage)
        with self.lock:
            self._draw_detail()

    # -- actions -------------------------------------------------------------------
    def action_tab(self, tab: str) -> None:
        self.query_one(TabbedContent).active = tab

    def action_fullscreen(self) -> None:
        self.screen.toggle_class("fullscreen")
        self.query_one(TabbedContent).active = "logs"

    def action_follow(self) -> None:
        log = self.query_one(LogView)
        log.set_follow(not log.follow)
        self.notify(f"follow {'on' if log.follow else 'off'}", timeout=2)

    def action_search(self) -> None:
        self.query_one(TabbedContent).active = "logs"
        box = self.query_one("#search", Input)
        box.display = True
        box.focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        found = self.query_one(LogView).find(event.value)
        if not found and event.value:
            self.notify(f"not found: {event.value}", severity="warning", timeout=3)
        event.input.display = False
        self.query_one(LogView).focus()

    def on_key(self, event) -> None:
        box = self.query_one("#search", Input)
        if event.key == "escape" and box.display:
            box.display = False
            self.query_one(StageTable).focus()

    def action_next_match(self) -> None:
        log = self.query_one(LogView)
        if log.search:
            log.find(log.search)

    def action_chart(self, what: str) -> None:
        chart = self.query_one(LossChart)
        if what == "smooth":
            chart.smooth = not chart.smooth
        elif what == "log":
            chart.log = not chart.log
        elif what == "metric":
            chart.metric = chart.METRICS[(chart.METRICS.index(chart.metric) + 1)
                                         % len(chart.METRICS)]
        elif what == "split":
            chart.split = "val" if chart.split == "train" else "train"
        self.query_one(TabbedContent).active = "training"

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_doctor(self) -> None:
        def load():
            if self.rundir is not None:
                return driver.load_run_config(self.rundir)
            return control.load_config(self.config_path and str(self.config_path),
                                       gpu_check=False)
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
        self.rundir = run
        self.model = RunView(run)
        self.telemetry.disk_path = run.path
        self.nodes = NodeWatch(run.path)
        with self.lock:
            self.model.poll()
        self._apply_model()
        self._select_log(self.query_one(StageTable).selected_stage)

    def action_force(self) -> None:
        if self.rundir is None:
            return
        stage = self.query_one(StageTable).selected_stage

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
        if self.model is None:
            return
        running = self.model.running_stage()
        if running is None and self.model.driver_pid() is None:
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
        else:
            sent = ", ".join(s for r in results for s in r.signals) or "nothing needed"
            self.call_from_thread(self.notify, f"cancelled ({sent})", timeout=5)


def run_panel(args) -> int:
    runs_dir = control.runs_dir(args.config, args.runs_dir)
    try:
        run = control.resolve_run(runs_dir, args.run) if args.run else \
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
