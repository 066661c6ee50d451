"""The train-overhead baseline shared by the benchmarks: speculators' trainer
called directly, with the flags the train stage recorded and the same shims,
against the train stage re-run on the same data."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

DIRECT = """
import json, sys, time
from speculators.train import cli
from speculators.train.config import TrainConfig
from pipeline.train import trainer as panel_trainer

class NoHooks:
    def on_total_steps(self, n, per_epoch): pass
    def should_stop(self): return False
    def request_stop(self): pass
    def on_interrupted(self, *a): pass

panel_trainer.install(cpu=sys.argv[2] == "cpu", hooks=NoHooks())
t0 = time.perf_counter()
cli.main(TrainConfig.resolve(json.loads(sys.argv[1])))
print("DIRECT_SECONDS", time.perf_counter() - t0)
"""


def recorded_argv(run: Path) -> list[str]:
    """The flags of the run's last finished train stage. `--logger ""` is
    lost when the recorded command line is split: put it back."""
    events = [json.loads(x) for x in (run / "train/events.jsonl").read_text().splitlines() if x]
    summary = [e for e in events if e["type"] == "stage_finished"][-1]["summary"]
    out = []
    for tok in summary["train_argv"].split()[2:]:
        out.append(tok)
        if tok == "--logger":
            out.append("")
    return out


def compare(run: Path, tmp: Path, device: str, sh) -> tuple[float, float, float]:
    """(stage wall s, direct wall s, trainer-alone s); `sh(args, cwd)` runs a
    command with the project on PYTHONPATH. Leaves the stage's checkpoints."""
    argv = recorded_argv(run)
    direct = list(argv)
    direct[direct.index("--save-path") + 1] = str(tmp / "direct" / "ckpt")
    direct[direct.index("--log-dir") + 1] = str(tmp / "direct" / "logs")
    t0 = time.perf_counter()
    out = sh([sys.executable, "-c", DIRECT, json.dumps(direct), device], tmp)
    direct_wall = time.perf_counter() - t0
    trainer = float(out.stdout.split("DIRECT_SECONDS")[1].split()[0])
    shutil.rmtree(run / "train/out")
    (run / "train/out").mkdir()
    t0 = time.perf_counter()
    sh([sys.executable, "-m", "pipeline.stages.train", "--run-dir", str(run)], tmp)
    return time.perf_counter() - t0, direct_wall, trainer
