"""Snapshots of the main screens at 80x24 and 160x48 (pytest-textual-snapshot).

The run is a real run of the test stages, normalised afterwards (fixed
times, fixed log text) so the pictures do not change from run to run; GPU
numbers come from the simulated source (seeded), host stats are left out.
"""

import json

import pytest

from app.panel import PanelApp
from pipeline.run.rundir import RunDir, atomic_write_json
from pipeline.telemetry import Telemetry
from tests.helpers import cli

pytestmark = pytest.mark.integration

T0 = 1_790_000_000.0


@pytest.fixture(scope="module")
def snap_run(tmp_path_factory):
    from tests.helpers import stagekit_config
    tmp = tmp_path_factory.mktemp("snap")
    stagekit_config(tmp, {"train": "events:400", "extract": "sleep:0.3"})
    cli("run", "--wait", cwd=tmp, check=0)
    rd = RunDir(tmp / "runs" / "t")
    state = rd.read_state()
    for i, (name, st) in enumerate(state["stages"].items()):
        st.update(started_at=T0 + 10 * i, ended_at=T0 + 10 * i + 7.5 + i)
        rd.log_path(name).write_text(
            f"===== eagle-panel: {name} attempt 1 =====\nstagekit {name}: working\n"
            + "".join(f"{name} step {k}: ok\n" for k in range(30)))
    atomic_write_json(rd.state_path, state)
    # one validation record so the acceptance estimate shows
    with open(rd.events_path("train"), "a") as f:
        f.write(json.dumps({"t": T0, "type": "metric", "step": 399, "epoch": 0, "split": "val",
                            "values": {"loss": 0.5, "full_acc_0": 0.7, "full_acc_1": 0.5}}) + "\n")
    return rd


def app_for(rd):
    return PanelApp(rd, telemetry=Telemetry(simulate=8, host=False), interval=3600,
                    clock=lambda: T0 + 100)


@pytest.mark.parametrize("size", [(80, 24), (160, 48)])
def test_main_screen(snap_compare, snap_run, size):
    assert snap_compare(app_for(snap_run), terminal_size=size)


@pytest.mark.parametrize("size", [(80, 24), (160, 48)])
def test_gpu_screen(snap_compare, snap_run, size):
    assert snap_compare(app_for(snap_run), press=["2"], terminal_size=size)


def test_training_screen(snap_compare, snap_run):
    assert snap_compare(app_for(snap_run), press=["4"], terminal_size=(80, 24))
