"""One stage as the driver runs it, for the benchmarks that time stages on
a run of their own: `python -m pipeline.stages.NAME` in its own process,
the project on its PYTHONPATH; its wall time, or the stage's output tail
as the benchmark's exit message."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from pipeline.paths import pythonpath_with_project


def run(run_dir: Path, config: Path, name: str) -> float:
    env = dict(os.environ, PYTHONPATH=pythonpath_with_project(os.environ.get("PYTHONPATH")))
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", f"pipeline.stages.{name}", "--run-dir",
                        str(run_dir), "--config", str(config)], env=env, capture_output=True,
                       text=True, check=False)
    if p.returncode:
        raise SystemExit(f"the {name} stage exited {p.returncode}:\n{p.stdout[-3000:]}\n"
                         f"{p.stderr[-3000:]}")
    return time.perf_counter() - t0
