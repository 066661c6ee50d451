"""What several test modules share: the project root, the real CLI in a
subprocess, waiting, test configs, and running one real stage in-process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cli(*args, cwd, timeout=120, check=None, env=None):
    """Run the real `eagle-panel` CLI in a subprocess."""
    full = dict(os.environ if env is None else env)
    full["PYTHONPATH"] = str(ROOT)
    p = subprocess.run([sys.executable, "-m", "app.cli", *map(str, args)], cwd=cwd,
                       capture_output=True, text=True, timeout=timeout, env=full)
    if check is not None:
        assert p.returncode == check, f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return p


def wait_for(pred, timeout=30.0, poll=0.05, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


async def until(pilot, pred, timeout=30.0, what="condition"):
    """A Pilot's wait for a condition on the running app."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        await pilot.pause(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def stagekit_config(tmp_path: Path, actions: dict[str, str] | None = None,
                    extra: str | dict = "", name: str = "t") -> Path:
    """A config whose stages are tests.fakes.stagekit, each with its action;
    `extra` (TOML text or tables) is laid over it table by table."""
    from pipeline.stage_graph import STAGE_NAMES
    from tests.configs import merged, write
    actions = actions or {}
    count = tmp_path / "starts.txt"
    tables = {"run": {"name": name, "runs_dir": "runs"},
              "runtime": {"cancel_grace_s": 2.0, "term_grace_s": 2.0},
              "stages": {stage: {"entry": "tests.fakes.stagekit",
                                 "env": {"STAGEKIT": actions.get(stage, "ok"),
                                         "STAGEKIT_COUNT": str(count)}}
                         for stage in STAGE_NAMES}}
    # every stage on (regenerate is off by default): all six run as test stages
    tables["stages"]["regenerate"]["enabled"] = True
    # what a launch checks against the built-in target (4 layers, 1,024 tokens)
    tables["stages"]["extract"]["layer_ids"] = [1, 2, 3]
    tables["stages"]["vocab"]["draft_vocab_size"] = 256
    return write(tmp_path / "config.toml", merged(tables, extra))


def run_body(tmp_path, stage, body, config: str, run="r"):
    """One real stage's body in this process, with the stage protocol
    around it; returns (exit code, run dir, its events)."""
    from pipeline.drive.stage_context import run_stage
    from pipeline.run.events import read_events
    from pipeline.run.rundir import RunDir
    cfg = tmp_path / "config.toml"
    # an empty config file is refused as a mistake: all defaults say so
    cfg.write_text(textwrap.dedent(config) or "# all defaults\n")
    old = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        code = run_stage(stage, body, ["--run-dir", str(tmp_path / run), "--config", str(cfg)])
    finally:
        signal.signal(signal.SIGINT, old[0])
        signal.signal(signal.SIGTERM, old[1])
    rd = RunDir(tmp_path / run)
    return code, rd, read_events(rd.events_path(stage))


def stage_summary(rd, stage: str) -> dict:
    """The summary of a stage's last `stage_finished` event."""
    from pipeline.run.events import read_events
    return finished(read_events(rd.events_path(stage)))["summary"]


def finished(events):
    return [e for e in events if e["type"] == "stage_finished"][-1]


def prepared_once(tmp_path_factory, name: str, config: str):
    """A run dir whose prepare stage is done, for a module's extract tests."""
    from pipeline.stages import prepare
    tmp = tmp_path_factory.mktemp(name)
    code, rd, _ = run_body(tmp, "prepare", prepare.body, config)
    assert code == 0
    return tmp, rd


def assert_forward_matches(got, want) -> None:
    """A file a stand-in's forward wrote (another process) against the hf
    backend's forward here, both float32 rounded to bf16: equal but for one
    bf16 rounding step. The two processes' float32 matmuls may sum in another
    order (other batch rows, another thread count on a loaded machine: seen on
    this AMX machine, <1% of values one step apart, only with two test
    workers busy); a wrong layer, position or token is off by far more."""
    import torch
    step = 2 ** -7   # bf16's relative step (8 bits of mantissa)
    torch.testing.assert_close(got, want, atol=step, rtol=step)


def slot_errors(rd, backend, n: int) -> list[float]:
    """Per hidden-state slot, the worst relative error (norm over the
    sequence) of the first `n` samples extract wrote against `backend`'s
    forward of the same tokens (an HFBackend: the reference)."""
    from datasets import load_from_disk
    from safetensors.torch import load_file
    ds = load_from_disk(str(rd.out_dir("prepare") / "data")).with_format(None)
    worst: list[float] = []
    for i in range(n):
        hs = load_file(rd.out_dir("extract") / "hidden_states" / f"hs_{i}.safetensors")
        hs = hs["hidden_states"].float()
        ref = backend.forward([ds[i]["input_ids"]])[0]
        errs = [((hs[:, s] - ref[:, s]).norm() / ref[:, s].norm()).item()
                for s in range(hs.shape[1])]
        worst = [max(a, b) for a, b in zip(worst, errs, strict=True)] if worst else errs
    return worst


def hs_files(rd):
    """The extract stage's hidden-state files, in name order."""
    return sorted((rd.out_dir("extract") / "hidden_states").glob("hs_*.safetensors"))


async def select_stage(app, pilot, stage: str) -> None:
    """Move the panel's stage cursor with the keys a user presses."""
    from pipeline.stage_graph import STAGE_NAMES
    key = "down" if STAGE_NAMES.index(stage) > STAGE_NAMES.index(
        app.main.selected_stage) else "up"
    while app.main.selected_stage != stage:
        await pilot.press(key)
    await pilot.pause(0.2)


async def kv_tab_text(app, pilot) -> str:
    """What the panel's KV-cache tab shows, as text."""
    await pilot.press("3")
    await pilot.pause(0.3)
    panel = app.query_one("#kvpanel")
    return "\n".join(strip.text for strip in panel.render_lines(panel.region.reset_offset))


def screen_text(app) -> str:
    """What the terminal shows, as lines of text (from Textual's own SVG
    screenshot, which places every cell)."""
    import html
    import re
    svg = app.export_screenshot()
    rows: dict[float, list] = {}
    for x, y, t in re.findall(r'<text class="[^"]*" x="([\d.]+)" y="([\d.]+)"[^>]*>(.*?)</text>',
                              svg):
        rows.setdefault(float(y), []).append((float(x), html.unescape(t)))
    return "\n".join("".join(t for _, t in sorted(rows[y])).replace("\xa0", " ")
                     for y in sorted(rows))


def summary_words(stage: str, summary: dict) -> str:
    """fmt.summary_text of a summary as its event's JSON holds it."""
    from pipeline.fmt import summary_text
    from pipeline.run.summaries import read
    return summary_text(stage, read(stage, summary))


def outcome_words(train: dict, evaluate: dict, state: dict, run_id: str = "") -> list[str]:
    """fmt.outcome_lines of train's and evaluate's summaries as JSON."""
    from pipeline.fmt import outcome_lines
    from pipeline.run.summaries import read
    return outcome_lines(read("train", train), read("evaluate", evaluate), state, run_id)
