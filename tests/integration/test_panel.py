"""The panel under Pilot, driven by real runs of test stages (tests.stagekit)."""

import re

import pytest

from app.panel import PanelApp
from pipeline.run.events import EventWriter
from pipeline.run.rundir import RunDir, pid_running
from pipeline.telemetry import Telemetry
from pipeline.vllm.shutdown_noise import MARK
from tests.configs import write
from tests.helpers import cli, kv_tab_text, screen_text, select_stage, until, wait_for
from widgets.gpu_table import GpuTable
from widgets.log_view import LogTail, LogView, collapse_cr
from widgets.loss_chart import LossChart
from widgets.stage_table import StageTable


def cell(app, stage, col):
    return str(app.query_one(StageTable).get_cell(stage, col))


def make_app(rd=None, tmp_path=None, **kw):
    tel = Telemetry(simulate=kw.pop("gpus", 8), host=kw.pop("host", True))
    return PanelApp(rd, config_path=(tmp_path / "config.toml") if tmp_path else None,
                    runs_dir=(tmp_path / "runs") if tmp_path else None, telemetry=tel, **kw)


class BellCounter(PanelApp):
    bells = 0

    def bell(self):
        self.bells += 1


async def test_shows_a_failed_run_and_resumes_it(tmp_path, stagekit):
    stagekit({"extract": "fail_once"})
    cli("run", "--wait", cwd=tmp_path, check=1)
    rd = RunDir(tmp_path / "runs/t")
    app = BellCounter(rd, tmp_path / "config.toml", runs_dir=tmp_path / "runs",
                      telemetry=Telemetry(simulate=2))
    async with app.run_test(size=(80, 24)) as pilot:
        assert cell(app, "extract", "Status") == "failed"
        assert cell(app, "prepare", "Status") == "succeeded"
        # the failed stage is selected on opening: its error and hint show
        assert app.query_one(StageTable).selected_stage == "extract"
        detail = str(app.query_one("#detail").render())
        assert "first attempt fails on purpose" in detail
        await pilot.press("r")
        await until(pilot, lambda: cell(app, "train", "Status") == "succeeded", what="resume")
        assert cell(app, "extract", "Att") == "2"
        try:
            await until(pilot, lambda: app.bells >= 1, what="finish bell")
        except AssertionError:
            states = [i.status for i in app.view.stages.values()]
            raise AssertionError(f"no finish bell: states {states}") from None


async def test_cancel_from_the_panel_stops_the_tree(tmp_path, stagekit):
    stagekit({"prepare": "grandchild:60"})
    cli("run", cwd=tmp_path, check=0)
    rd = RunDir(tmp_path / "runs/t")
    marker = rd.stage_dir("prepare") / "grandchild.pid"
    wait_for(marker.exists, what="grandchild")
    app = BellCounter(rd, tmp_path / "config.toml", runs_dir=tmp_path / "runs",
                      telemetry=Telemetry(simulate=1))
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: cell(app, "prepare", "Status") == "running", what="running")
        await pilot.press("c")
        await pilot.pause(0.2)
        await pilot.press("n")  # a "no" changes nothing
        await pilot.pause(0.5)
        assert rd.read_state()["stages"]["prepare"]["status"] == "running"
        await pilot.press("c")
        await pilot.pause(0.2)
        await pilot.press("y")
        await until(pilot, lambda: cell(app, "prepare", "Status") == "cancelled", timeout=40,
                    what="cancelled")
    assert not pid_running(int(marker.read_text()))


