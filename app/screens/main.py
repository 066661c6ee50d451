"""The panel's main screen: the stage table, the selected stage's detail and
the four tabs (logs, GPUs, KV cache, training). It draws what the app sends
it (app/messages.py: RunRead with the run's RunSnapshot, TelemetryRead with a
GPU sample) and posts a request when a key asks to act (r, c, F, d); it
reads none of the app's attributes. Every tab shows the selected stage where
a stage has its own (the KV cache of the selected stage's servers, the
Training tab as train's or evaluate's view) and handles the keys that change
only what is shown; the keys that act on the run (r, c, F) are the app's."""

from __future__ import annotations

import functools
import time

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.widgets import Footer, Input, TabbedContent, TabPane

from app.messages import (
    CancelRequested,
    CompareRequested,
    DoctorRequested,
    ForceRequested,
    RunRead,
    RunRequested,
    ScreenReady,
    TelemetryRead,
)
from pipeline import fmt
from pipeline.run.rundir import DONE, Status
from pipeline.run.summaries import EvaluateSummary, TrainSummary
from pipeline.stage_graph import STAGE_NAMES
from pipeline.vllm import startup
from widgets.category_bars import CategoryBars
from widgets.gpu_table import GpuTable
from widgets.kv_panel import KVCachePanel, KVReport
from widgets.log_view import LogView
from widgets.loss_chart import LossChart
from widgets.online_view import online_text
from widgets.quiet import QuietStatic
from widgets.stage_table import StageTable


def drawing_callback(fn):
    """Timers and thread callbacks can still fire while Textual tears the
    screen down at exit (seen once in CI: the log poll found no LogView).
    Their widgets exist for the screen's whole life otherwise, so a missing
    one means there is nothing left to draw."""
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        except NoMatches:
            return None
    return wrapper


