"""The panel follows the work (a run of test stages, under Pilot): the
selection moves to each stage as it starts unless the user chose one in the
last minute, a failed stage is selected with its error; `l` cycles the
selected stage's log through its vLLM servers' logs; `status` and
`logs --server` show the same."""

import json

from textual.widgets import TabbedContent

from app.panel import PanelApp
from pipeline.run.events import EventWriter
from pipeline.run.rundir import RunDir
from pipeline.telemetry import Telemetry
from tests.helpers import cli, until, wait_for
from widgets.log_view import LogView
from widgets.stage_table import StageTable


def selected(app) -> str:
    return app.query_one(StageTable).selected_stage


async def test_the_selection_follows_a_run_and_a_failure(tmp_path, stagekit):
    stagekit({"regenerate": "sleep:2", "prepare": "sleep:3", "extract": "sleep:3",
              "vocab": "fail:3"})
    app = PanelApp(None, tmp_path / "config.toml", runs_dir=tmp_path / "runs",
                   telemetry=Telemetry(simulate=0))
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("r")
        await until(pilot, lambda: selected(app) == "prepare", what="prepare selected")
        # the user picks a stage: it is kept while the next one starts
        await pilot.press("down", "down", "down", "down")
        assert selected(app) == "evaluate"
        await until(pilot, lambda: app.view.stages["extract"].status == "running",
                    what="extract running")
        await pilot.pause(1.5)
        assert selected(app) == "evaluate"
        # a failure is selected, whatever the user chose, and its error shown
        await until(pilot, lambda: selected(app) == "vocab", timeout=60, what="vocab selected")
        await until(pilot, lambda: "failing on purpose" in str(app.query_one("#detail").render()),
                    what="vocab's error")


def fake_server_log(rd: RunDir, stage: str, k: int, text: str) -> None:
    (rd.stage_dir(stage) / f"vllm-{k}.log").write_text(text)


async def test_l_cycles_through_the_servers_logs_and_status_shows_their_starts(tmp_path,
                                                                               stagekit):
    stagekit({"extract": "graceful:120"})
    cli("run", cwd=tmp_path, check=0)
    rd = RunDir(tmp_path / "runs" / "t")
    wait_for((rd.stage_dir("extract") / "graceful.ready").exists, what="extract up")
    # what a stage that started two servers leaves: their logs and server events
    for k in (0, 1):
        fake_server_log(rd, "extract", k, f"server {k} says hello\n")
    with EventWriter(rd.events_path("extract")) as ev:
        ev.emit("server", server=0, phase="loading weights", elapsed_s=130.0, phase_s=100.0,
                last_line="Loading safetensors checkpoint shards: 12% Completed | 8/64",
                done=8, total=64, label="vLLM server", log=str(rd.stage_dir("extract")))
        ev.emit("server", server=1, phase="loading weights", elapsed_s=400.0, phase_s=390.0,
                last_line="Loading safetensors checkpoint shards: 3% Completed | 2/64",
                done=2, total=64, stalled_s=360.0, label="vLLM server")
    try:
        st = cli("status", cwd=tmp_path, check=0).stdout
        assert "vLLM server 0: loading weights 8/64 (2m10s)" in st
        assert "vLLM server 1: stalled 6m00s in loading weights" in st
        assert "last log line: Loading safetensors checkpoint shards: 3% Completed | 2/64" in st
        assert cli("logs", "extract", "--server", "1", cwd=tmp_path, check=0).stdout == \
            "server 1 says hello\n"
        p = cli("logs", "extract", "--server", "7", cwd=tmp_path, check=2)
        assert "its servers: 0, 1" in p.stderr
        app = PanelApp(rd, tmp_path / "config.toml", runs_dir=tmp_path / "runs",
                       telemetry=Telemetry(simulate=0))
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: selected(app) == "extract", what="extract selected")
            row = str(app.query_one("#row-extract").render())
            assert "servers 0/2 up" in row and "STALLED 6m" in row
            assert "stalled 6m00s in loading weights" in str(app.query_one("#detail").render())
            # ...and each starting server on its own line once none is stalled
            with EventWriter(rd.events_path("extract")) as ev:
                ev.emit("server", server=1, phase="loading weights", elapsed_s=410.0,
                        phase_s=400.0, last_line="", done=3, total=64, label="vLLM server")
            await until(pilot, lambda: "vLLM server 1: loading weights 3/64" in
                        str(app.query_one("#detail").render()), what="each server's line")
            assert "vLLM server 0: loading weights 8/64" in str(app.query_one("#detail").render())
            # both stopped, a third starting (evaluate's servers come one after another):
            # that one alone is counted, its time since the start counted on between reports
            with EventWriter(rd.events_path("extract")) as ev:
                for k in (0, 1):
                    ev.emit("server", server=k, phase="stopped", elapsed_s=0.0, phase_s=0.0,
                            last_line="", label="vLLM server")
                ev.emit("server", server=2, phase="starting", elapsed_s=20.0, phase_s=20.0,
                        last_line="", label="vLLM server")
            await until(pilot, lambda: "starting" in str(app.query_one("#row-extract").render()),
                        what="the third server's start on its own")
            row = str(app.query_one("#row-extract").render())
            assert "servers" not in row and "vLLM 2" in row, row
            await until(pilot, lambda: "vLLM 22s" in str(app.query_one("#row-extract").render()),
                        timeout=10, what="its time counted on between reports")
            log = app.query_one(LogView)
            tab = app.query_one(TabbedContent).get_tab("logs")
            for want, title in (("server 0 says hello", "1 Logs: extract · vLLM 0"),
                                ("server 1 says hello", "1 Logs: extract · vLLM 1"),
                                ("stagekit extract", "1 Logs: extract")):
                await pilot.press("l")
                await until(pilot, lambda w=want: any(w in line for line in log.lines),
                            what=want)
                assert str(tab.label) == title   # which log it is stays on the tab
    finally:
        cli("cancel", "--grace", "5", cwd=tmp_path)
    assert json.loads(cli("status", "--json", cwd=tmp_path, check=0).stdout)["stages"]
