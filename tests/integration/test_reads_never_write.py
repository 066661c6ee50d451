"""Reads never write: `status`, `logs`, `runs` and the panel leave a run
directory byte-identical (every file's bytes and mtime), with its stage alive
and after its supervisor and driver were killed. Only a launcher (`resume`)
records what it finds."""

import hashlib
import os
import signal

from app.panel import PanelApp
from pipeline.run.rundir import RunDir, pid_running
from pipeline.telemetry import Telemetry
from tests.helpers import cli, wait_for


def tree(path) -> dict:
    """Every file and folder under `path`: (size, mtime, content hash)."""
    out = {}
    for root, dirs, files in os.walk(path):
        for d in dirs:
            out[os.path.relpath(os.path.join(root, d), path)] = "dir"
        for f in files:
            p = os.path.join(root, f)
            st = os.stat(p)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, path)] = (st.st_size, st.st_mtime_ns,
                                                 hashlib.sha256(fh.read()).hexdigest())
    return out


async def look(tmp_path, rd) -> list[str]:
    """Everything a reader does to a run; returns what `status` printed."""
    said = [cli("status", cwd=tmp_path, check=0).stdout,
            cli("status", "--json", cwd=tmp_path, check=0).stdout]
    cli("logs", "prepare", cwd=tmp_path, check=0)
    cli("runs", cwd=tmp_path, check=0)
    app = PanelApp(rd, tmp_path / "config.toml", runs_dir=tmp_path / "runs",
                   telemetry=Telemetry(simulate=2))
    async with app.run_test(size=(80, 24)) as pilot:
        for key in ("1", "2", "3", "4", "down", "up"):
            await pilot.press(key)
            await pilot.pause(0.3)
        await pilot.pause(1.5)   # a few polls of the run's files
        said.append(str(app.query_one("#stages").get_cell("prepare", "Status")))
    return said


async def test_status_logs_and_the_panel_leave_the_run_untouched(tmp_path, stagekit):
    stagekit({"prepare": "graceful:300"})
    cli("run", cwd=tmp_path, check=0)
    rd = RunDir(tmp_path / "runs" / "t")
    wait_for((rd.stage_dir("prepare") / "graceful.ready").exists, what="the stage up")
    wait_for(lambda: rd.read_state()["stages"]["prepare"].get("pid"), what="its pid recorded")

    # 1. the stage alive, its driver waiting on it
    before = tree(rd.path)
    said = await look(tmp_path, rd)
    assert tree(rd.path) == before
    assert "running" in said[0] and said[-1] == "running"

    # 2. driver, supervisor and stage killed: state.json still says running
    state = rd.read_state()
    st = state["stages"]["prepare"]
    pids = [state["driver"]["pid"], st["supervisor_pid"], st["pid"]]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not any(pid_running(p) for p in pids), what="all three gone")
    before = tree(rd.path)
    said = await look(tmp_path, rd)
    assert tree(rd.path) == before, "a reader changed the run directory"
    assert rd.read_state()["stages"]["prepare"]["status"] == "running"   # nothing recorded
    # ...while every reader shows what it is
    assert "failed" in said[0] and '"status": "failed"' in said[1] and said[-1] == "failed"
    assert "supervisor are gone" in said[0]

    # 3. a launcher records it (and starts the stage again)
    cli("resume", cwd=tmp_path, check=0)
    wait_for(lambda: rd.read_state()["stages"]["prepare"]["attempt"] == 2,
             what="the second attempt")
    cli("cancel", "--grace", "5", cwd=tmp_path, check=0)