class MainScreen(Screen):
    BINDINGS = [
        # the app acts on the run (asked by a message); first, so the footer reads r c F
        Binding("r", "request('run')", "Run/resume"),
        Binding("c", "request('cancel')", "Cancel"),
        Binding("F", "request('force')", "Force re-run"),
        Binding("d", "request('doctor')", "Doctor", show=False),
        Binding("C", "request('compare')", "Compare runs", show=False),
        Binding("1", "tab('logs')", "Logs", show=False),
        Binding("2", "tab('gpus')", "GPUs", show=False),
        Binding("3", "tab('kv')", "KV", show=False),
        Binding("4", "tab('training')", "Train", show=False),
        Binding("z", "fullscreen", "Full log"),
        Binding("f", "follow", "Follow", show=False),
        Binding("w", "wide_lines", "Whole lines", show=False),
        Binding("end", "log_end(True)", "Log end", show=False),
        Binding("home", "log_end(False)", "Log start", show=False),
        Binding("slash", "search", "Search", show=False),
        Binding("n", "next_match", "Next", show=False),
        Binding("e", "chart('smooth')", "EMA", show=False),
        Binding("o", "chart('log')", "Log scale", show=False),
        Binding("p", "chart('positions')", "Per position", show=False),
        Binding("a", "chart('metric')", "Loss/acc", show=False),
        Binding("v", "chart('split')", "Train/val", show=False),
        Binding("g", "node", "Node", show=False),
        Binding("l", "next_log", "Server log", show=False),
    ]

    def __init__(self, *, run_id: str | None = None, config_name: str = "config.toml",
                 gpu_kind: str = "nvml",
                 refresh_s: float = 2.0, log_interval: float = 1.0,
                 ui_interval: float = 1.0, clock=time.time):
        super().__init__()
        self.run_id, self.config_name = run_id, config_name
        self.gpu_kind, self.clock = gpu_kind, clock
        self.refresh_s, self.log_interval, self.ui_interval = refresh_s, log_interval, ui_interval
        self.view = None      # the last RunSnapshot the app sent (immutable)
        self.rundir = None
        self.backend = None   # the backend extract runs (for the KV tab)
        self.sample = None    # the last telemetry sample
        self._gpus_drawn_at = -1e9
        self._log_stage = None
        self._log_server: str | None = None   # None: the stage's own log
        self._user_moved_at = -1e9
        self._following: str | None = None
        self._training_owner: str | None = None   # whose view the Training tab shows
        self._train_metric: str | None = None     # train's family while evaluate's shows

    def compose(self) -> ComposeResult:
        yield QuietStatic(id="title")
        yield StageTable(id="stages")
        yield QuietStatic(id="detail")
        with TabbedContent(initial="logs", id="tabs"):
            with TabPane("1 Logs", id="logs"):
                yield LogView(id="log")
                yield QuietStatic(id="log-step")
                yield Input(placeholder="search the log (Enter: find, Esc: close)", id="search")
            with TabPane("2 GPUs", id="gpus"):
                yield GpuTable(id="gpu")
            with TabPane("3 KV cache", id="kv"):
                yield KVCachePanel(id="kvpanel")
            with TabPane("4 Training", id="training"):
                with Vertical():
                    yield QuietStatic(id="train-info")
                    with Horizontal(id="train-views"):
                        yield LossChart(id="chart")
                        yield CategoryBars(id="categories")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#search").display = False
        self.query_one(StageTable).focus()
        self.draw_title()
        self.query_one("#detail", QuietStatic).set(
            Text(f"reading run {self.run_id}...", style="dim") if self.run_id else
            Text(f"No runs yet. Press r to start one from {self.config_name}.", style="bold"))
        self.post_message(ScreenReady())
        self.set_interval(self.log_interval, self._poll_log)
        self.set_interval(self.ui_interval, self._tick)

    # -- what the app sends ------------------------------------------------------------
    def on_run_read(self, message: RunRead) -> None:
        """A new snapshot: follow what started or failed, draw."""
        attached = message.rundir != self.rundir
        self.view, self.rundir, self.backend = message.view, message.rundir, message.backend
        changes = message.changes
        if changes.focus:
            self.follow(changes.focus, always=True)
        for stage in changes.started:
            self.follow(stage)
        for stage in changes.failed:
            self.follow(stage, always=True)
        if attached:
            self._log_stage = None
            self.show_log(self.selected_stage)
        self.draw_run(self.clock())

    def on_telemetry_read(self, message: TelemetryRead) -> None:
        self.sample = message.sample
        self.query_one(GpuTable).record(message.sample)
        if self.query_one(TabbedContent).active == "gpus":
            self.draw_gpus()

    @drawing_callback
    def _tick(self) -> None:
        """Durations advance between snapshots (one line per ticking stage)."""
        if self.view is not None:
            self.draw_stages(self.clock())

    def action_request(self, what: str) -> None:
        """r c F d C: the app acts; the screen only says what was asked."""
        if what == "run":
            self.post_message(RunRequested())
        elif what == "cancel":
            self.post_message(CancelRequested())
        elif what == "doctor":
            self.post_message(DoctorRequested())
        elif what == "compare":
            self.post_message(CompareRequested())
        elif what == "force" and self.view is not None:
            self.post_message(ForceRequested(self.selected_stage))

    # -- drawing ---------------------------------------------------------------------
    def draw_title(self) -> None:
        t = Text("eagle-panel ", style="bold")
        if self.rundir is None:
            t.append("no run", style="dim")
        else:
            t.append(f"run {self.rundir.id}")
            pid = self.view.driver_pid if self.view else None
            t.append(f"  launcher pid {pid}" if pid else "  idle (r runs/resumes)",
                     style="green" if pid else "dim")
        kind = self.gpu_kind
        t.append(f"  GPUs: {'SIMULATED' if kind == 'simulated' else kind}",
                 style="magenta" if kind == "simulated" else "dim")
        self.query_one("#title", QuietStatic).set(t)

    def draw_run(self, now: float) -> None:
        """Everything that follows the run's files."""
        self.draw_stages(now)
        self.draw_detail()
        self.draw_title()
        self.draw_active_tab()

    def draw_stages(self, now: float) -> None:
        self.query_one(StageTable).refresh_from(self.view.stages, now)

    def select(self, stage: str) -> None:
        """Select a stage: the table's cursor and its log."""
        self.query_one(StageTable).select(stage)
        self.show_log(stage)

    USER_HOLD_S = 60.0   # a selection the user made is kept this long

    def follow(self, stage: str, always: bool = False) -> None:
        """Move the selection to where the work is, unless the user chose a
        stage in the last minute (a failure moves it anyway)."""
        if stage != self.selected_stage:
            if not always and time.monotonic() - self._user_moved_at < self.USER_HOLD_S:
                return
            self._following = stage
        self.select(stage)
        self.draw_detail()

    @property
    def selected_stage(self) -> str:
        return self.query_one(StageTable).selected_stage

    def draw_active_tab(self, switched: bool = False) -> None:
        """Hidden tabs are not drawn; switching to one draws it."""
        tab = self.query_one(TabbedContent).active
        if tab == "logs":
            self.draw_log_step()
        elif tab == "training" and self.view is not None:
            self.draw_training(force=switched)
        elif tab == "kv" and self.view is not None:
            self.draw_kv()
        elif tab == "gpus" and self.sample is not None:
            self.draw_gpus(force=switched)

    def draw_kv(self) -> None:
        """The selected stage's KV cache: what its servers allocated, their
        live use while one is up (regenerate's, extract's, evaluate's...)."""
        st = self.view.stages[self.selected_stage]
        servers = {name: ev for name, ev in st.kv_reports.items() if name != "engine"}
        backend = self.backend if st.name == "extract" else None
        self.query_one(KVCachePanel).update_from(KVReport(
            st.kv_cache(), servers, st.live_kv_usage(), backend, stage=st.name,
            has_servers=bool(st.servers),
            stopped=frozenset(s.name for s in st.servers if s.stopped)))

    def on_tabbed_content_tab_activated(self, _event) -> None:
        self.draw_active_tab(switched=True)

    def draw_gpus(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._gpus_drawn_at < self.refresh_s:
            return  # the history keeps every sample; the rows wait
        self._gpus_drawn_at = now
        view = self.view
        holders = view.devices_by_gpu() if view else {}
        prog = view.stages["extract"].progress if view else None
        forecast = dict(prog.event) if prog else None
        running = frozenset(view.running_stages()) if view else frozenset()
        self.query_one(GpuTable).update_from(self.sample, holders, forecast, running)

    def draw_detail(self) -> None:
        view = self.view
        stage = self.selected_stage
        info = view.stages[stage]
        t = Text(f"{stage}: ", style="bold")
        if view.state_error:
            t.append(view.state_error, style="bold red")
        elif info.status == Status.FAILED:
            err = info.last_error or {}
            t.append(err.get("message") or f"failed ({fmt.exit_text(info.state)})",
                     style="bold red")
            if err.get("hint"):
                t.append(f"\n  hint: {err['hint']}", style="yellow")
            if info.reason:
                t.append(f"\n  {info.reason}", style="dim")
        elif info.running and info.job and not info.job.endswith(" running"):
            # waiting in the scheduler's queue, or the scheduler not answering: its words
            t.append(info.job, style="bold yellow" if "not answering" in info.job else "cyan")
        elif stalled := [v for v in info.servers if v.stalled_s and info.running]:
            ev = stalled[0].event
            t.append(f"{stalled[0].label} {stalled[0].name}: {startup.describe(ev)}",
                     style="bold red")
            t.append(f"\n  last log line: {stalled[0].last_line[-150:]}", style="dim")
        elif starting := [v for v in info.servers if info.running
                          and v.phase not in (startup.READY, startup.STOPPED)]:
            # each server its own line while they start (the row counts them); the
            # detail has 3 lines: beyond them, `status` lists every one
            shown = starting if len(starting) <= 3 else starting[:2]
            for i, v in enumerate(shown):
                t.append(("\n  " if i else "") + f"{v.label} {v.name}: "
                         f"{startup.describe(v.event)}", style="cyan")
            if len(shown) < len(starting):
                t.append(f"\n  ... and {len(starting) - 2} more starting (eagle-panel status "
                         "lists them)", style="dim")
        elif info.warnings:
            t.append(info.warnings[-1].get("message", ""), style="yellow")
        elif info.finished:
            t.append(fmt.summary_text(stage, info.summary) or
                     info.finished.get("status", ""), style="dim")
            if stage in ("train", "evaluate"):   # the run's next steps, on one line: ship, look
                # (this stage's own: the other's trackers are on its row)
                lines = fmt.next_lines(
                    info.summary if stage == "train" else TrainSummary(),
                    info.summary if stage == "evaluate" else EvaluateSummary(), view.run_id)
                if lines:
                    t.append("\n  " + " · ".join(reversed(lines)), style="dim")
        else:
            t.append(info.status, style="dim")
        self.query_one("#detail", QuietStatic).set(t)

    def training_view_of(self) -> str:
        """Whose view the Training tab shows: evaluate's (what vLLM measured
        per checkpoint) while evaluate is selected, else train's."""
        return "evaluate" if self.selected_stage == "evaluate" else "train"

    def follow_training_view(self) -> None:
        """A selection that changes whose view the Training tab shows turns
        the chart to that stage's family: acceptance for evaluate, and back
        to the family train's view had."""
        chart, owner = self.query_one(LossChart), self.training_view_of()
        if owner == self._training_owner:
            return
        self._training_owner = owner
        if owner == "evaluate":
            self._train_metric = chart.metric   # (acceptance too, if train's view had it)
            chart.metric = "acceptance"
        elif self._train_metric is not None:
            chart.metric = self._train_metric
        self.query_one(TabbedContent).get_tab("training").label = f"4 Training: {owner}"

    def draw_training(self, force: bool = False) -> None:
        self.follow_training_view()
        view = self.view
        summary = view.stages["evaluate"].summary
        if self._training_owner == "evaluate":
            t = evaluate_info(view)
        else:
            t = train_info(view)
        self.query_one("#train-info", QuietStatic).set(t)
        self.query_one(LossChart).update_from(view.metrics, view.version, force)
        bars = self.query_one(CategoryBars)
        if self._training_owner == "evaluate":
            per_position = summary.per_position or []
            bars.update_from(summary.per_category, len(per_position) or 3, per_position)
        else:
            bars.display = False   # evaluate's figures: in evaluate's view

    def draw_log_step(self) -> None:
        """Under a running train's own log, its per-step figures as one line,
        rewritten as they come (speculators' per-step dicts are kept out of
        the log: pipeline/train/in_process.per_step_quiet)."""
        line = self.query_one("#log-step", QuietStatic)
        train = self.view.stages["train"] if self.view is not None else None
        line.display = bool(train and train.running and train.progress) and \
            self._log_stage == "train" and self._log_server is None
        if line.display:
            line.set(step_line(self.view))

    def show_log(self, stage: str) -> None:
        """The stage's own log (selecting a stage always comes back to it)."""
        if self.rundir is None or stage == self._log_stage:
            return
        self._log_stage, self._log_server = stage, None
        self._watch_log(self.rundir, self.rundir.log_path(stage))

    def _watch_log(self, rd, path) -> None:
        """Only a plain file inside the run: never a link to another user's file."""
        from pipeline.run.rundir import RunDirError
        try:
            rd.readable(path, "the log")
        except RunDirError as e:
            self.notify(str(e), severity="error", timeout=8)
            return
        self.query_one(LogView).watch_file(path)
        # which log this is stays on the tab (a pop-up said it once, then went)
        server = f" · vLLM {self._log_server}" if self._log_server is not None else ""
        self.query_one(TabbedContent).get_tab("logs").label = \
            f"1 Logs: {self._log_stage}{server}"
        self.draw_log_step()   # (train's step line: under its own log only)

    def action_next_log(self) -> None:
        """l: the selected stage's log -> its vLLM server 0's -> server 1's ... -> back."""
        rd = self.rundir
        if rd is None:
            return
        stage = self.selected_stage
        names = [None] + [name for name, _ in rd.server_logs(stage)]
        if len(names) == 1:
            self.notify(f"{stage} has started no vLLM server", timeout=3)
            return
        now = self._log_server if self._log_stage == stage else None
        nxt = names[(names.index(now) + 1) % len(names)] if now in names else names[1]
        self._log_stage, self._log_server = stage, nxt
        path = rd.log_path(stage) if nxt is None else dict(rd.server_logs(stage))[nxt]
        self._watch_log(rd, path)
        self.query_one(TabbedContent).active = "logs"
        self.notify(f"log: {stage}" + (f", vLLM server {nxt} ({path.name})" if nxt else ""),
                    timeout=3)

    @drawing_callback
    def _poll_log(self) -> None:
        self.query_one(LogView).poll()

    def on_stage_table_selected(self, event: StageTable.Selected) -> None:
        if event.stage == self._following:
            self._following = None    # the panel moved it, not the user
        else:
            self._user_moved_at = time.monotonic()
        if self.view is None:
            return
        self.show_log(event.stage)
        self.draw_detail()
        self.follow_training_view()   # the tab's name and family, whichever tab shows
        active = self.query_one(TabbedContent).active
        if active == "kv":
            self.draw_kv()   # the KV tab is the selected stage's
        elif active == "training":
            self.draw_training(force=True)   # train's view or evaluate's

    # -- keys that change what is shown ------------------------------------------------
    def action_tab(self, tab: str) -> None:
        self.query_one(TabbedContent).active = tab

    def action_fullscreen(self) -> None:
        self.toggle_class("fullscreen")
        self.query_one(TabbedContent).active = "logs"

    def action_log_end(self, end: bool) -> None:
        """End / Home: the log's last line (following) or its first (not)."""
        self.query_one(TabbedContent).active = "logs"
        self.query_one(LogView).jump(end)

    def action_follow(self) -> None:
        log = self.query_one(LogView)
        log.set_follow(not log.follow)
        self.notify(f"follow {'on' if log.follow else 'off'}", timeout=2)

    def action_wide_lines(self) -> None:
        log = self.query_one(LogView)
        log.set_elide(not log.elide)
        self.notify("long lines: " + ("elided in the middle" if log.elide else
                                      "whole (←→ scrolls sideways)"), timeout=2)

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
        self.follow_training_view()   # the key changes the view of the selected stage
        chart = self.query_one(LossChart)
        if what == "smooth":
            chart.smooth = not chart.smooth
        elif what == "log":
            chart.log = not chart.log
        elif what == "positions":
            chart.positions = not chart.positions
        elif what == "metric":
            chart.metric = chart.METRICS[(chart.METRICS.index(chart.metric) + 1)
                                         % len(chart.METRICS)]
        elif what == "split":
            chart.split = "val" if chart.split == "train" else "train"
        self.query_one(TabbedContent).active = "training"

    def action_node(self) -> None:
        """g on the GPU tab: one cluster node's GPUs, the next, then all nodes."""
        if self.query_one(TabbedContent).active == "gpus" and self.sample is not None:
            self.query_one(GpuTable).drill_next()


def train_info(view) -> Text:
    """Train's line over its chart: step, epoch, phase or ETA, lr, estimate."""
    train = view.stages["train"]
    t = Text()
    prog = train.progress
    if prog:
        t.append(f"step {prog.done}/{prog.total}  ")
        if prog.epoch is not None:
            t.append(fmt.epoch_text(prog.epoch, prog.event.get("epochs")) + "  ")
        if prog.event.get("phase") and train.running:
            t.append(f"{prog.event['phase']}  ", style="cyan")
        elif prog.eta_s is not None and train.running:
            t.append(f"ETA {fmt.duration(prog.eta_s)}  ")
    lr = view.metrics.get(("train", "lr")) or view.metrics.get(("train", "lr_AdamW"))
    if lr is not None and lr.added:
        t.append(f"lr {lr.last_y:.2e}  ")
    acc, measured = view.acceptance_estimate(), view.acceptance_measured()
    if measured is not None:
        t.append(f"acceptance length {measured:.2f} (vLLM)", style="bold green")
        if acc is not None:
            t.append(f", est. {acc:.2f}")
    elif acc is not None:
        t.append(f"acceptance length (est.) {acc:.2f}", style="bold green")
    if not t.plain:
        t.append("no training yet", style="dim")
    if train.online:
        t.append("\n")
        t.append_text(online_text(train.online))
    return t


def step_line(view) -> Text:
    """A running train's last step: `step 261/2592 · loss 3.21 · acc 0.97
    0.88 0.74 · 17.4 steps/s · ETA 2m14s` (the accuracies per draft
    position)."""
    prog, m = view.stages["train"].progress, view.metrics
    t = Text(f"step {prog.done}/{prog.total or '?'}", style="bold")
    loss = m.get(("train", "loss"))
    if loss is not None and loss.added:
        t.append(f" · loss {loss.last_y:.3g}")
    accs = sorted((k for sp, k in m if sp == "train" and k.startswith("full_acc_")
                   and k[9:].isdigit()), key=lambda k: int(k[9:]))
    if accs:
        t.append(" · acc " + " ".join(f"{m[('train', k)].last_y:.2f}" for k in accs
                                      if m[("train", k)].added))
    if prog.event.get("rate"):
        t.append(f" · {fmt.rate_text(prog.event['rate'], prog.unit)}")
    if prog.eta_s is not None:
        t.append(f" · ETA {fmt.duration(prog.eta_s)}")
    return t


def evaluate_info(view) -> Text:
    """Evaluate's line over its chart: the chosen draft's measured acceptance
    (the checkpoint, how it was chosen, the estimate beside it, the speedup),
    or how far the measuring is."""
    ev = view.stages["evaluate"]
    s, t = ev.summary, Text()
    if s.acceptance_length is not None:
        # one line at 80 columns: "acceptance 3.12 (vLLM), est. 2.96 · checkpoint 1, best
        # of 2 · decode 1.18x"
        t.append(f"acceptance {s.acceptance_length:.2f} (vLLM)", style="bold green")
        if s.acceptance_estimate is not None:
            t.append(f", est. {s.acceptance_estimate:.2f}")
        t.append(f" · checkpoint {s.checkpoint}")
        if (s.measured or 0) > 1:
            t.append(f", best of {s.measured}", style="dim")
        if s.speedup:
            t.append(f" · decode {s.speedup:.2f}x")
        return t
    if ev.progress and ev.running:
        t.append(f"{fmt.progress_text(ev.progress.event)}  ")
    measured = view.acceptance_measured()
    if measured is not None:
        t.append(f"last measured {measured:.2f} (vLLM)", style="bold green")
    if not t.plain:
        t.append(f"evaluate: {ev.status}; it measures each checkpoint through vLLM",
                 style="dim")
    return t


def all_done(view) -> bool:
    return all(view.stages[s].status in DONE for s in STAGE_NAMES)