async def test_force_rerun_of_the_selected_stage(tmp_path, stagekit):
    stagekit()
    cli("run", "--wait", cwd=tmp_path, check=0)
    rd = RunDir(tmp_path / "runs/t")
    app = make_app(rd, tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("up", "up")  # from the last stage that ran (evaluate) to vocab
        await pilot.press("F")
        await pilot.pause(0.2)
        await pilot.press("y")
        await until(pilot, lambda: cell(app, "vocab", "Att") == "2"
                    and cell(app, "vocab", "Status") == "succeeded", what="vocab re-run")
        assert cell(app, "train", "Att") == "1"


async def test_panel_closed_and_reopened_sees_the_same_live_run(tmp_path, stagekit):
    stagekit({"prepare": "sleep:12"})   # still running when the second panel opens, under load
    cli("run", cwd=tmp_path, check=0)
    rd = RunDir(tmp_path / "runs/t")
    async with make_app(rd, tmp_path).run_test(size=(80, 24)) as pilot:
        app = pilot.app
        await until(pilot, lambda: cell(app, "prepare", "Status") == "running", what="running")
        await until(pilot, lambda: "/" in cell(app, "prepare", "Progress"), what="progress")
        first = cell(app, "prepare", "Progress")
    pid = rd.read_state()["stages"]["prepare"]["pid"]
    assert pid_running(pid)  # closing the panel stopped nothing
    async with make_app(rd, tmp_path).run_test(size=(80, 24)) as pilot:
        app = pilot.app
        assert cell(app, "prepare", "Status") == "running"
        await until(pilot, lambda: cell(app, "prepare", "Progress") != first, what="advance")
        await until(pilot, lambda: cell(app, "train", "Status") == "succeeded", timeout=60,
                    what="pipeline end")


async def test_no_runs_offers_to_start_one(tmp_path, stagekit):
    stagekit()
    app = make_app(None, tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        assert "Press r to start one" in str(app.query_one("#detail").render())
        await pilot.press("r")
        await until(pilot, lambda: app.rundir is not None and
                    cell(app, "train", "Status") == "succeeded", what="new run")
    assert (tmp_path / "runs/t/state.json").exists()


async def test_tabs_gpus_kv_and_training(tmp_path, stagekit):
    stagekit({"train": "events:300"})
    cli("run", "--wait", cwd=tmp_path, check=0)
    rd = RunDir(tmp_path / "runs/t")
    w = EventWriter(rd.events_path("train"))
    for i in range(3):
        w.emit("metric", step=i, epoch=0, split="val", values={"loss": 1.0, "full_acc_0": 0.5})
    w.close()
    app = make_app(rd, tmp_path)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("2")
        await until(pilot, lambda: app.query_one(GpuTable).snapshot is not None, what="sample")
        await pilot.pause(0.3)
        text = app.query_one(GpuTable).plain()
        assert "SIMULATED" in text and "7*" in text and "host" in text
        await select_stage(app, pilot, "extract")   # (the table keeps the keys' focus)
        await pilot.press("3")
        await pilot.pause(0.2)
        assert "No KV cache for this backend" in str(app.query_one("#kvpanel").render())
        await pilot.press("4")
        await pilot.pause(0.3)
        chart = app.query_one(LossChart)
        rendered = str(chart.render())
        assert "train loss" in rendered and any(0x2800 < ord(ch) <= 0x28FF for ch in rendered)
        assert chart.smooth and not chart.positions   # the trend and the total loss first
        await pilot.press("e", "o", "p", "a", "v")
        assert not chart.smooth and chart.log and chart.positions and \
            chart.metric == "full_acc" and chart.split == "val"
        assert "acceptance length (est.) 1.50" in str(app.query_one("#train-info").render())


@pytest.mark.parametrize("rows", [24, 30])
async def test_every_gpu_is_on_screen_at_80_columns(tmp_path, stagekit, rows):
    """8 GPUs under six stages and a failed stage's three-line error, host
    stats on: at 80x24 every GPU is on screen (two share a line: the tab is
    too short for one per line), at 80x30 one per line; the host line is cut,
    never wrapped."""
    stagekit({"prepare": "fail:2"})
    cli("run", "--wait", cwd=tmp_path, check=1)
    rd = RunDir(tmp_path / "runs/t")
    rd.update_stage("prepare", reason="a third line of detail under the hint")
    app = make_app(rd, tmp_path)
    async with app.run_test(size=(80, rows)) as pilot:
        await pilot.press("2")
        await until(pilot, lambda: app.query_one(GpuTable).snapshot is not None, what="sample")
        app.query_one(GpuTable).update_from(app.snapshot, {0: "extract"}, {
            "disk_needed_bytes": 123 << 30})
        await pilot.pause(0.3)
        text = screen_text(app)
        assert "hint:" in text and "a third line of detail" in text   # the detail is tall
        shown = set(re.findall(r"(?:^| )(\d)\* ", text, re.M))
        assert shown == set("01234567"), text
        assert len(re.findall(r"^ \d\* ", text, re.M)) == (4 if rows == 24 else 8), text
        host = [ln for ln in text.splitlines() if ln.startswith(" host")]
        assert len(host) == 1 and "CPU" in host[0]
        assert "of hidden states to write" in host[0] or host[0].rstrip().endswith("…"), host
    app = make_app(rd, tmp_path)
    async with app.run_test(size=(160, 48)) as pilot:   # room: one GPU per line
        await pilot.press("2")
        await until(pilot, lambda: app.query_one(GpuTable).snapshot is not None, what="sample")
        await pilot.pause(0.3)
        text = screen_text(app)
        assert len(re.findall(r"^ \d\* ", text, re.M)) == 8, text


async def test_log_search_follow_and_fullscreen(tmp_path, stagekit):
    stagekit({"prepare": "fail:2"})
    cli("run", "--wait", cwd=tmp_path, check=1)
    rd = RunDir(tmp_path / "runs/t")
    with open(rd.log_path("prepare"), "a") as f:
        for i in range(300):
            f.write(f"line {i}\n")
        f.write("[shutdown] API server: shutdown triggered\n"   # vLLM's usual stop: hidden
                "ERROR 12-02 14:34:50 [async_llm.py:906] AsyncLLM output_handler failed.\n")
        f.write("START " + "x" * 150 + "MIDDLE" + "x" * 150 + " THE END\n")   # vLLM's arguments
        f.write("progress 10%\rprogress 50%\rprogress 100%\n\x1b[31mred text\x1b[0m\n")
    app = make_app(rd, tmp_path)

    def row(text):   # the screen's row holding `text` ("" when none does yet)
        return next((r for r in screen_text(app).splitlines() if text in r), "")
    async with app.run_test(size=(80, 24)) as pilot:
        log = app.query_one(LogView)
        await until(pilot, lambda: any("red text" in log.plain(t) for t in log.lines),
                    what="the whole log read")
        plain = [log.plain(t) for t in log.lines]
        assert "progress 100%" in plain and "progress 10%" not in " ".join(plain)
        assert MARK in plain and not any("output_handler" in p for p in plain)
        # a line wider than the view: its start and its end on screen; w: whole, sideways
        await until(pilot, lambda: "START" in row("START"), what="the long line on screen")
        long_row = row("START")
        assert "THE END" in long_row and " … " in long_row, long_row
        await pilot.press("w")
        await until(pilot, lambda: not log.elide and "THE END" not in row("START"),
                    what="the long line whole, sideways")
        assert log.virtual_size.width > 300
        await pilot.press("w")
        await until(pilot, lambda: log.elide and "MIDDLE" not in screen_text(app),
                    what="the long line elided again")
        await pilot.press("slash", *"MIDDLE", "enter")   # a match in the part left out: shown
        await until(pilot, lambda: "MIDDLE" in row("START"), what="the match shown")
        assert "output_handler failed" in rd.log_path("prepare").read_text()   # the file keeps it
        last = log.line_at(len(log.lines) - 1)
        assert last.plain == "red text"
        assert any(s.style.color and s.style.color.number == 1 for s in last.spans)
        await pilot.press("slash")
        await pilot.press(*"line 42")
        await pilot.press("enter")
        await until(pilot, lambda: log.search == "line 42" and not log.follow and
                    log.scroll_offset.y <= plain.index("line 42") <= log.scroll_offset.y + 20,
                    what="the search scrolled to its match")
        await pilot.press("f")
        assert log.follow
        await pilot.press("z")
        assert app.screen.has_class("fullscreen")
        await pilot.press("question_mark")
        await until(pilot, lambda: app.screen.__class__.__name__ == "HelpScreen",
                    what="the help screen")
        await pilot.press("escape")


async def test_a_followed_log_is_at_its_end_after_a_tab_switch(tmp_path, stagekit):
    """A 3,000-line log selected while the GPUs tab is shown: back on Logs it
    shows its last line (follow on), End goes there again after Home."""
    stagekit({})
    cli("run", "--wait", cwd=tmp_path, check=0)
    rd = RunDir(tmp_path / "runs/t")
    with open(rd.log_path("vocab"), "a") as f:
        f.write("".join(f"vocab line {i}\n" for i in range(3000)))
    app = make_app(rd, tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("2")
        await select_stage(app, pilot, "vocab")   # its log is read while hidden
        await pilot.press("1")
        await pilot.pause(0.3)
        log = app.query_one(LogView)

        def at_end():
            return log.follow and log.max_scroll_y > 0 and log.scroll_offset.y == log.max_scroll_y
        await until(pilot, at_end, timeout=5, what="the log at its end")
        assert "vocab line 2999" in screen_text(app)
        await pilot.press("home")
        await pilot.pause(0.2)
        assert log.scroll_offset.y == 0 and not log.follow
        await pilot.press("end")
        await until(pilot, at_end, timeout=5, what="End back at the end")
        assert "vocab line 2999" in screen_text(app)
        log.focus()   # with the log focused, its own End/Home do the same
        await pilot.press("home")
        await pilot.pause(0.2)
        assert log.scroll_offset.y == 0 and not log.follow
        await pilot.press("end")
        await until(pilot, at_end, timeout=5, what="End (log focused) at the end, following")


def test_log_tail_reads_only_the_end(tmp_path):
    p = tmp_path / "big.log"
    with open(p, "wb") as f:
        f.write(b"x" * 100 + b"\n")
        f.write(b"".join(b"line %d\n" % i for i in range(500_000)))
    t = LogTail(p, initial_lines=10)
    assert t.initial[-1] == "line 499999" and len(t.initial) == 10
    with open(p, "ab") as f:
        f.write(b"more\npart")
    lines, partial = t.poll()
    assert lines == ["more"] and partial == "part"
    assert collapse_cr("a\rb\r") == "b"


def test_no_driver_means_banner_not_crash(monkeypatch):
    import pynvml

    def boom():
        raise pynvml.NVMLError_LibraryNotFound()
    monkeypatch.setattr(pynvml, "nvmlInit", boom)
    tel = Telemetry()
    snap = tel.sample()
    assert snap.source == "none" and snap.gpus == [] and "no NVIDIA GPU telemetry" in snap.banner
    assert snap.host.mem_total > 0


class FakeNvml:
    """A stand-in for the NVML driver library (none on CPU machines), with
    the answers the H200 gave: v1 memory info counts 614 MiB reserved as used."""
    MiB = 1 << 20

    def __init__(self, monkeypatch, v2: bool, unsupported=()):
        import types

        import pynvml
        self.nv = pynvml
        self.v2, self.unsupported = v2, set(unsupported)
        for name in ("nvmlInit", "nvmlShutdown", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex",
                     "nvmlDeviceGetName", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetUtilizationRates",
                     "nvmlDeviceGetTemperature", "nvmlDeviceGetPowerUsage",
                     "nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetPcieThroughput"):
            monkeypatch.setattr(pynvml, name, self._wrap(name, getattr(self, name[4:])))
        self.ns = types.SimpleNamespace

    def _wrap(self, name, fn):
        def call(*a, **kw):
            if name in self.unsupported:
                raise self.nv.NVMLError_NotSupported()
            return fn(*a, **kw)
        return call

    def Init(self):
        pass

    Shutdown = Init

    def DeviceGetCount(self):
        return 1

    def DeviceGetHandleByIndex(self, i):
        return i

    def DeviceGetName(self, h):
        return "NVIDIA H200"

    def DeviceGetMemoryInfo(self, h, version=None):
        total = 143771 * self.MiB
        if version is None:
            return self.ns(total=total, used=618 * self.MiB, free=total - 618 * self.MiB)
        if not self.v2:
            raise self.nv.NVMLError_FunctionNotFound()
        return self.ns(total=total, reserved=614 * self.MiB, used=4 * self.MiB,
                       free=total - 618 * self.MiB)

    def DeviceGetUtilizationRates(self, h):
        return self.ns(gpu=100, memory=40)

    def DeviceGetTemperature(self, h, sensor):
        return 62

    def DeviceGetPowerUsage(self, h):
        return 688_433

    def DeviceGetEnforcedPowerLimit(self, h):
        return 700_000

    def DeviceGetPcieThroughput(self, h, counter):
        return 59_389_000 if counter == self.nv.NVML_PCIE_UTIL_RX_BYTES else 5_168_000


@pytest.mark.parametrize("v2,used_mib", [(True, 4), (False, 618)])
def test_nvml_memory_matches_nvidia_smi_where_the_driver_can(monkeypatch, v2, used_mib):
    from pipeline.telemetry import NvmlSource
    FakeNvml(monkeypatch, v2=v2)
    s = NvmlSource().sample()[0]
    assert s.mem_used == used_mib * FakeNvml.MiB and s.mem_total == 143771 * FakeNvml.MiB
    assert (s.util, s.temp, s.power, s.power_limit) == (100.0, 62.0, 688.433, 700.0)
    assert s.pcie_rx == 59_389_000 * 1024 and s.pcie_tx == 5_168_000 * 1024
    from pipeline.doctor import nvml_gpus
    assert nvml_gpus() == [{"index": 0, "name": "NVIDIA H200",
                            "memory_total": 143771 * FakeNvml.MiB}]


def test_nvml_fields_not_supported_are_blank_not_errors(monkeypatch):
    from pipeline.telemetry import NvmlSource
    FakeNvml(monkeypatch, v2=True, unsupported={
        "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetTemperature", "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetPcieThroughput"})
    s = NvmlSource().sample()[0]
    assert s.mem_used == 4 * FakeNvml.MiB and s.error is None
    assert (s.util, s.temp, s.power, s.power_limit, s.pcie_rx, s.pcie_tx) == (None,) * 6


@pytest.mark.gpu
def test_nvml_source_on_a_real_gpu():
    """Against nvidia-smi on the same GPU (H200: memory used, total and the
    power limit agreed exactly once v2 memory info was used)."""
    import subprocess

    from pipeline.telemetry import NvmlSource
    s = NvmlSource().sample()[0]
    out = subprocess.run(["nvidia-smi", "-i", "0", "--query-gpu=memory.used,memory.total,"
                          "power.limit", "--format=csv,noheader,nounits"], capture_output=True,
                         text=True, check=True).stdout.split(", ")
    used, total, limit = (float(x) for x in out)
    assert abs(s.mem_used / 2**20 - used) <= 16 and abs(s.mem_total / 2**20 - total) <= 1
    assert s.power_limit == pytest.approx(limit, abs=1)


async def test_doctor_screen_shows_the_report(tmp_path):
    write(tmp_path / "config.toml", {"stages": {"extract": {"layer_ids": [1, 9]},
                                                "vocab": {"draft_vocab_size": 256}}})
    app = make_app(None, tmp_path)
    async with app.run_test(size=(100, 40)) as pilot:
        await pilot.press("d")
        await until(pilot, lambda: app.screen.__class__.__name__ == "DoctorScreen", what="screen")
        report = app.screen.query_one("#doctor-report")
        await until(pilot, lambda: "blocking" in str(report.content), timeout=120,
                    what="the doctor's findings")
        text = app.screen.report_text()
        assert "layer id 9 is out of range" in text and "1 blocking" in text
        assert "4 layers, hidden 128" in text
        # one check a line at 100 columns; the cursor on the blocking one, shown whole below:
        # every finding listed (the detail below repeats the blocking one's tag), no list
        # row wrapped onto a second line. The list is laid out a refresh after the report
        # (its width cuts the lines): read until it is, for 5 s
        want = len(app.screen.findings) + 1
        for _ in range(50):
            shown = screen_text(app).splitlines()
            tagged = [i for i, r in enumerate(shown)
                      if re.search(r"\[(  ok  | WARN |BLOCK )\] \w", r)]
            if len(tagged) == want:
                break
            await pilot.pause(0.1)
        assert len(tagged) == want, shown
        assert tagged[-2] - tagged[0] == len(app.screen.findings) - 1, shown
        assert any("fix:" in r for r in shown[tagged[-1]:])
        detail = str(app.screen.query_one("#doctor-detail").render())
        assert "layer id 9 is out of range" in detail
        await pilot.press("down")
        assert "layer id 9" not in str(app.screen.query_one("#doctor-detail").render())
        await pilot.press("escape")
        assert app.screen.__class__.__name__ != "DoctorScreen"


def finished_run_events(tmp_path, stagekit):
    """A finished run of test stages, and a writer to add extract events to it."""
    stagekit({})
    cli("run", "--wait", cwd=tmp_path, check=0)
    rd = RunDir(tmp_path / "runs/t")
    return rd, EventWriter(rd.events_path("extract"))


async def test_kv_tab_shows_the_selected_stages_servers(tmp_path, stagekit):
    """kv_cache events as the vllm-server backend writes them (two data-parallel
    servers, fields from their log lines) in extract, another in evaluate: the
    tab shows the selected stage's, says so for a stage without servers, and
    shows no live use after the stage ended (history, not use)."""
    rd, w = finished_run_events(tmp_path, stagekit)
    for k in (0, 1):
        w.emit("kv_cache", server=k, devices=[2 * k, 2 * k + 1], num_blocks=None,
               block_size=None, bytes_per_block=None, total_bytes=int(110.47 * (1 << 30)),
               tokens_capacity=1_234_560, max_concurrency=150.7, max_model_len=8192,
               groups=[], pool="GPU", source="log")
    w.emit("kv_usage", usage_perc=0.3, running=16, waiting=3)
    w.close()
    ev = EventWriter(rd.events_path("evaluate"))
    ev.emit("kv_cache", server=0, devices=[0], num_blocks=5825, block_size=16,
            bytes_per_block=None, total_bytes=None, tokens_capacity=93_200,
            max_concurrency=None, max_model_len=None, groups=[], source="log")
    ev.close()
    app = make_app(rd, tmp_path)
    async with app.run_test(size=(100, 30)) as pilot:
        await select_stage(app, pilot, "extract")
        plain = await kv_tab_text(app, pilot)
        assert "1,234,560" in plain and "150.70x at 8192" in plain and "110.5 GiB" in plain
        assert "2 (data parallel): 2,469,120 tokens" in plain
        assert "extract" in plain and "live use" not in plain   # it has ended
        await select_stage(app, pilot, "evaluate")
        plain = await kv_tab_text(app, pilot)
        assert "5,825" in plain and "93,200" in plain and "evaluate" in plain
        assert "1,234,560" not in plain
        await select_stage(app, pilot, "vocab")
        plain = await kv_tab_text(app, pilot)
        assert "vocab starts no vLLM server" in plain


async def test_kv_tab_shows_live_use_while_a_server_is_up(tmp_path, stagekit):
    """A running extract whose server is up: its live use is shown; once the
    server reports it stopped, the use is gone and the allocation stays."""
    stagekit({"extract": "sleep:60"})
    cli("run", cwd=tmp_path)
    rd = RunDir(tmp_path / "runs/t")
    wait_for(lambda: rd.events_path("extract").exists() and "stage_started" in
             rd.events_path("extract").read_text(), timeout=60, what="extract to start")
    w = EventWriter(rd.events_path("extract"))   # what its server would report
    w.emit("server", server=0, phase="ready", elapsed_s=20.0, phase_s=0.0, last_line="")
    w.emit("kv_cache", server=0, devices=[0], num_blocks=5957, block_size=16,
           bytes_per_block=None, total_bytes=None, tokens_capacity=95_312,
           max_concurrency=None, max_model_len=None, groups=[], source="log")
    w.emit("kv_usage", usage_perc=0.3, running=16, waiting=3)
    app = make_app(rd, tmp_path)
    try:
        async with app.run_test(size=(100, 30)) as pilot:
            await until(pilot, lambda: app.main.selected_stage == "extract",
                        what="the panel to select the running stage")
            plain = await kv_tab_text(app, pilot)
            assert "5,957" in plain and "30.0%" in plain and "running 16" in plain
            w.emit("server", server=0, phase="stopped", elapsed_s=40.0, phase_s=0.0,
                   last_line="")
            await until(pilot, lambda: app.main.view.stages["extract"].servers[0].stopped,
                        what="the stop to reach the screen")
            plain = await kv_tab_text(app, pilot)
            assert "5,957" in plain and "live use" not in plain
    finally:
        w.close()
        cli("cancel", "t", cwd=tmp_path, check=None)


async def test_kv_tab_shows_the_engine_report(tmp_path, stagekit):
    """A kv_cache event as the vllm-engine backend writes it: from a
    KVCacheConfig (Llama-3.1-8B-like at TP=2: 32 layers, 4 KV heads per rank,
    page 32 KiB per layer per block)."""
    from pipeline.vllm import kv
    from tests.fakes import vllm_doubles as d
    rd, w = finished_run_events(tmp_path, stagekit)
    spec = d.FullAttentionSpec(block_size=16, page_size_bytes=32768)
    names = [f"layers.{i}" for i in range(32)]
    kvc = d.KVCacheConfig(num_blocks=50_000, kv_cache_tensors=[
        d.KVCacheTensor_0_24(50_000 * 32768, [n]) for n in names],
        kv_cache_groups=[d.KVCacheGroupSpec(names, spec)])
    w.emit("kv_cache", server=0, devices=[0, 1], **kv.kv_cache_event(kvc, 16, 4097))
    w.close()
    app = make_app(rd, tmp_path)
    async with app.run_test(size=(100, 30)) as pilot:
        await select_stage(app, pilot, "extract")
        plain = await kv_tab_text(app, pilot)
        assert "50,000" in plain and "16 tokens" in plain and "800,000" in plain
        assert "engine (server 0, GPUs [0, 1])" in plain
        assert "FullAttentionSpec: 32 layers" in plain and "195.26x at 4097" in plain


async def test_dialogs_can_stay_open_while_the_panel_updates(tmp_path, stagekit):
    """The 1 Hz redraw and the log poll keep following the run under an open
    dialog, and the run is seen to its end. Extract waits on a gate the test
    opens, so the cancel dialog is asked for while a stage surely runs (a
    timed sleep lost that race on a loaded CI machine)."""
    stagekit({"extract": "gate"})
    cli("run", cwd=tmp_path)
    rd = RunDir(tmp_path / "runs/t")
    app = make_app(rd, tmp_path)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: cell(app, "extract", "Status") == "running",
                    what="extract to be shown running")
        await pilot.press("c")
        await until(pilot, lambda: app.screen.__class__.__name__ == "ConfirmScreen",
                    what="the cancel dialog")
        await pilot.press("escape")
        await until(pilot, lambda: app.screen.__class__.__name__ == "MainScreen",
                    what="the cancel dialog dismissed without cancelling")
        await pilot.press("question_mark")
        await until(pilot, lambda: app.screen.__class__.__name__ == "HelpScreen",
                    what="the help screen")
        (rd.stage_dir("extract") / "gate").write_text("open")
        await until(pilot, lambda: cell(app, "train", "Status") == "succeeded",
                    what="the run, followed under the help screen, to finish")
        assert app.screen.__class__.__name__ == "HelpScreen"
        assert rd.read_state()["stages"]["extract"]["status"] == "succeeded"


async def test_a_running_trains_log_has_its_steps_as_one_rewritten_line(tmp_path, stagekit):
    """Train at work (a gate the test opens, its events written by the test
    as the trainer's handler writes them): under its log, one line with the
    last step's figures, rewritten as steps come, not a line per step; not
    under another stage's log, nor once train has ended."""
    stagekit({"train": "gate"})
    cli("run", cwd=tmp_path)
    rd = RunDir(tmp_path / "runs/t")
    wait_for(lambda: rd.read_state()["stages"]["train"]["status"] == "running", timeout=120,
             what="train at its gate")
    app = make_app(rd, tmp_path)
    async with app.run_test(size=(80, 24)) as pilot:
        step = app.query_one("#log-step")

        async def at(n: int, loss: float) -> None:
            with EventWriter(rd.events_path("train")) as w:
                w.emit("metric", step=n, epoch=0, values={
                    "loss": loss, "full_acc_0": 0.9, "full_acc_1": 0.6, "full_acc_2": 0.3})
                w.emit("progress", done=n, total=400, unit="steps", rate=17.4, eta_s=60.0)
            await until(pilot, lambda: f"step {n}/400" in str(step.render()),
                        what=f"step {n} on the step line")
        await select_stage(app, pilot, "train")
        await at(10, 3.25)
        assert str(step.render()) == ("step 10/400 · loss 3.25 · acc 0.90 0.60 0.30 · "
                                      "17.4 steps/s · ETA 1m00s"), str(step.render())
        await at(11, 3.125)   # the same line, rewritten
        assert "loss 3.12" in str(step.render()) and step.display
        assert "step 10/400" not in screen_text(app)
        await select_stage(app, pilot, "vocab")
        await until(pilot, lambda: not step.display, what="the step line gone with train's log")
        await select_stage(app, pilot, "train")
        await until(pilot, lambda: step.display, what="the step line back under train's log")
        (rd.stage_dir("train") / "gate").write_text("open")
        await until(pilot, lambda: not step.display, what="the step line gone once train ended")


async def test_gpus_of_cluster_nodes_grouped_stale_marked_and_drilled(tmp_path, stagekit):
    """Nodes' telemetry files (written by the real per-node sampler, with
    SIMULATED GPUs) are shown one line per node at 80x24; `g` shows one
    node's GPUs, then the next node's, then all again; a node whose sampler
    stopped while its stage runs is marked STALE, not dropped."""
    import os
    import subprocess
    import sys

    from pipeline.cluster.node_telemetry import NodeWatch, folder, sample_forever
    stagekit({"extract": "sleep:120"})
    cli("run", cwd=tmp_path, check=0)
    rd = RunDir(tmp_path / "runs/t")
    wait_for(lambda: rd.read_state()["stages"]["extract"]["status"] == "running", timeout=60)
    os.environ["EAGLE_PANEL_SIMULATE_GPUS"] = "8"
    try:
        sample_forever(rd.path, "extract", interval=0.01, count=2)   # a node that then stops
    finally:
        del os.environ["EAGLE_PANEL_SIMULATE_GPUS"]
    mine = folder(rd.path) / f"{os.uname().nodename.split('.')[0]}.json"
    (folder(rd.path) / "gpu-a.json").write_text(mine.read_text().replace(
        f'"host": "{mine.stem}"', '"host": "gpu-a"'))
    mine.unlink()
    env = dict(os.environ, EAGLE_PANEL_SIMULATE_GPUS="4")
    live = subprocess.Popen([sys.executable, "-m", "pipeline.cluster.node_telemetry", "--run-dir",
                             str(rd.path), "--stage", "extract", "--interval", "0.5"], env=env)
    try:
        app = make_app(rd, tmp_path)
        async with app.run_test(size=(80, 24)) as pilot:
            app.nodes = NodeWatch(rd.path, stale_after_s=2.0)
            await pilot.press("2")
            await until(pilot, lambda: len(getattr(app.snapshot, "nodes", [])) == 2,
                        what="two nodes")
            await until(pilot, lambda: "STALE" in app.query_one(GpuTable).plain(), timeout=20,
                        what="the silent node marked stale")
            text = app.query_one(GpuTable).plain()
            lines = text.splitlines()
            a = next(ln for ln in lines if "gpu-a" in ln)
            b = next(ln for ln in lines if os.uname().nodename.split(".")[0] in ln)
            assert "STALE" in a and "extract" in b and "STALE" not in b, text
            assert " 8 " in a and " 4 " in b and "2 nodes report" in text and "SIMULATED" in text
            await pilot.press("g")
            await pilot.pause(0.3)
            text = app.query_one(GpuTable).plain()
            assert "node gpu-a (1 of 2)" in text and "7*" in text, text   # its 8 GPUs
            await pilot.press("g")
            await pilot.pause(0.3)
            text = app.query_one(GpuTable).plain()
            assert "(2 of 2)" in text and "3*" in text and "7*" not in text, text
            await pilot.press("g")
            await pilot.pause(0.3)
            assert "2 nodes report" in app.query_one(GpuTable).plain()
            assert all(len(ln) <= 80 for ln in app.query_one(GpuTable).plain().splitlines())
    finally:
        live.terminate()
        live.wait()
        cli("cancel", cwd=tmp_path, check=0)


async def test_training_tab_shows_acceptance_per_category(tmp_path, stagekit):
    """Evaluate's per-category acceptance (MT-bench's categories) as bars beside
    the curves, the lowest marked; evaluate's line reads like a sentence."""
    stagekit()
    cli("run", "--wait", cwd=tmp_path, check=0)
    rd = RunDir(tmp_path / "runs" / "t")
    with EventWriter(rd.events_path("evaluate")) as ev:
        ev.emit("stage_finished", status="succeeded", duration_s=60.0, summary={
            "acceptance_length": 3.02135231316726, "acceptance_estimate": 2.9978991596638656,
            "per_position": [0.84, 0.66, 0.49], "speedup": 0.958, "prompts": 16,
            "per_category": {"math": 1.81, "writing": 3.3, "coding": 2.9},
            "worst_category": {"category": "math", "acceptance_length": 1.81},
            "trackers": ["tensorboard --logdir /r/tracking/logs"]})
    app = make_app(rd, tmp_path, gpus=0)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("4")
        await pilot.pause(0.5)
        text = screen_text(app)
        assert "acceptance per category" in text
        lines = [ln for ln in text.splitlines() if "math" in ln or "writing" in ln]
        assert any("1.81" in ln for ln in lines) and any("3.30" in ln for ln in lines)
        app.query_one(StageTable).select("evaluate")
        await pilot.pause(0.3)
        detail = str(app.query_one("#detail").render())
        assert "acceptance 3.02 measured, 3.00 estimated · lowest: math 1.81 · speedup 0.96x" \
            in detail
        # the run's next steps on one line, the export first (a long path is cut at the edge)
        assert "\n  to ship it: eagle-panel export t (draft + model card) · trackers: " \
            "tensorboard --logdir /r/tracking/logs" in detail
        assert "to ship it: eagle-panel export t (draft + model card)" in screen_text(app)


def test_vllms_usual_shutdown_is_hidden_from_the_view_not_the_file():
    """A real server's stop (vLLM 0.32, from a run of this suite): the output
    handler's EngineDeadError traceback and the leak warnings are what every
    stop prints; the view hides them behind one line, the lines before the
    stop and a later start are all shown."""
    from pipeline.vllm.shutdown_noise import ShutdownNoise
    pre = "(APIServer pid=15531) "
    log = [pre + "INFO 12-02 14:34:49 [loggers.py:1] Engine 000: Avg prompt throughput",
           pre + "ERROR 12-02 14:34:49 [async_llm.py:906] before any stop: a real error",
           pre + "INFO 12-02 14:34:50 [launcher.py:254] [shutdown] API server: shutdown triggered",
           pre + "WARNING 12-02 14:34:50 [utils.py:648] [shutdown] Process manager: force "
                 "killing remaining processes count=1",
           pre + "ERROR 12-02 14:34:50 [async_llm.py:906] AsyncLLM output_handler failed.",
           pre + "ERROR 12-02 14:34:50 [async_llm.py:906] vllm.v1.engine.exceptions."
                 "EngineDeadError: EngineCore encountered an issue.",
           "INFO:     Application shutdown complete.",
           "/x/multiprocessing/resource_tracker.py:254: UserWarning: resource_tracker: There "
           "appear to be 1 leaked semaphore objects to clean up at shutdown",
           "  warnings.warn('resource_tracker: There appear to be %d '",
           pre + "INFO 12-02 14:40:00 [api_utils.py:286] non-default args: {'model': 'x'}",
           pre + "ERROR 12-02 14:40:09 [async_llm.py:906] after a new start: shown"]
    noise = ShutdownNoise()
    shown = [s for s in (noise.shown(line) for line in log) if s is not None]
    assert shown == log[:3] + [MARK, "INFO:     Application shutdown complete."] + log[-2:]
    assert noise.hidden == 5


def test_the_chart_labels_its_axis_marks_validation_and_refuses_log_of_zero():
    """y labelled every few rows; validation (a value an epoch) as marked points
    at its steps over the train curve; a log scale asked for on values that
    reach 0 stays linear (log10 of 0 drew a cliff at 1e-12) and says so."""
    import numpy as np

    from widgets.loss_chart import POINT, log_refused, plot
    x = np.arange(400.0)
    lines = plot([("loss", x, 1 / (x + 1)), ("val loss", np.array([199.0, 399.0]),
                                            np.array([0.5, 0.25]), "points")], 78, 14)
    labels = [ln.plain[:7].strip() for ln in lines[:-1]]
    assert len([v for v in labels if v]) >= 4 and labels[0] and labels[-1], labels
    ys = [float(v) for v in labels if v]
    assert ys == sorted(ys, reverse=True), ys            # top to bottom, decreasing
    marked = [(i, ln.plain.index(POINT)) for i, ln in enumerate(lines[:-1]) if POINT in ln.plain]
    assert len(marked) == 2 and marked[0][0] < marked[1][0], marked   # 0.5 above 0.25
    assert marked[1][1] == len(lines[0].plain) - 1                    # step 399: the right edge
    assert f"{POINT} val loss" in lines[-1].plain
    acc = [("full_acc_0", x, x / 500)]
    assert log_refused(acc) and not log_refused([("loss", x, 1 / (x + 1))])
    assert plot(acc, 78, 8, log=True)[0].plain == plot(acc, 78, 8)[0].plain


async def test_the_training_tab_is_the_selected_stages(tmp_path, stagekit):
    """evaluate selected: its own view (vLLM's acceptance per checkpoint, the
    chosen draft's line, bars per category and per position); another stage
    selected: train's view again, in the family it had; at 120x40 a second
    plot under the first."""
    stagekit({"train": "events:200"})
    cli("run", "--wait", cwd=tmp_path, check=0)
    rd = RunDir(tmp_path / "runs/t")
    w = EventWriter(rd.events_path("evaluate"))
    for step, al, rates in ((99, 2.4, (0.8, 0.4, 0.2)), (199, 3.1, (0.9, 0.7, 0.5))):
        w.emit("metric", step=step, epoch=str(step // 100), split="eval", values={
            "acceptance_length": al, "acceptance_estimate": al - 0.1,
            **{f"accept_rate_{k}": r for k, r in enumerate(rates)}})
    w.emit("stage_finished", status="succeeded", duration_s=9.0, summary={
        "checkpoint": "1", "acceptance_length": 3.1, "acceptance_estimate": 3.0,
        "per_position": [0.9, 0.7, 0.5], "per_category": {"coding": 3.4, "writing": 2.8},
        "measured": 2, "speedup": 1.2})
    w.close()
    app = make_app(rd, tmp_path)
    async with app.run_test(size=(120, 40)) as pilot:
        await select_stage(app, pilot, "train")
        await pilot.press("4", "a")                   # train's view, accuracy
        chart = app.query_one(LossChart)
        assert chart.metric == "full_acc" and not app.query_one("#categories").display
        await select_stage(app, pilot, "evaluate")
        await pilot.pause(0.3)
        assert chart.metric == "acceptance"
        tabs = app.query_one("#tabs")
        assert str(tabs.get_tab("training").label) == "4 Training: evaluate"
        info = str(app.query_one("#train-info").render())
        assert "acceptance 3.10 (vLLM), est. 3.00 · checkpoint 1, best of 2 · decode 1.20x" in info
        bars = str(app.query_one("#categories").render())
        assert app.query_one("#categories").display
        assert re.search(r"writing\s+█+\S*\s+2\.80", bars) and "position 3" in bars, bars
        drawn = str(chart.render())
        assert "measured (vLLM)" in drawn and "estimate (train)" in drawn
        assert "vLLM's accept rate per draft position" in drawn   # room for two at 120x40
        await select_stage(app, pilot, "vocab")
        await pilot.pause(0.3)
        assert chart.metric == "full_acc"                # the family train's view had
        assert str(tabs.get_tab("training").label) == "4 Training: train"
    async with make_app(rd, tmp_path).run_test(size=(80, 24)) as pilot:
        app = pilot.app
        await select_stage(app, pilot, "evaluate")
        await pilot.press("4")
        await pilot.pause(0.3)
        drawn = str(app.query_one(LossChart).render())
        assert "measured (vLLM)" in drawn and "accept rate per draft position" not in drawn
